"""Just enough of PromQL to find the vector selectors of an expression and add label matchers to
them: how the thresholds file's ``selector`` reaches every rule and dashboard query, and the
dashboards' ``cluster`` variable every query (tests/test_grafana.py reads metric names with it).

A tokenizer, not a parser: it tells metric names from function and aggregation names, keywords,
label names in ``{}`` and in ``by``/``without``/``on``/``ignoring``/``group_x`` lists, strings,
numbers, durations and ranges, and Grafana variables (``$x``, ``${x}``, ``[[x]]``), which is
all that adding a matcher needs. promtool checks what comes out (tests/test_alerts.py,
tests/test_grafana.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<var>\$\{[^}]*\}|\$\w+|\[\[\w+(?::\w+)?\]\])
  | (?P<number>(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)[a-zA-Z0-9_]*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]@:])
""", re.X)
AGGREGATIONS = frozenset({"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
                          "count_values", "bottomk", "topk", "quantile", "limitk",
                          "limit_ratio"})
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left",
                                 "group_right"})
KEYWORDS = LABEL_LIST_KEYWORDS | {"bool", "offset", "and", "or", "unless", "atan2"}
NUMBER_WORDS = frozenset({"inf", "nan"})
CLOSING = {"(": ")", "{": "}", "[": "]"}
# One or more label matchers, as between a selector's braces: name op "value", comma-separated.
MATCHERS = re.compile(r'\s*[a-zA-Z_]\w*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*'
                      r'(?:,\s*[a-zA-Z_]\w*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*)*')


class Token(NamedTuple):
    kind: str  # string, var, number, ident or op
    text: str
    start: int
    end: int


class Selector(NamedTuple):
    """A vector selector: its metric name ('' for ``{__name__=...}``), the text between its
    braces ('' without braces), and where a matcher goes in: the offset of its closing brace,
    or of the end of its name when it has no braces."""

    name: str
    matchers: str
    insert_at: int
    braces: bool


def tokens(expr: str) -> list[Token]:
    """Every token of ``expr``, whitespace left out; ValueError on a character PromQL has not."""
    out = []
    pos = 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot tokenize {expr[pos:pos + 20]!r} in {expr!r}")
        kind = m.lastgroup or ""
        if kind != "ws":
            out.append(Token(kind, m.group(), m.start(), m.end()))
        pos = m.end()
    return out


def _matching(toks: list[Token], i: int) -> int:
    """Index of the bracket closing the one at toks[i]."""
    opening, depth = toks[i].text, 0
    for j in range(i, len(toks)):
        if toks[j].kind != "op":
            continue
        if toks[j].text == opening:
            depth += 1
        elif toks[j].text == CLOSING[opening]:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unbalanced {opening!r}")


def selectors(expr: str) -> list[Selector]:
    """Every vector selector of ``expr``, in order."""
    toks = tokens(expr)
    out: list[Selector] = []
    i = 0
    while i < len(toks):
        kind, text = toks[i].kind, toks[i].text
        following = toks[i + 1].text if i + 1 < len(toks) else ""
        if kind == "op" and text == "[":
            i = _matching(toks, i) + 1  # range or subquery: durations and variables only
            continue
        if kind == "op" and text == "{":  # a selector without a metric name
            close = _matching(toks, i)
            out.append(Selector("", expr[toks[i].end:toks[close].start], toks[close].start,
                                True))
            i = close + 1
            continue
        if kind != "ident":
            i += 1
            continue
        if text in LABEL_LIST_KEYWORDS and following == "(":
            i = _matching(toks, i + 1) + 1
            continue
        if text in KEYWORDS or text in AGGREGATIONS or text.lower() in NUMBER_WORDS:
            i += 1
            continue
        if following == "(":  # a function call
            i += 1
            continue
        if following == "{":
            close = _matching(toks, i + 1)
            out.append(Selector(text, expr[toks[i + 1].end:toks[close].start],
                                toks[close].start, True))
            i = close + 1
            continue
        out.append(Selector(text, "", toks[i].end, False))
        i += 1
    return out


def exporter_series(s: Selector) -> bool:
    """Whether a selector reads the exporters' own series (``gpunet_*``, ``up``), which the
    thresholds' ``selector`` narrows, rather than a recorded series or ALERTS, which carry
    the labels their rules kept."""
    return s.name == "up" or s.name.startswith("gpunet_")


def add_matchers(expr: str, matchers: str,
                 where: Callable[[Selector], bool] = lambda s: True) -> str:
    """``expr`` with ``matchers`` (``a="x", b=~"y"``) added to each of its selectors for which
    ``where`` is true, after the matchers it has."""
    if not MATCHERS.fullmatch(matchers):
        raise ValueError(f"not label matchers: {matchers!r}")
    matchers = matchers.strip()
    out, last = [], 0
    for s in selectors(expr):
        if not where(s):
            continue
        out.append(expr[last:s.insert_at])
        if not s.braces:
            out.append("{" + matchers + "}")
        elif s.matchers.strip().rstrip(",").strip():
            out.append((", " if not s.matchers.rstrip().endswith(",") else " ") + matchers)
        else:
            out.append(matchers)
        last = s.insert_at
    out.append(expr[last:])
    return "".join(out)
