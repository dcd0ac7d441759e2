"""kubernetes/: the fleet pair probe manifests, checked offline.

Every document is validated against the Kubernetes API's own schemas (the OpenAPI-derived JSON
schemas that kubernetes-validate bundles per Kubernetes release) in strict mode, where a field
the API does not know is an error. Those schemas check structure, types and required fields,
not enum values nor the API server's cross-field rules, so the rest is checked here: what the
probe needs of the manifests (the rendezvous names pod 0 of the headless Service, N is one
number, the hostPath is the exporter's probe.state_dir, node names come from spec.nodeName, one
pod per node, the run ends before the next), with the pods' arguments expanded the way the
kubelet expands them and parsed by torchrun's and `gpunet-probe fleet`'s own parsers.

`kubectl apply --dry-run=client` is no offline check: it fetches the schemas from a cluster
(with none, it fails on the connection). `kubectl kustomize` renders offline and is used for
kustomization.yaml (kubectl of the test extras). No cluster ran these manifests here.
"""

from __future__ import annotations

import copy
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpunet_exporter.collectors.probe import ProbeSettings
from gpunet_exporter.flags import Parser
from gpunet_exporter.mixin import thresholds
from gpunet_exporter.probe import fleet

from support.kube import kustomize
from support.paths import REPO

KUBE = REPO / "kubernetes"
KUSTOMIZATION = KUBE / "kustomization.yaml"
# The oldest release the manifests claim (the batch.kubernetes.io/job-name label of Job pods
# came in 1.27) and recent ones, up to the newest kubernetes-validate bundles.
VERSIONS = ("1.27.0", "1.34.0", "1.37.0")
# A Job's name as the CronJob controller makes it: <cronjob>-<scheduled time in minutes since
# 1970> (8 digits until the year 2160).
SCHEDULED_MINUTES = 29_400_017
# What the downward API can put in an environment variable (core/v1 validation).
FIELD_PATHS = re.compile(r"^(metadata\.(name|namespace|uid)|spec\.(nodeName|serviceAccountName)"
                         r"|status\.(hostIP|hostIPs|podIP|podIPs)"
                         r"|metadata\.(labels|annotations)\['[^']+'\])$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def manifests() -> list[Path]:
    return sorted(p for p in KUBE.glob("*.yaml") if p != KUSTOMIZATION)


def documents(paths: list[Path] | None = None) -> list[dict[str, Any]]:
    return [d for p in (paths or manifests())
            for d in yaml.safe_load_all(p.read_text(encoding="utf-8")) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(kind, the name of the Jobs it makes, the Job spec) of the CronJob and the Jobs."""
    for d in docs:
        if d["kind"] == "CronJob":
            yield ("CronJob", f"{d['metadata']['name']}-{SCHEDULED_MINUTES}",
                   d["spec"]["jobTemplate"]["spec"])
        elif d["kind"] == "Job":
            yield "Job", d["metadata"]["name"], d["spec"]


WORKLOADS = [pytest.param(name, spec, id=f"{kind}/{name}")
             for kind, name, spec in workloads(documents())]


def container(job: Mapping[str, Any]) -> dict[str, Any]:
    containers = job["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def pod_labels(job: Mapping[str, Any], job_name: str, index: int) -> dict[str, str]:
    """A pod's labels: the template's and those the Job controller adds."""
    return {**job["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": job_name,
            "job-name": job_name, "batch.kubernetes.io/job-completion-index": str(index)}


def pod_env(job: Mapping[str, Any], job_name: str, index: int) -> dict[str, str]:
    """The environment the kubelet gives pod ``index``'s container on node gpu-node-<index>:
    its env, downward-API references resolved, and the Job controller's JOB_COMPLETION_INDEX."""
    labels = pod_labels(job, job_name, index)
    fields = {"spec.nodeName": f"gpu-node-{index}", "status.podIP": f"10.0.0.{index + 10}",
              "metadata.namespace": "gpunet-exporter",
              **{f"metadata.labels['{k}']": v for k, v in labels.items()}}
    env: dict[str, str] = {}
    for e in container(job).get("env", []):
        if "value" in e:  # an env value sees the variables before it
            env[e["name"]] = expand(e["value"], env)
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert FIELD_PATHS.match(path), f"{e['name']}: the downward API has no {path}"
            env[e["name"]] = fields[path]
    env["JOB_COMPLETION_INDEX"] = str(index)  # appended by the Job controller (Indexed)
    return env


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command, args and env values: a defined variable is
    replaced, an undefined reference stays as written, $$ is one $."""
    return re.sub(r"\$\$|\$\(([^)]*)\)",
                  lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def argv(job: Mapping[str, Any], job_name: str, index: int = 0) -> list[str]:
    env = pod_env(job, job_name, index)
    c = container(job)
    words = [expand(w, env) for w in [*c.get("command", []), *c.get("args", [])]]
    assert not [w for w in words if "$(" in w], f"unresolved references: {words}"
    return words


def torchrun(job: Mapping[str, Any], job_name: str, index: int = 0) -> Any:
    """The container's torchrun command line, parsed by torchrun's own parser."""
    run = pytest.importorskip("torch.distributed.run", reason="torch (the probe extra)")
    words = argv(job, job_name, index)
    assert words[0] == "torchrun", words
    return run.get_args_parser().parse_args(words[1:])


def fleet_args(job: Mapping[str, Any], job_name: str) -> Any:
    """The `gpunet-probe fleet` arguments of the container, parsed by the fleet's parser."""
    t = torchrun(job, job_name)
    assert t.module and t.training_script == "gpunet_exporter.probe.cli", t
    assert t.training_script_args[:1] == ["fleet"], t.training_script_args
    p = Parser(prog=fleet.PROG)
    fleet.add_arguments(p)
    return p.parse_args(t.training_script_args[1:])


def rdzv_conf(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(",") if item)


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) applied to ``labels``."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = ok and {"In": has and value in e.get("values", []),
                     "NotIn": not has or value not in e.get("values", []),
                     "Exists": has, "DoesNotExist": not has}[e["operator"]]
    return ok


