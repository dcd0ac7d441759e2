"""docs/metrics.md is generated from the code and must not be stale; every metric follows the
naming rules (prefix, base units, _total on counters, no target labels)."""

from __future__ import annotations

import os
import re
import statistics
from pathlib import Path

import pytest

from gpunet_exporter import HOME
from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.infiniband import InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.daemon import hotplug
from gpunet_exporter.mixin import configdoc
from gpunet_exporter.mixin.metricsdoc import own_metrics, render
from gpunet_exporter.mixin.thresholds import Thresholds
from gpunet_exporter.registry import SCRAPE_METRICS, discover
from gpunet_exporter.sources.ethtool import parse_stats_text
from gpunet_exporter.web.http import SCRAPES_REJECTED
from gpunet_exporter.web.httpserver import CONNECTIONS, CONNECTIONS_REFUSED

from support import sysfs_tree as st
from support.metrics import collect, make_collector, samples_of
from support.paths import FIXTURES, GOLDEN, REPO

ALL_SPECS = [*SCRAPE_METRICS, *hotplug.METRICS, SCRAPES_REJECTED, CONNECTIONS,
             CONNECTIONS_REFUSED, *(s for c in discover().values() for s in c.metrics)]

# HELP is one sentence plus its source (MetricSpec.full_help adds the source): the bound is on the
# sentence, what the value is; a source is a path or a command, as long as it is.
HELP_MAX = 100


def test_metrics_md_is_fresh() -> None:
    committed = (REPO / "docs" / "metrics.md").read_text()
    assert committed == render(), (
        "docs/metrics.md is stale: run `python -m gpunet_exporter.mixin`")


def test_configuration_keys_are_fresh() -> None:
    """The key table of docs/configuration.md is generated from the collectors' settings
    (tests/test_settings.py checks that its defaults are the dataclasses')."""
    text = (REPO / "docs" / "configuration.md").read_text()
    assert configdoc.refresh(text) == text, (
        "docs/configuration.md is stale: run `python -m gpunet_exporter.mixin`")


def test_every_exported_family_is_documented(tmp_path: Path) -> None:
    sysfs = st.build_dgx_h100(tmp_path)
    st.make_switchdev(sysfs)  # device-level hw_counters
    st.make_port_degraded(sysfs)
    documented = {s.name for s in ALL_SPECS}
    doc_text = (REPO / "docs" / "metrics.md").read_text()
    seen = set()
    for cls, cfg in ((InfinibandCollector, {}), (LinkCollector, {
            "ibv_devinfo": {"enabled": False},
            "expected_mtu": [{"mtu": 9000, "rdma_mtu": 4096, "link_layer": "Ethernet"}]})):
        samples, _ = collect(cls, sysfs, cfg)
        for name, _labels in samples:
            family = name  # counters are declared with their _total name
            assert family in documented, f"{family} is exported but not declared"
            assert f"`{family}`" in doc_text
            seen.add(family)
    # pfc: configuration from the OFED sysfs files, counters from the synthetic mlx5 capture.
    netdev = st.make_ofed_qos(sysfs)
    capture = FIXTURES / "synthetic/ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"
    stats = parse_stats_text(capture.read_text())

    class Capture:
        def read(self, ifname: str):  # type: ignore[no-untyped-def]
            if ifname != netdev:
                raise OSError(19, "No such device")
            return stats

        def close(self) -> None:
            pass

    pfc = make_collector(PfcCollector, sysfs, {"config": {"sources": ["sysfs"]}})
    pfc.reader = Capture()  # type: ignore[attr-defined]
    try:
        for name, _labels in samples_of(list(pfc.collect(Scrape()))):
            assert name in documented and f"`{name}`" in doc_text, name
            seen.add(name)
    finally:
        pfc.close()
    assert len(seen) > 80


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_naming_rules(spec) -> None:  # type: ignore[no-untyped-def]
    assert re.fullmatch(r"gpunet_[a-z0-9_]+", spec.name)
    assert spec.name.endswith("_total") == (spec.type == "counter")
    assert not {"hostname", "host", "instance", "job", "node"} & set(spec.labels)
    assert spec.help and spec.source, "HELP must say what the value is and where it comes from"
    if spec.unit == "bytes":
        assert spec.name.endswith(("_bytes", "_bytes_total")), spec.name
    if spec.unit == "bytes per second":
        assert spec.name.endswith("_bytes_per_second")
    if spec.unit == "seconds":
        assert spec.name.endswith(("_seconds", "_seconds_total"))
    for forbidden in ("_kb", "_mb", "_gb", "_ms", "_percent", "_bits"):
        assert forbidden not in spec.name
    if spec.name.endswith("_info"):
        assert spec.type == "gauge"


