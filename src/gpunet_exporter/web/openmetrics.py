"""OpenMetrics 1.0.0 text for the common case, byte for byte what prometheus_client writes.

prometheus_client's ``openmetrics.exposition.generate_latest(escaping=ALLOWUTF8)`` formats each
sample's labels anew (sorting them, escaping every name and value through a few function calls),
which is about 3 us a sample and a quarter of a scrape's time. Here a label dict shared by many
samples (Families.add_labeled: a port's hundred counters share one) is formatted once per
scrape, and checks that cannot fail for this exporter's names are made once per name.

:func:`encode` handles only what it can write exactly as prometheus_client does: legacy metric
and label names, no exemplars, timestamps or native histograms. Anything else (a third-party
collector's sample with a timestamp, a dotted name, a value that is not a number) makes it
return None, and the caller uses prometheus_client's encoder for the whole answer, so what is
served never depends on which of the two wrote it (tests/test_http.py compares them).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

# prometheus_client's legacy metric name (validation.METRIC_NAME_RE) and legacy label name
# (METRIC_LABEL_NAME_RE, and not RESERVED_METRIC_LABEL_NAME_RE's "__" prefix): such names are
# written as they are in the allow-utf-8 escaping, neither quoted nor escaped.
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_NAMES_MAX = 10_000  # names remembered as valid: the exporter has a few hundred
_good_metric_names: set[str] = set()
_good_label_names: set[str] = set()
_number: Callable[[float], str] = floatToGoString  # the one formatting of values, theirs


def _metric_name_ok(name: object) -> bool:
    if name in _good_metric_names:
        return True
    if not (isinstance(name, str) and _METRIC_NAME.fullmatch(name)):
        return False
    if len(_good_metric_names) < _NAMES_MAX:
        _good_metric_names.add(name)
    return True


def _label_name_ok(name: object) -> bool:
    if name in _good_label_names:
        return True
    if not (isinstance(name, str) and _LABEL_NAME.fullmatch(name) and not name.startswith("__")):
        return False
    if len(_good_label_names) < _NAMES_MAX:
        _good_label_names.add(name)
    return True


def _escape(text: str) -> str:
    """prometheus_client's ``_escape`` in the allow-utf-8 escaping (label values, HELP)."""
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Fallback(Exception):
    """A sample this encoder does not write exactly as prometheus_client does."""


def encode(families: Iterable[Metric]) -> bytes | None:
    """The OpenMetrics text of ``families``, exactly as prometheus_client's
    ``openmetrics.exposition.generate_latest(..., escaping=ALLOWUTF8)`` writes it (any version
    from 1.0.0 up: they differ only in native histograms, which this encoder leaves to it), or
    None when some family needs prometheus_client's encoder."""
    try:
        return _encode(families)
    except (_Fallback, AttributeError, TypeError, ValueError, OverflowError):
        # prometheus_client either writes such a value (some other way) or raises on it,
        # with its own message: let it.
        return None


def _encode(families: Iterable[Metric]) -> bytes:
    out: list[str] = []
    add = out.append
    labelstrs: dict[int, str] = {}  # id(label dict) -> "{...}", for this answer
    values: dict[int, str] = {}  # int value -> its text, for this answer
    keep: list[object] = []  # the label dicts keyed by id: alive until the end
    for metric in families:
        name = metric.name
        if not _metric_name_ok(name):
            raise _Fallback
        add(f"# HELP {name} {_escape(metric.documentation)}\n# TYPE {name} {metric.type}\n")
        if metric.unit:
            add(f"# UNIT {name} {metric.unit}\n")
        for s in metric.samples:
            if (s.timestamp is not None or s.exemplar is not None
                    or s.native_histogram is not None or not _metric_name_ok(s.name)):
                raise _Fallback
            labels = s.labels
            text = labelstrs.get(id(labels))
            if text is None:
                if labels:
                    for key in labels:
                        if not _label_name_ok(key):
                            raise _Fallback
                    text = "{" + ",".join([f'{k}="{_escape(v)}"'
                                           for k, v in sorted(labels.items())]) + "}"
                else:
                    text = ""
                labelstrs[id(labels)] = text
                keep.append(labels)
            value = s.value
            if value is None:
                number = ""
            elif type(value) is int:  # many counters share a value (0): formatted once
                number = values.get(value) or values.setdefault(value, _number(value))
            else:
                number = _number(value)
            add(f"{s.name}{text} {number}\n")
    add("# EOF\n")
    return "".join(out).encode("utf-8")
