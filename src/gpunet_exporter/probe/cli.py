"""gpunet-probe: micro all-reduce probes, and NCCL log explanations for operators.

    gpunet-probe run --state-dir DIR [--backend nccl|gloo] [--sizes 8KiB,1MiB,64MiB] ...
    gpunet-probe explain-log [--json] FILE...
    gpunet-probe fleet --state-dir DIR [--kind ring|random|leaf|repair|adaptive] ... (per node)
    gpunet-probe plan --nodes a,b,c --kind ring|random|repair|leaf [--hops K] [--seed N]
        [--suspects a,b] [--good c,d] [--leaves a=l1,b=l2,...]

``run`` is what the exporter's probe collector starts (intra-node), and what torchrun or srun
start on every node for cluster mode. ``python -m gpunet_exporter.probe.cli`` is the same program.
``plan`` prints a pairing plan for fleet probes as JSON (probe/plan.py); ``fleet``
runs one across nodes (probe/fleet.py). Exit codes of
run: 0 after --rounds, 2 bad arguments, 3 no GPU, 4 a round failed (the exporter
starts it again), 5 torch not installed (one line: pip install 'gpunet-exporter[probe]').
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from gpunet_exporter.flags import Parser
from gpunet_exporter.probe import plan, run_options, runner

PROG = "gpunet-probe"


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["explain-log"]:
        from gpunet_exporter.nccl import explain

        return explain.main(args_list[1:])
    if args_list[:1] == ["fleet"]:
        from gpunet_exporter.probe import fleet

        return fleet.main(args_list[1:])
    if args_list[:1] == ["pair-worker"]:  # a fleet pair end's, kept for a pass: not for people
        from gpunet_exporter.probe import pairworker

        return pairworker.main(args_list[1:])
    if args_list[:1] == ["worker"]:  # one rank, started by `run`: not a command for people
        work = Parser(prog=f"{PROG} worker")
        run_options.add_arguments(work)
        return runner.worker(run_options.from_args(work.parse_args(args_list[1:])))
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,explain-log,plan,fleet}")
    run = sub.add_parser("run", help="probe rounds, results to --state-dir")
    run_options.add_arguments(run)
    sub.add_parser("explain-log", help="what NCCL INFO logs say about network, transports, GDR")
    pl = sub.add_parser("plan", help="a pairing plan for fleet probes, as JSON")
    add_plan_arguments(pl)
    sub.add_parser("fleet", help="run a pairing plan across nodes (one per node, under srun "
                                 "or torchrun); pairs.json on each")
    args = p.parse_args(args_list)
    if args.cmd == "plan":
        return print_plan(pl, args)
    return runner.launch(run_options.from_args(args))


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _leaves(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in _names(text):
        node, sep, leaf = item.partition("=")
        if not sep or not node.strip() or not leaf.strip():
            raise plan.PlanError(f"--leaves wants node=leaf items, got {item!r}")
        out[node.strip()] = leaf.strip()
    return out


def add_plan_arguments(p: Parser) -> None:
    p.add_argument("--nodes", required=True, help="node names, comma-separated, in order")
    p.add_argument("--kind", required=True, choices=plan.KINDS, help="the pairing method")
    p.add_argument("--seed", type=int, default=0, help="random: the shuffle's seed")
    p.add_argument("--hops", type=int, default=1,
                   help="ring: pair each node with the next HOPS nodes (2 x HOPS pairs per "
                        "node; 2 gives the 4 a robust node median wants) (1)")
    p.add_argument("--suspects", default="", help="repair: the suspect nodes")
    p.add_argument("--good", default=None,
                   help="repair: the known-good nodes (default: every node not a suspect)")
    p.add_argument("--leaves", default="",
                   help="node=leaf,...: the rack or leaf switch of each node (leaf; repair "
                        "prefers a good node of the suspect's leaf)")


def print_plan(p: Parser, args: Any) -> int:
    try:
        leaves = _leaves(args.leaves)
        made = plan.make(args.kind, _names(args.nodes), seed=args.seed, hops=args.hops,
                         suspects=_names(args.suspects),
                         good=None if args.good is None else _names(args.good),
                         leaves=leaves or None)
    except plan.PlanError as exc:
        p.error(str(exc))
    print(json.dumps(plan.to_json(args.kind, made)))
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