def hourly_period(schedule: str) -> int:
    """Seconds between runs of a `M * * * *` schedule; other forms are not what the docs say."""
    assert re.fullmatch(r"[0-9]{1,2} \* \* \* \*", schedule), schedule
    assert int(schedule.split()[0]) < 60
    return 3600


# -- the schemas -------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
def test_every_document_is_valid_in_strict_mode(version: str) -> None:
    docs = documents()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["CronJob", "Job", "Namespace", "PriorityClass", "Service"], kinds
    for d in docs:
        assert kubernetes_validate.validate(d, version, strict=True) == version.rsplit(".", 1)[0]


def test_a_broken_document_fails_validation() -> None:
    """The validation sees the mistakes a hand-edited manifest has: a field spelt wrong deep in
    the pod template (which the non-strict schemas let through, and the API server would drop
    with a warning), a wrong type, a required field missing."""
    cron = one(documents(), "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]

    def fails(mutate: Any, strict: bool = True) -> str:
        doc = copy.deepcopy(cron)
        mutate(doc["spec"]["jobTemplate"]["spec"]["template"]["spec"])
        with pytest.raises(kubernetes_validate.ValidationError) as got:
            kubernetes_validate.validate(doc, VERSIONS[-1], strict=strict)
        return str(got.value.message)

    def misspell(spec: dict[str, Any]) -> None:
        spec["subDomain"] = spec.pop("subdomain")

    assert "'subDomain' was unexpected" in fails(misspell)
    doc = copy.deepcopy(cron)
    misspell(doc["spec"]["jobTemplate"]["spec"]["template"]["spec"])
    kubernetes_validate.validate(doc, VERSIONS[-1], strict=False)  # why strict mode is used

    def field_path(spec: dict[str, Any]) -> None:
        ref = next(e for e in spec["containers"][0]["env"] if "valueFrom" in e)
        ref["valueFrom"]["fieldRef"]["fieldpath"] = ref["valueFrom"]["fieldRef"].pop("fieldPath")

    assert "'fieldPath' is a required property" in fails(field_path)
    assert "is not of type 'array'" in fails(
        lambda s: s["containers"][0]["securityContext"]["capabilities"].update(add="IPC_LOCK"))
    assert pod["subdomain"]  # the original is untouched


# -- what the probe needs ------------------------------------------------------------------------

@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_the_rendezvous_is_pod_0_of_the_headless_service(job_name: str, job: dict[str, Any]
                                                         ) -> None:
    docs = documents()
    svc = one(docs, "Service")
    pod = job["template"]["spec"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"].get("publishNotReadyAddresses") is True
    # The Job controller names pod <index> <job-name>-<index>; with the Service as subdomain its
    # DNS name is <job-name>-<index>.<service> in the pod's namespace.
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(job, job_name, 0))
    t = torchrun(job, job_name)
    host, port = t.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job_name}-0.{svc['metadata']['name']}"
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    assert int(port) in {p["containerPort"] for p in container(job)["ports"]
                         if p["name"] == "rdzv"}
    assert t.rdzv_backend == "c10d" and t.rdzv_id == job_name
    assert t.local_addr == "10.0.0.10"  # the pod's (the node's) address, not its FQDN
    # Every pod names the same endpoint: the job's pod 0, whatever its own index.
    assert torchrun(job, job_name, index=3).rdzv_endpoint == t.rdzv_endpoint
    # Pod names are DNS labels: <job-name>-<index> of the last index fits in 63 characters.
    assert DNS_LABEL.match(f"{job_name}-{job['completions'] - 1}"), job_name
    assert DNS_LABEL.match(svc["metadata"]["name"])