def _help_problem(spec) -> str:  # type: ignore[no-untyped-def]
    """Why the spec's HELP is not one short sentence plus its source, or ""."""
    sentence = spec.help.rstrip(".")
    if re.search(r"[.;] |\n", sentence):
        return f"more than one sentence: {sentence!r}"
    if len(sentence) > HELP_MAX:
        return f"{len(sentence)} characters, over {HELP_MAX}: {sentence!r}"
    return ""


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_help_is_one_sentence_plus_source(spec) -> None:  # type: ignore[no-untyped-def]
    """What the value is, in one sentence, and where it comes from; how to read it, edge cases
    and settings are in the prose docs (docs/<topic>.md), where an operator reads on."""
    problem = _help_problem(spec)
    assert not problem, problem


def test_help_lengths() -> None:
    """The median and longest HELP sentence, printed with -s; the bound above is the rule."""
    lengths = sorted(len(s.help) for s in ALL_SPECS)
    median = statistics.median(lengths)
    print(f"HELP sentences: {len(lengths)}, median {median}, max {lengths[-1]} characters")
    assert lengths[-1] <= HELP_MAX


def test_reading_metrics_names_declared_metrics() -> None:
    """docs/reading-metrics.md holds what the HELP sentences leave out; a metric it names by its
    full name must exist, so a rename does not leave the prose behind."""
    declared = {s.name for s in ALL_SPECS}
    declared |= {n.removesuffix("_total") for n in declared}
    text = (REPO / "docs" / "reading-metrics.md").read_text()
    named = set(re.findall(r"`(gpunet_[a-z0-9_]+[a-z0-9])`", text))
    assert named - declared == set()
    # every collector has its section
    for name in discover():
        assert f"## {name} collector" in text, name


def test_every_family_of_the_golden_scrape_is_documented() -> None:
    """The golden end-to-end scrape has every collector, GPUs and topology included, and the
    exporter's own process_* and python_* families."""
    documented = {s.name for s in [*ALL_SPECS, *own_metrics()]}
    doc_text = (REPO / "docs" / "metrics.md").read_text()
    golden = (GOLDEN / "dgx-h100-faults.prom").read_text()
    families = {line.split()[2] for line in golden.splitlines() if line.startswith("# TYPE ")}
    families = {f if f in documented else f + "_total" for f in families}  # counters' TYPE
    assert {f for f in families if f.startswith(("gpunet_gpu_", "gpunet_topology_"))}
    for family in families:
        assert family in documented, f"{family} is exported but not declared"
        assert f"`{family}`" in doc_text, family


def test_readme_counts_the_alerts_the_rules_hold() -> None:
    """The README's alert count is the generated rules file's, not a number written once."""
    from gpunet_exporter.mixin import rules

    readme = (REPO / "README.md").read_text()
    stated = re.search(r"\((\d+) alerts:", readme)
    assert stated, "README.md no longer says how many alerts there are"
    assert int(stated.group(1)) == len(rules.ALERT_NAMES)


# What the project says about itself, checked against the code that is its one home: the
# collector registry (discover()), the flags (build_parser), grafana/*.json and docs/*.md.
# Each check is a function of the text, so that test_fact_checks_can_fail can plant a wrong fact.

def _section(text: str, heading: str) -> str:
    """The body of a ``## heading`` section, up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def collector_table_problems(readme: str) -> list[str]:
    """The README's collector table against the registry: every collector, its default."""
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)` \| (on|off) \|", readme, re.M))
    code = {n: "on" if c.default_enabled else "off" for n, c in discover().items()}
    return [f"collector {n}: README says {rows.get(n)}, the code {code.get(n)}"
            for n in sorted(rows.keys() | code.keys()) if rows.get(n) != code.get(n)]


def readme_flags(readme: str) -> set[str]:
    """The flags the README's table names, shorthands spelt out: ``--a.device-include``,
    ``-exclude`` is two flags; ``<name>`` stands for every collector."""
    flags: set[str] = set()
    for line in _section(readme, "Flags").splitlines():
        if not line.startswith("| `-"):
            continue
        previous = ""
        for flag in re.findall(r"`(-[^`]+)`", line.split(" | ")[0]):
            if not flag.startswith("--"):  # a suffix of the flag before it
                flag = previous.rsplit("-", 1)[0] + flag
            previous = flag
            names = discover() if "<name>" in flag else [""]
            flags |= {flag.replace("<name>", n) for n in names}
    return flags


