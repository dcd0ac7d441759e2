"""Typed configuration (issue 17): each collector's section is declared once, as a frozen
dataclass of settings, and parsed once at start; the schema a config file is checked against,
the defaults --help shows, docs/configuration.md and the collector's code all read that one
declaration. Third-party collectors declare theirs the same way."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from prometheus_client.core import GaugeMetricFamily, Metric

from gpunet_exporter.collector import Collector, Scrape, build_collector
from gpunet_exporter.collectors.infiniband import InfinibandSettings, RateRule
from gpunet_exporter.collectors.link import IbvDevinfoSettings, LinkCollector, LinkSettings
from gpunet_exporter.collectors.pfc import SOURCES, PfcSettings
from gpunet_exporter.collectors.probe import ProbeSettings
from gpunet_exporter.config import (
    Settings,
    load_file,
    make_settings,
    parse_settings,
    setting,
    settings_fields,
    settings_items,
    with_setting,
)
from gpunet_exporter.errors import ConfigError
from gpunet_exporter.mixin import configdoc
from gpunet_exporter.options import build_parser, config_type, resolve, start_collectors
from gpunet_exporter.registry import discover

from support.paths import REPO, UPSTREAM

SYSFS = str(UPSTREAM / "node_exporter-sysfs-infiniband" / "tree" / "sys")
CLASSES = discover()


def resolved(tmp_path: Path, text: str | None, *flags: str,
             classes: dict[str, type[Collector]] = CLASSES) -> dict[str, Settings]:
    """Each collector's settings as the exporter resolves them from a config file (``text``)
    and flags."""
    parser = build_parser(classes)
    argv = [f"--path.sysfs={SYSFS}", *flags]
    config = None
    if text is not None:
        path = tmp_path / "gpunet.yml"
        path.write_text(text)
        config = load_file(str(path), config_type(classes))
        argv.append(f"--config.file={path}")
    _, settings = resolve(parser.parse_args(argv), classes, config, parser)
    return settings


# ---- nested maps --------------------------------------------------------------------------------

def test_a_nested_map_missing_from_the_file_has_its_keys_defaults(tmp_path: Path) -> None:
    settings = resolved(tmp_path, "link: {interfaces: [eth9]}\n"
                                 "pfc: {config: {interval_seconds: 5}}\n")
    link = settings["link"]
    assert isinstance(link, LinkSettings)
    assert link.interfaces == ("eth9",)
    assert link.ibv_devinfo == IbvDevinfoSettings()
    assert (link.ibv_devinfo.enabled, link.ibv_devinfo.path, link.ibv_devinfo.timeout_seconds,
            link.ibv_devinfo.interval_seconds) == (True, "ibv_devinfo", 10, 300)
    pfc = settings["pfc"]
    assert isinstance(pfc, PfcSettings)
    assert pfc.config.interval_seconds == 5  # named: the file wins
    assert (pfc.config.sources, pfc.config.timeout_seconds) == (SOURCES, 10)  # the others
    assert pfc.ethtool.path == "ethtool"
    ib = settings["infiniband"]
    assert isinstance(ib, InfinibandSettings)
    assert ib.inventory_expected.rdma_devices is None  # a map of counts left unset


@dataclasses.dataclass(frozen=True)
class Inner(Settings):
    count: int = setting("a count", default=3, minimum=1)
    label: str | None = setting("a label")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule(Settings):
    name: re.Pattern[str] | None = setting("names")
    size: int = setting("a size", required=True, multiple_of=4)


@dataclasses.dataclass(frozen=True)
class Outer(Settings):
    inner: Inner = setting("a nested map", default=Inner())
    rules: tuple[Rule, ...] = setting("rules", default=())
    sizes: tuple[int, ...] = setting("sizes", default=(8, 16), minimum=4)


def test_nested_defaults_need_no_declaration_of_their_own() -> None:
    """No ``default={}`` on the parent: a map left out, or given some of its keys, has its
    other keys' defaults."""
    assert parse_settings(Outer, {}, "x") == Outer()
    assert parse_settings(Outer, None, "x") == Outer()  # an empty YAML section
    assert parse_settings(Outer, {}, "x").inner.count == 3
    assert parse_settings(Outer, {"inner": {"label": "a"}}, "x").inner == Inner(3, "a")
    parsed = parse_settings(Outer, {"rules": [{"name": "^a", "size": 8}], "sizes": [4]}, "x")
    assert parsed.sizes == (4,)
    (rule,) = parsed.rules
    assert isinstance(rule, Rule) and rule.size == 8
    assert isinstance(rule.name, re.Pattern) and rule.name.pattern == "^a"