@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_n_is_one_number(job_name: str, job: dict[str, Any]) -> None:
    t = torchrun(job, job_name)
    assert job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == int(t.nnodes) >= 2
    assert t.nproc_per_node == "1" and t.max_restarts == 0


@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_the_fleet_arguments_parse_and_write_where_the_exporter_reads(
        job_name: str, job: dict[str, Any]) -> None:
    state_dir = ProbeSettings().state_dir
    args = fleet_args(job, job_name)
    assert args.state_dir == state_dir
    mounts = {m["name"]: m for m in container(job)["volumeMounts"]}
    volumes = {v["name"]: v for v in job["template"]["spec"]["volumes"]}
    state = [n for n, m in mounts.items() if m["mountPath"] == state_dir]
    assert len(state) == 1 and not mounts[state[0]].get("readOnly")
    assert volumes[state[0]]["hostPath"]["path"] == state_dir
    assert volumes[state[0]]["hostPath"]["type"] == "DirectoryOrCreate"
    assert args.port in {p["containerPort"] for p in container(job)["ports"]
                         if p["name"] == "pair"}
    # NVML's PIDs are the host's: the pair ends look them up in the host's /proc, read-only
    proc = [n for n, m in mounts.items() if m["mountPath"] == args.procfs]
    assert len(proc) == 1 and mounts[proc[0]].get("readOnly") is True
    assert volumes[proc[0]]["hostPath"] == {"path": "/proc", "type": "Directory"}


@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_node_names_are_the_kubernetes_node_names(job_name: str, job: dict[str, Any]) -> None:
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
            for e in container(job)["env"] if "valueFrom" in e}
    assert refs["GPUNET_NODE"] == "spec.nodeName"
    assert refs["JOB_NAME"] == "metadata.labels['batch.kubernetes.io/job-name']"
    assert refs["POD_IP"] == "status.podIP"
    env = pod_env(job, job_name, 2)
    assert fleet.node_name(fleet_args(job, job_name), env) == "gpu-node-2"


