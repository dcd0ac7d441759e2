"""Hostile YAML documents: small files that expand without bound (issue 15)."""

from __future__ import annotations


def alias_bomb() -> str:
    """The "billion laughs" in YAML, about 300 bytes: nine lists, each of nine aliases to the one
    before, so 9**9 (387 million) strings once expanded. PyYAML composes it in a millisecond (it
    shares the aliased lists); before the limits, an error message's repr() of it took 40 s and
    4.3 GB."""
    lines = ["- &a [x, x, x, x, x, x, x, x, x]"]
    for before, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"- &{name} [{', '.join([f'*{before}'] * 9)}]")
    return "\n".join(lines) + "\n"


def merge_bomb() -> str:
    """The same through merge keys: PyYAML itself copies 9**8 pairs while constructing it."""
    lines = ["a: &a {" + ", ".join(f"k{i}: 1" for i in range(9)) + "}"]
    for before, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} {{<<: [{', '.join([f'*{before}'] * 9)}]}}")
    return "\n".join(lines) + "\n"