@pytest.mark.parametrize("section,message", [
    ({"inner": {"count": "many"}}, "key 'x.inner.count': expected an integer, got 'many' (str)"),
    ({"inner": {"count": 0}}, "key 'x.inner.count': expected a value >= 1, got 0"),
    ({"inner": {"colour": 1}}, "key 'x.inner.colour': unknown key (known keys here: count, "
                               "label)"),
    ({"rules": [{"name": "a"}]}, "key 'x.rules[0].size': missing, it is required"),
    ({"rules": [{"size": 6}]}, "key 'x.rules[0].size': expected a multiple of 4, got 6"),
    ({"rules": [{"size": 8, "name": "("}]}, "key 'x.rules[0].name': invalid regular expression"),
    ({"sizes": [2]}, "key 'x.sizes[0]': expected a value >= 4, got 2"),
    ({"sizes": 8}, "key 'x.sizes': expected a list, got 8 (int)"),
])
def test_a_wrong_value_names_its_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings(Outer, section, "x")
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_a_wrong_type_in_a_nested_map_is_one_line_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "gpunet.yml"
    path.write_text("link:\n  ibv_devinfo:\n    timeout_seconds: soon\n")
    with pytest.raises(ConfigError) as err:
        load_file(str(path), config_type(CLASSES))
    assert str(err.value) == (f"config file {str(path)!r}: key 'link.ibv_devinfo."
                              "timeout_seconds': expected a number, got 'soon' (str)")


# ---- one declaration --------------------------------------------------------------------------

def _yaml(value: Any) -> str:
    """A default as docs/configuration.md writes it, worked out from the dataclass's value."""
    if isinstance(value, tuple):
        value = list(value)
    return "`" + yaml.safe_dump(value, default_flow_style=True).split("\n")[0] + "`"


def _declared(cls: type[Settings], prefix: str) -> dict[str, str]:
    """Dotted key -> the default docs/configuration.md must show, from the dataclass alone."""
    out: dict[str, str] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}.{f.name}", hints[f.name]
        if isinstance(hint, type) and issubclass(hint, Settings):
            out[key] = "-"
            out.update(_declared(hint, key))
        elif f.default is dataclasses.MISSING:
            out[key] = "required"
        elif typing.get_origin(hint) is tuple:
            out[key] = _yaml(f.default)
            (item, _) = typing.get_args(hint)
            if isinstance(item, type) and issubclass(item, Settings):
                out.update(_declared(item, f"{key}[]"))
        else:
            out[key] = "-" if f.default is None else _yaml(f.default)
    return out


