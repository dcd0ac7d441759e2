"""gpunet-probe: micro all-reduce probes, and NCCL log explanations for operators.

    gpunet-probe run --state-dir DIR [--backend nccl|gloo] [--sizes 8KiB,1MiB,64MiB] ...
    gpunet-probe explain-log [--json] FILE...

``run`` is what the exporter's probe collector starts (intra-node), and what torchrun or srun
start on every node for cluster mode. ``python -m gpunet_exporter.probe.cli`` is the same program.
Exit codes of run: 0 after --rounds, 2 bad arguments, 3 no GPU, 4 a round failed (the exporter
starts it again).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gpunet_exporter.flags import Parser
from gpunet_exporter.probe import runner

PROG = "gpunet-probe"


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["explain-log"]:
        from gpunet_exporter.nccl import explain

        return explain.main(args_list[1:])
    if args_list[:1] == ["worker"]:  # one rank, started by `run`: not a command for people
        work = Parser(prog=f"{PROG} worker")
        runner.add_run_arguments(work)
        return runner.worker(work.parse_args(args_list[1:]))
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,explain-log}")
    run = sub.add_parser("run", help="probe rounds, results to --state-dir")
    runner.add_run_arguments(run)
    sub.add_parser("explain-log", help="what NCCL INFO logs say about network, transports, GDR")
    args = p.parse_args(args_list)
    return runner.launch(args, args_list[1:])


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