def flag_problems(readme: str) -> list[str]:
    from gpunet_exporter.options import build_parser

    parser = build_parser(discover())
    code = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    stated = readme_flags(readme)
    return ([f"{f}: a flag the README's table lacks" for f in sorted(code - stated)]
            + [f"{f}: in the README's table, not a flag" for f in sorted(stated - code)])


def dashboard_problems(readme: str) -> list[str]:
    files = {p.name for p in (REPO / "grafana").glob("*.json")}
    named = set(re.findall(r"`(gpunet-[a-z0-9-]+\.json)`", readme))
    return ([f"grafana/{f}: not named in README.md" for f in sorted(files - named)]
            + [f"{f}: named in README.md, not in grafana/" for f in sorted(named - files)])


def unreachable_docs(pages: dict[str, str]) -> list[str]:
    """The docs/*.md pages no chain of Markdown links reaches from README.md; ``pages`` maps a
    path relative to the repository to its text."""
    seen, todo = {"README.md"}, ["README.md"]
    while todo:
        page = todo.pop()
        folder = Path(page).parent
        for target in re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", pages.get(page, "")):
            path = Path(os.path.normpath(folder / target)).as_posix()
            if path not in seen:
                seen.add(path)
                todo.append(path)
    return sorted(p for p in pages if p.startswith("docs/") and p not in seen)