def test_a_default_is_declared_once() -> None:
    """The dataclass default is what a section left empty gets, what --help shows for a flag and
    what docs/configuration.md's table says."""
    rows = {}
    for line in (REPO / "docs" / "configuration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0].strip("`")] = cells[2]
    parser = build_parser(CLASSES)
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    checked = 0
    for name, cls in CLASSES.items():
        defaults = cls.settings_type()
        assert parse_settings(cls.settings_type, {}, name) == defaults
        for key, text in _declared(cls.settings_type, name).items():
            assert rows.pop(key) == text, key
            checked += 1
        for flag, (key, _) in cls.flags.items():
            value = getattr(defaults, key)
            shown = "none" if value is None else value
            assert helps[f"--collector.{name}.{flag}"].endswith(f"(default: {shown})")
    assert set(rows) == {"collectors.<name>"}  # nothing documented that is not declared
    assert checked > 60


def test_each_collector_declares_the_type_of_its_settings() -> None:
    for cls in CLASSES.values():
        assert cls.settings_type is not Settings
        assert typing.get_type_hints(cls)["settings"] is cls.settings_type, cls.name


# ---- parsed once ------------------------------------------------------------------------------

def test_flags_file_and_defaults_reach_the_settings_typed(tmp_path: Path) -> None:
    settings = resolved(
        tmp_path, "infiniband:\n  device_include: '^mlx5_1$'\n  expected_rate:\n"
                  "    - {hca_type: MT4129, gbps: 400}\n",
        "--collector.infiniband.device-exclude=_9$")
    ib = settings["infiniband"]
    assert isinstance(ib, InfinibandSettings)
    assert ib.device_include is not None and ib.device_include.pattern == "^mlx5_1$"
    assert ib.device_exclude is not None and ib.device_exclude.pattern == "_9$"
    assert ib.expected_rate == (RateRule(hca_type=re.compile("MT4129"), gbps=400),)
    assert ib.expected_rate[0].matches("mlx5_0", "MT4129", "InfiniBand")
    assert not ib.expected_rate[0].matches("mlx5_0", "MT4123", "InfiniBand")
    assert ib.generic_hw_counters_max == 512
    probe = settings["probe"]
    assert isinstance(probe, ProbeSettings)
    assert probe == ProbeSettings() and probe.scopes == ("intra", "net")


def test_a_collector_gets_the_settings_resolved_once(tmp_path: Path) -> None:
    path = tmp_path / "gpunet.yml"
    path.write_text("link: {ibv_devinfo: {enabled: false}}\n")
    parser = build_parser(CLASSES)
    args = parser.parse_args([f"--path.sysfs={SYSFS}", f"--config.file={path}",
                              "--collector.disable-defaults", "--collector.link"])
    collectors, settings, enabled = start_collectors(args, CLASSES, parser)
    try:
        assert enabled == ["link"]
        link = collectors["link"]
        assert isinstance(link, LinkCollector)
        assert link.settings is link.ctx.settings is settings["link"]
        assert link.settings.ibv_devinfo == IbvDevinfoSettings(enabled=False)
    finally:
        for c in collectors.values():
            c.close()


def test_one_way_to_build_a_collector() -> None:
    """build_collector takes the section as the file gives it, or the settings themselves; a
    context whose settings are not the collector's type is refused."""
    link = build_collector(LinkCollector, {"interface_exclude": "^lo$"}, sysfs=SYSFS)
    assert isinstance(link.settings, LinkSettings)
    assert link.settings.interface_exclude is not None
    again = build_collector(LinkCollector, link.settings, sysfs=SYSFS)
    assert again.settings is link.settings and again.ctx.sysfs.root == SYSFS
    with pytest.raises(ConfigError, match=re.escape("key 'link.mtu': unknown key")):
        build_collector(LinkCollector, {"mtu": 9000})
    with pytest.raises(TypeError, match="not its settings_type LinkSettings"):
        LinkCollector(dataclasses.replace(link.ctx, settings=ProbeSettings()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        link.ctx.settings = LinkSettings()  # type: ignore[misc]


# ---- third-party collectors -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ThirdSettings(Settings):
    path: str = setting("file to read", default="/run/third.state")
    limits: Inner = setting("limits", default=Inner())


class Third(Collector):
    name = "third"
    settings_type = ThirdSettings
    settings: ThirdSettings
    flags: ClassVar[Mapping[str, tuple[str, str]]] = {"path": ("path", "file to read")}

    def collect(self, scrape: Scrape) -> list[Metric]:
        return [GaugeMetricFamily("gpunet_third_count", self.settings.path,
                                  value=self.settings.limits.count)]


def test_third_party_collectors(tmp_path: Path) -> None:
    classes: dict[str, type[Collector]] = {"third": Third}
    path = tmp_path / "gpunet.yml"
    path.write_text("third: {limits: {count: 9}}\ncollectors: {third: true}\n")
    parser = build_parser(classes)
    assert "(default: /run/third.state)" in parser.format_help()
    args = parser.parse_args([f"--path.sysfs={SYSFS}", f"--config.file={path}",
                              "--collector.third.path=/tmp/x"])
    collectors, _, _ = start_collectors(args, classes, parser)
    third = collectors["third"]
    assert isinstance(third, Third)
    assert third.settings == ThirdSettings("/tmp/x", Inner(9))
    assert [s.value for m in third.collect(Scrape()) for s in m.samples] == [9]
    assert "| `third.limits.count` | int >= 1 | `3` | a count |" in configdoc.render(classes)


def test_the_config_files_top_level_is_declared_from_the_collectors(tmp_path: Path) -> None:
    classes: dict[str, type[Collector]] = {"third": Third, "link": LinkCollector}
    path = tmp_path / "gpunet.yml"
    path.write_text("collectors: {link: false}\nthird: {path: /x}\n")
    config = load_file(str(path), config_type(classes))
    items = settings_items(config)
    assert list(items) == ["collectors", "third", "link"]
    assert settings_items(items["collectors"]) == {"third": None, "link": False}
    assert items["third"] == ThirdSettings("/x") and items["link"] == LinkSettings()
    path.write_text("collectors: {gpu: true}\n")
    with pytest.raises(ConfigError, match=re.escape(
            "key 'collectors.gpu': unknown key (known keys here: link, third)")):
        load_file(str(path), config_type(classes))


def test_a_wrong_flag_value_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    classes: dict[str, type[Collector]] = {"third": Third}
    parser = build_parser(classes)
    args = parser.parse_args([f"--path.sysfs={SYSFS}"])
    args.flag__third__path = "a\0b"
    with pytest.raises(SystemExit) as exit_:
        resolve(args, classes, None, parser)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --collector.third.path: key 'third.path': expected text" in err


# ---- declarations the schema refuses ----------------------------------------------------------

def test_declarations_that_cannot_be_a_schema() -> None:
    def bad(body: dict[str, Any], frozen: bool = True) -> str:
        cls = type("Bad", (Settings,), {"__module__": __name__, **body})
        cls = dataclasses.dataclass(frozen=frozen)(cls)
        with pytest.raises(TypeError) as err:
            settings_fields(cls)
        return str(err.value)

    assert "default None needs the type `X | None`" in bad(
        {"__annotations__": {"n": "int"}, "n": setting("n")})
    assert "a list defaults to a tuple" in bad(
        {"__annotations__": {"n": "tuple[int, ...] | None"}, "n": setting("n")})
    assert "a nested map defaults to its class" in bad(
        {"__annotations__": {"n": "Inner"}, "n": setting("n", default=Inner(count=5))})
    assert "unsupported type" in bad({"__annotations__": {"n": "list[int]"}, "n": setting("n")})
    assert "a regular expression defaults to None" in bad(
        {"__annotations__": {"n": "re.Pattern[str]"}, "n": setting("n", default="x")})
    with pytest.raises(ConfigError, match=re.escape("key 'B.n': expected a value >= 1, got 0")):
        settings_fields(dataclasses.dataclass(frozen=True)(type("B", (Settings,), {
            "__module__": __name__, "__annotations__": {"n": "int"},
            "n": setting("n", default=0, minimum=1)})))

    class Plain(Settings):  # not a dataclass of its own
        pass

    with pytest.raises(TypeError, match="must be a frozen dataclass"):
        settings_fields(Plain)
    assert "a map of any keys is declared Mapping[str, X]" in bad(
        {"__annotations__": {"n": "Mapping[int, str]"}, "n": setting("n", default={})})
    with pytest.raises(TypeError, match=re.escape("a Mapping setting defaults to {}")):
        setting("n", default={"a": "b"})


@dataclasses.dataclass(frozen=True)
class Open(Settings):
    users: Mapping[str, str] = setting("any names", default={})
    inner: Inner | None = setting("named or not")
    need: Rule | None = setting("with a required key")


def test_maps_of_any_keys_optional_maps_and_keys_that_are_no_python_names() -> None:
    assert parse_settings(Open, {}, "o") == Open()
    got = parse_settings(Open, {"users": {"al-ice": "x"}, "inner": {}}, "o")
    assert dict(got.users) == {"al-ice": "x"} and got.inner == Inner()
    with pytest.raises(TypeError):
        got.users["bob"] = "y"  # type: ignore[index]  # read-only
    with pytest.raises(ConfigError, match=re.escape("key 'o.users.bob': expected a string")):
        parse_settings(Open, {"users": {"bob": 1}}, "o")
    with pytest.raises(ConfigError, match=re.escape("key 'o.users.1': a key must be a string")):
        parse_settings(Open, {"users": {1: "x"}}, "o")
    with pytest.raises(ConfigError, match=re.escape("key 'o.need.size': missing, it is required")):
        parse_settings(Open, {"need": {}}, "o")
    headers = make_settings("Headers", {"X-Frame-Options": (str | None, setting("frames")),
                                        "plain": (int, setting("a number", default=2))})
    assert list(settings_fields(headers)) == ["X-Frame-Options", "plain"]
    parsed = parse_settings(headers, {"X-Frame-Options": "deny"}, "h")
    assert settings_items(parsed) == {"X-Frame-Options": "deny", "plain": 2}
    assert settings_items(with_setting(parsed, "plain", 5, "h.plain"))["plain"] == 5
    with pytest.raises(ConfigError, match=re.escape("key 'h.x': unknown key (known keys here: "
                                                    "X-Frame-Options, plain)")):
        parse_settings(headers, {"x": 1}, "h")
