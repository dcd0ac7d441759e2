"""gpunet-probe explain-log [--json] FILE...: what NCCL INFO logs say, for operators.

For each process found in the logs: host, pid, rank, GPU, NCCL version, network, transports,
GPUDirect RDMA, HCAs, NCCL_* settings and the problems found. FILE may be "-" for standard input.
What it reports, the problem codes and the exit status: docs/nccl-log.md.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from gpunet_exporter.flags import Parser
from gpunet_exporter.nccl.log import (
    MAX_WARNINGS,
    PASTED,
    PROBLEMS,
    LogParser,
    RankReport,
    network_unused,
    read_lines,
    root_causes,
    summarize,
)

PROG = "gpunet-probe explain-log"
NOT_NCCL = "not an NCCL log (no 'NCCL INFO' or 'NCCL WARN' lines)"
EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT = 0, 1, 2


def _read(path: str) -> tuple[list[RankReport], bool]:
    """The reports of one file and whether it had NCCL lines; raises OSError."""
    parser = LogParser()

    def feed(lines: Iterable[str]) -> None:
        for line in lines:
            parser.feed(line)

    if path == "-":
        feed(read_lines(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")))
    else:
        with open(path, encoding="utf-8", errors="replace") as fh:
            feed(read_lines(fh))
    return (parser.finish(), True) if parser.nccl_lines else ([], False)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def _by_severity(codes: Iterable[str]) -> list[str]:
    order = list(PROBLEMS)
    return sorted(codes, key=lambda c: (order.index(c) if c in order else len(order), c))


def problem_line(code: str, report: RankReport) -> str:
    """One line for a problem code; for nccl_warn with the first warning's text."""
    text = PROBLEMS.get(code, "")
    if code == "nccl_warn" and report.warnings:
        n = len(report.warnings)
        count = f"{n} or more WARN lines" if n >= MAX_WARNINGS else _plural(n, "WARN line")
        text = f"NCCL printed {count}; first: {report.warnings[0]}"
    return f"{code}: {text}"


def describe(report: RankReport) -> list[str]:
    """The human-readable block of one process."""
    r = report
    if (r.host, r.pid) == PASTED:
        head = "lines without the host:pid prefix"
    else:
        head = f"{r.host or '(no hostname)'} pid {r.pid}"
    if r.rank is not None:
        head += f" rank {r.rank}/{r.nranks if r.nranks is not None else '?'}"
    if r.cuda_dev is not None:
        head += f" (GPU {r.cuda_dev})"
    head += f", NCCL {r.nccl_version or 'version unknown'}"
    kinds = [k for k in sorted(r.transports) if k != "NET"]
    kinds += [f"NET/{n}" for n in sorted(r.net_transports)]
    gdr = "n/a" if r.gdr is None else ("on" if r.gdr else "off")
    env = ", ".join(f"{k}={v}" for k, v in sorted(r.env.items()))
    net = "unused (single-node job)" if network_unused(r) else r.net or "unknown"
    lines = [head,
             f"  network: {net}",
             f"  transports: {', '.join(kinds) or 'none seen'}",
             f"  GDR: {gdr}",
             f"  HCAs: {', '.join(r.hcas) or 'none'}",
             f"  environment: {env or 'none'}"]
    if r.problems:
        # Root causes, most serious first by their own or their consequences' rank, each with
        # the consequences it explains beneath it.
        tree = root_causes(r.problems)
        order = list(PROBLEMS)
        rank = {c: min(order.index(x) if x in order else len(order) for x in [c, *tree[c]])
                for c in tree}
        lines.append("  problems:")
        for cause in sorted(tree, key=lambda c: (rank[c], c)):
            lines.append(f"    {problem_line(cause, r)}")
            lines += [f"      -> {problem_line(code, r)}" for code in _by_severity(tree[cause])]
    else:
        lines.append("  looks fine")
    return lines


def main(argv: list[str]) -> int:
    parser = Parser(
        prog=PROG,
        description="What NCCL_DEBUG=INFO logs say about the network, transports and GPUDirect "
                    "RDMA NCCL used, and the problems they show (docs/nccl-log.md).",
        epilog="Exit codes: 0 no problems, 1 problems found, 2 unreadable file, no NCCL log, "
               "or bad arguments.")
    parser.add_argument("--json", action="store_true",
                        help="machine-readable output (default: a report)")
    parser.add_argument("files", nargs="+", metavar="FILE", help='NCCL log file, "-" for stdin')
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the error line, or the help
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    return run(args.files, args.json, sys.stdout, sys.stderr)


def run(paths: list[str], as_json: bool, out: TextIO, err: TextIO) -> int:
    files: list[dict[str, Any]] = []
    reports: list[RankReport] = []
    unreadable = nccl_files = 0
    sections: list[list[str]] = []
    for path in paths:
        entry: dict[str, Any] = {"path": path, "nccl_log": False, "error": None, "ranks": []}
        files.append(entry)
        try:
            found, is_log = _read(path)
        except OSError as exc:
            unreadable += 1
            entry["error"] = exc.strerror or str(exc)
            print(f"{path}: cannot read: {entry['error']}", file=err)
            continue
        if not is_log:
            sections.append([f"{path}: {NOT_NCCL}"])
            continue
        nccl_files += 1
        entry["nccl_log"] = True
        entry["ranks"] = [r.to_dict() for r in found]
        reports += found
        sections.append([f"== {path}: {_plural(len(found), 'process')}"])
        sections += [describe(r) for r in found]
    summary = summarize(reports)
    if unreadable or not nccl_files:
        status = EXIT_BAD_INPUT
    else:
        status = EXIT_PROBLEMS if summary["problems"] else EXIT_OK
    if as_json:
        json.dump({"files": files, "summary": summary, "exit_status": status}, out, indent=1)
        out.write("\n")
        return status
    overall = f"overall: {_plural(len(reports), 'process')} in {_plural(nccl_files, 'NCCL log')}"
    others = len(paths) - nccl_files - unreadable
    if others:
        overall += f", {others} not an NCCL log"
    if unreadable:
        overall += f", {unreadable} unreadable"
    if not nccl_files:
        overall += ": nothing to explain"
    elif summary["problems"]:
        overall += f": problems: {', '.join(_by_severity(summary['problems']))}"
    else:
        overall += ": looks fine"
    sections.append([overall])
    print("\n\n".join("\n".join(lines) for lines in sections), file=out)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