@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_one_pod_per_node(job_name: str, job: dict[str, Any]) -> None:
    """A required anti-affinity on the node, among the pods of the probe: any two pods of a run
    (and of two runs) repel each other."""
    terms = job["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    a, b = pod_labels(job, job_name, 0), pod_labels(job, job_name, 1)
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"], a)
               and selects(t["labelSelector"], b) for t in terms), terms


@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_the_idle_node_policy(job_name: str, job: dict[str, Any]) -> None:
    """Every GPU of the node requested, at a priority that never preempts anything."""
    docs = documents()
    limits = container(job)["resources"]["limits"]
    requests = container(job)["resources"].get("requests", {})
    assert isinstance(limits["nvidia.com/gpu"], int) and limits["nvidia.com/gpu"] >= 1
    assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"]
    # and a pair uses them all: every GPU (and the NIC next to it) carries the pair's traffic
    assert fleet_args(job, job_name).gpus_per_node == limits["nvidia.com/gpu"]
    pc = one(docs, "PriorityClass", job["template"]["spec"]["priorityClassName"])
    assert pc["preemptionPolicy"] == "Never" and pc["value"] < 0
    assert not pc.get("globalDefault")
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize(("job_name", "job"), WORKLOADS)
def test_host_network_and_its_privileges(job_name: str, job: dict[str, Any]) -> None:
    pod = job["template"]["spec"]
    # On the host network only ClusterFirstWithHostNet resolves the Service's names.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    sc = container(job)["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    # uid 0, whatever the image's user (the exporter's is 65534): an added capability takes
    # effect for root only; group 65534 writes the host folder the init container hands over.
    assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"]) == (0, 65534, False)
    [init] = pod["initContainers"]
    assert init["name"] == "probe-state-owner" and init["image"] == container(job)["image"]
    isc = init["securityContext"]
    assert isc["runAsUser"] == 0 and isc["allowPrivilegeEscalation"] is False
    assert isc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    state = ProbeSettings().state_dir
    assert [m["mountPath"] for m in init["volumeMounts"]] == [state]
    assert state in init["command"][-1]
    # The pod's namespace lets it be: Pod Security's baseline level refuses hostNetwork,
    # hostPath and IPC_LOCK.
    docs = documents()
    ns = one(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    owner = one(docs, "Job" if job_name == "gpunet-fleet-repair" else "CronJob")
    assert owner["metadata"]["namespace"] == ns["metadata"]["name"]


def test_a_run_ends_before_the_next_and_stale_is_three_periods() -> None:
    cron = one(documents(), "CronJob")
    spec, job = cron["spec"], cron["spec"]["jobTemplate"]["spec"]
    period = hourly_period(spec["schedule"])
    assert spec["concurrencyPolicy"] == "Forbid"
    assert 0 < spec["startingDeadlineSeconds"] < period
    assert spec["successfulJobsHistoryLimit"] <= 3
    t = torchrun(job, f"{cron['metadata']['name']}-{SCHEDULED_MINUTES}")
    conf = rdzv_conf(t.rdzv_conf)
    # torchrun's wait for late pods ends before the Job's deadline, which ends before the next
    # start; a run that cannot gather N nodes fails within the period.
    assert int(conf["join_timeout"]) < job["activeDeadlineSeconds"] < period
    assert int(conf["read_timeout"]) <= int(conf["join_timeout"])
    # The period the thresholds and dashboards describe; GpunetFleetProbeStale fires after
    # three missed periods.
    assert period == thresholds.PLAN_PERIOD_SECONDS
    assert thresholds.defaults().fleet.stale_seconds == 3 * period


def test_the_repair_job_is_the_hourly_pod_on_named_nodes() -> None:
    docs = documents()
    cron = one(docs, "CronJob")["spec"]["jobTemplate"]["spec"]
    repair = one(docs, "Job")
    job = repair["spec"]
    args = fleet_args(job, repair["metadata"]["name"])
    terms = job["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 1 and len(terms[0]["matchFields"]) == 1
    field = terms[0]["matchFields"][0]
    assert field["key"] == "metadata.name" and field["operator"] == "In"
    nodes = field["values"]
    suspects = args.suspects.split(",")
    assert args.kind == "repair"
    assert len(set(nodes)) == len(nodes) == job["completions"]
    assert set(suspects) <= set(nodes) and 2 * len(suspects) <= len(nodes)

    def template(spec: Mapping[str, Any]) -> dict[str, Any]:
        t = copy.deepcopy(dict(spec["template"]))
        t["spec"]["affinity"].pop("nodeAffinity", None)
        c = t["spec"]["containers"][0]
        c["args"] = [a for a in c["args"] if not a.startswith(("--kind", "--suspects", "--hops"))]
        c["env"] = [e for e in c["env"] if e["name"] != "GPUNET_FLEET_NODES"]
        return t

    assert template(job) == template(cron)
    for key in ("completionMode", "backoffLimit", "activeDeadlineSeconds"):
        assert job[key] == cron[key], key


# -- kustomization.yaml --------------------------------------------------------------------------

def by_kind_and_name(d: Mapping[str, Any]) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


def test_the_kustomization_makes_the_manifests(tmp_path: Path) -> None:
    """Its knobs hold the manifests' own values: it renders exactly them."""
    made = kustomize(KUBE, tmp_path)
    base = documents([KUBE / f for f in yaml.safe_load(KUSTOMIZATION.read_text())["resources"]])
    assert sorted(made, key=by_kind_and_name) == sorted(base, key=by_kind_and_name)


def test_the_kustomization_knobs_reach_every_place(tmp_path: Path) -> None:
    """N, the period, the GPUs and the image changed in kustomization.yaml alone: the rendered
    CronJob is valid and consistent (the env patch merges by name, it does not replace the
    list)."""
    folder = tmp_path / "kubernetes"
    folder.mkdir()
    for p in KUBE.glob("*.yaml"):
        shutil.copy(p, folder / p.name)
    text = KUSTOMIZATION.read_text(encoding="utf-8")
    changed = (text.replace("completions: 4", "completions: 16")
               .replace("parallelism: 4", "parallelism: 16").replace('value: "4"', 'value: "16"')
               .replace('"17 * * * *"', '"41 * * * *"').replace("nvidia.com/gpu: 8",
                                                                 "nvidia.com/gpu: 4")
               .replace('value: "8"', 'value: "4"')
               .replace("newName: ghcr.io/OWNER/gpunet-exporter", "newName: registry.example/gx")
               .replace("newTag: VERSION", 'newTag: "1.2.3"'))
    assert changed.count("16") == 3
    (folder / "kustomization.yaml").write_text(changed, encoding="utf-8")
    made = kustomize(folder, tmp_path)
    for d in made:
        kubernetes_validate.validate(d, VERSIONS[-1], strict=True)
    cron = one(made, "CronJob")
    job = cron["spec"]["jobTemplate"]["spec"]
    t = torchrun(job, f"{cron['metadata']['name']}-{SCHEDULED_MINUTES}")
    assert job["completions"] == job["parallelism"] == int(t.nnodes) == 16
    assert cron["spec"]["schedule"] == "41 * * * *"
    c = container(job)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert fleet_args(job, f"{cron['metadata']['name']}-{SCHEDULED_MINUTES}").gpus_per_node == 4
    assert c["image"] == "registry.example/gx:1.2.3"
    assert {e["name"] for e in c["env"]} == {e["name"] for e in container(
        one(documents(), "CronJob")["spec"]["jobTemplate"]["spec"])["env"]}