def _markdown_pages() -> dict[str, str]:
    return {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8")
            for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")]}


def broken_links(page: str, text: str) -> list[str]:
    """The relative Markdown links of ``page`` (a path relative to the repository) whose file is
    not in the checkout."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        path = os.path.normpath(REPO / Path(page).parent / target.split("#")[0])
        if not os.path.exists(path):
            out.append(f"{page}: {target}")
    return out


def test_links_between_the_pages_hold() -> None:
    pages = {p.relative_to(REPO).as_posix(): p.read_text(encoding="utf-8")
             for p in [*REPO.glob("*.md"), *REPO.glob("*/README.md"),
                       *(REPO / "docs").glob("*.md")]}
    assert len(pages) > 20
    assert [b for page, text in pages.items() for b in broken_links(page, text)] == []


def default_collectors_problems(systemd_default: str) -> list[str]:
    """The collectors systemd/gpunet-exporter.default says run by default, against the code."""
    said = re.search(r"collectors ([a-z0-9_, ]+?) and ([a-z0-9_]+)\b",
                     " ".join(systemd_default.replace("#", " ").split()))
    if not said:
        return ["systemd/gpunet-exporter.default no longer lists the default collectors"]
    stated = {*said.group(1).split(", "), said.group(2)}
    code = {n for n, c in discover().items() if c.default_enabled}
    return [f"default collectors: the file says {sorted(stated)}, the code {sorted(code)}"
            ] if stated != code else []


def architecture_problems(architecture: str) -> list[str]:
    row = next((line for line in architecture.splitlines()
                if line.startswith("| ") and "`src/gpunet_exporter/collectors/`" in line), "")
    listed = re.search(r"one module each \(([^)]*)\)", row)
    stated = set(re.findall(r"`([a-z0-9_]+)`", listed.group(1))) if listed else set()
    code = set(discover())
    return [f"docs/architecture.md's collectors {sorted(stated)}, the code's {sorted(code)}"
            ] if stated != code else []


def package_folder_problems(readme: str) -> list[str]:
    """The folders of src/gpunet_exporter/ the README's Development section names."""
    said = re.search(r"installs as `gpunet_exporter` from `src/gpunet_exporter/`:(.*?)\n\n",
                     _section(readme, "Development"), re.S)
    stated = set(re.findall(r"`([a-z_]+)/`", said.group(1))) if said else set()
    code = {p.parent.name for p in (REPO / "src" / "gpunet_exporter").glob("*/__init__.py")}
    return [f"src/gpunet_exporter/: README names {sorted(stated)}, the folders are "
            f"{sorted(code)}"] if stated != code else []


def test_readme_names_the_package_folders() -> None:
    assert package_folder_problems((REPO / "README.md").read_text()) == []


def capability_table_problems(install: str) -> list[str]:
    """docs/install.md's table of what each collector needs: a row for every collector."""
    section = _section(install, "Capabilities per collector")
    table = section[section.index("\n| collector |"):].split("\n\n")[0]
    stated = set(re.findall(r"^\| `([a-z0-9_]+)`", table, re.M))
    code = set(discover())
    return [f"docs/install.md's capability table: {sorted(stated)}, the collectors "
            f"{sorted(code)}"] if stated != code else []


def test_install_says_what_each_collector_needs() -> None:
    assert capability_table_problems((REPO / "docs" / "install.md").read_text()) == []


def test_readme_collector_table_is_the_registry() -> None:
    assert collector_table_problems((REPO / "README.md").read_text()) == []


def test_readme_flag_table_is_the_parser() -> None:
    assert flag_problems((REPO / "README.md").read_text()) == []


def test_readme_names_every_dashboard() -> None:
    """The README, and grafana/README.md beside the files."""
    assert dashboard_problems((REPO / "README.md").read_text()) == []
    assert dashboard_problems((REPO / "grafana" / "README.md").read_text()) == []


def test_every_doc_is_reachable_from_the_readme() -> None:
    """Directly or through docs/README.md, the index of every page."""
    pages = _markdown_pages()
    assert "docs/README.md" in pages and len(pages) > 15
    assert "](docs/README.md)" in pages["README.md"]
    assert unreachable_docs(pages) == []
    index = pages["docs/README.md"]
    assert not [p for p in pages if p.startswith("docs/") and p != "docs/README.md"
                and f"]({p.removeprefix('docs/')})" not in index]


def test_systemd_default_names_the_default_collectors() -> None:
    text = (REPO / "systemd" / "gpunet-exporter.default").read_text()
    assert default_collectors_problems(text) == []


def test_architecture_names_every_collector() -> None:
    assert architecture_problems((REPO / "docs" / "architecture.md").read_text()) == []


def test_fact_checks_can_fail() -> None:
    """Each check above, given a planted wrong fact, says so."""
    readme = (REPO / "README.md").read_text()
    assert collector_table_problems(readme.replace("| `nccl` | on |", "| `nccl` | off |"))
    assert collector_table_problems(re.sub(r"^\| `fabric` \|.*\n", "", readme, flags=re.M))
    assert flag_problems(readme.replace("`--collector.topology.device-include`, `-exclude`",
                                        "`--collector.topology.device-include`"))
    assert flag_problems(readme.replace("`--log.format`", "`--log.form`"))
    assert readme_flags("\n## Flags\n| `--a.b-include`, `-exclude` | |\n## X\n") == {
        "--a.b-include", "--a.b-exclude"}
    assert dashboard_problems(readme.replace("`gpunet-pairs.json`", "pairs"))
    pages = _markdown_pages()
    index = pages["docs/README.md"]
    assert unreachable_docs({"README.md": "[docs](docs/README.md)", "docs/README.md": "[a](a.md)",
                             "docs/a.md": "[b](./b.md#part)", "docs/b.md": "[up](../README.md)",
                             "docs/c.md": "[a](a.md)"}) == ["docs/c.md"]
    assert "[fleet.md](fleet.md)" in index
    assert unreachable_docs({**pages, "docs/new.md": "# New\n"}) == ["docs/new.md"]
    assert broken_links("docs/README.md", index.replace("](fleet.md)", "](fleets.md)")) == [
        "docs/README.md: fleets.md"]
    systemd_default = (REPO / "systemd" / "gpunet-exporter.default").read_text()
    assert default_collectors_problems(systemd_default.replace(" nccl,", ""))
    assert default_collectors_problems(systemd_default.replace("pfc\n#", "pfc, fabric\n#"))
    assert package_folder_problems(readme.replace("`health/`", "`exporter/`"))
    install = (REPO / "docs" / "install.md").read_text()
    assert capability_table_problems(re.sub(r"^\| `nccl` \|.*\n", "", install, flags=re.M))
    architecture = (REPO / "docs" / "architecture.md").read_text()
    assert architecture_problems(architecture.replace(", `nccl`)", ")"))


def test_readme_prometheus_snippet_fits_the_rules_and_dashboards() -> None:
    """The README's prometheus.yml: the scrape job is the thresholds' default `job` (the one
    the rules select by), it loads the rule file, and its relabelling turns a target's address
    into the node's name, the `instance` the dashboards and the fleet's `peer` expect; the
    runbook paragraph names the default `runbook_url`."""
    import yaml

    from gpunet_exporter.mixin import thresholds

    readme = (REPO / "README.md").read_text()
    found = re.search(r"```yaml\n# prometheus\.yml\n(.*?)```", readme, re.S)
    assert found, "README.md has no prometheus.yml snippet"
    config = yaml.safe_load(found.group(1))
    assert config["rule_files"][0].endswith("gpunet.rules.yml")
    (job,) = config["scrape_configs"]
    t = thresholds.defaults()
    assert job["job_name"] == t.job
    (relabel,) = job["relabel_configs"]
    assert relabel["source_labels"] == ["__address__"] and relabel["target_label"] == "instance"
    targets = job["static_configs"][0]["targets"]
    assert all(a.endswith(":19400") for a in targets)
    # Prometheus anchors the regex and expands $1 as Python's \1.
    pattern = re.compile(relabel["regex"])
    assert [pattern.fullmatch(a).expand(relabel["replacement"].replace("$1", r"\1"))  # type: ignore[union-attr]
            for a in targets] == [a.rpartition(":")[0] for a in targets]
    assert f"`{t.runbook_url}`" in readme and "runbook_url: https://" in readme


def test_the_unknown_checks_runbook_lists_every_check_and_reason() -> None:
    """GpunetCheckUnknown's runbook has a row for each check a collector declares
    (unknown_checks: its collector and what goes unchecked) and for each reason of
    UNKNOWN_REASONS; the doctor's confirm commands are for declared checks."""
    from gpunet_exporter.collector import UNKNOWN_REASONS
    from gpunet_exporter.mixin.alerts.exporter import CONFIRM

    text = _section((REPO / "docs" / "runbooks.md").read_text(), "GpunetCheckUnknown")
    checks = {m[0]: (m[1], m[2]) for m in re.findall(
        r"^\| `([a-z_0-9]+)` \| ([a-z]+) \| (.+) \|$", text, re.M)}
    declared = {check: (name, what) for name, cls in discover().items()
                for check, what in cls.unknown_checks.items()}
    assert checks == declared
    reasons = set(re.findall(r"^\| `([a-z_]+)` \| [^|]+ \|$", text, re.M))
    assert reasons == set(UNKNOWN_REASONS), reasons ^ set(UNKNOWN_REASONS)
    assert set(CONFIRM) <= declared.keys()


def test_the_project_home_is_claimed_once() -> None:
    """The runbook links' default is the runbooks at the project's home, which pyproject.toml
    claims ([project.urls], shown by pip and PyPI) and the README states."""
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[project\.urls\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.urls]"
    urls = dict(re.findall(r'^(\w+) = "([^"]+)"$', section.group(1), re.M))
    assert urls["Homepage"] == HOME
    assert all(u == HOME or u.startswith(HOME + "/") for u in urls.values()), urls
    default = Thresholds().runbook_url
    assert urls["Runbooks"] == default == f"{HOME}/blob/main/docs/runbooks.md"
    assert f"the default is `{default}`" in (REPO / "README.md").read_text()


def test_the_docs_state_the_supervisors_skip_grace_as_the_code_has_it() -> None:
    """``SKIP_GRACE`` is written once, in probe/supervisor.py; where a page names its value it
    says the same."""
    from gpunet_exporter.probe.supervisor import SKIP_GRACE

    pages = {**_markdown_pages(), "CHANGELOG.md": (REPO / "CHANGELOG.md").read_text()}
    stated = [(page, float(n)) for page, text in pages.items()
              for n in re.findall(r"`SKIP_GRACE` \((\d+(?:\.\d+)?) s\)", text)]
    assert len(stated) >= 2, stated
    assert [(page, n) for page, n in stated if n != SKIP_GRACE] == []
