"""FSDP2 benchmark: the GPT-style language model sharded over N ranks, per method, on the
same links.

Each method trains ``examples/torch_fsdp_train.py`` (76 tensors, ``fully_shard`` per
transformer block, AdamW) for the same steps: FSDP2's own collectives in float32 (the
reference of every ratio), FSDP2 reducing gradients in bfloat16, HiPress's compressed
gradient reduce-scatter (``hp.compress_fsdp``, cgx 4 bits with error feedback), and the
same with an int8 parameter all-gather (ZeRO++'s qwZ). Reports the steady samples/s
(after the warm-up steps) as a ratio to FSDP2's, the wall-clock time to a target loss
(the loss FSDP2 reaches three quarters into its run, smoothed over 10 steps), the last
smoothed loss, HiPress's bytes sent per step and rank, and whether every rank ended with
the same model.

    hipress bench fsdp                       # 4 namespaces, tc-shaped 1 Gbit/s (root)
    hipress bench fsdp --ranks 2 --steps 120
    hipress bench fsdp --nodes 2 --ranks-per-node 2 --hsdp   # HSDP across 2 nodes

With ``--hsdp`` the methods are HSDP's: FSDP2's own (the 2-D mesh, its all-reduce across
nodes in float32), and HiPress's compressed replica all-reduce (cgx 4 bits), each node's
reduce-scatter FSDP2's own; with ``--nodes`` only the links between nodes are shaped.

FSDP2's collectives talk to torch.distributed directly and cannot be software-paced, so
the benchmark needs the shaped links (root).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._report import write_json  # noqa: E402
from hipress.cliargs import Parser, add_nodes, count, nodes_of, rate  # noqa: E402
from hipress.launcher import run_shaped  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
BASE = "FSDP2"
METHODS = {
    BASE: ["--sync", "fsdp"],
    "FSDP2 bf16 reduce": ["--sync", "fsdp-bf16"],
    "HiPress cgx": ["--sync", "hipress", "--algorithm", "cgx", "--bits", "4"],
    "HiPress cgx + int8 all-gather": ["--sync", "hipress", "--algorithm", "cgx", "--bits", "4",
                                      "--all-gather", "int8"],
}
HSDP_BASE = "HSDP"
HSDP_METHODS = {
    HSDP_BASE: ["--sync", "fsdp"],
    "HiPress HSDP cgx": ["--sync", "hipress", "--algorithm", "cgx", "--bits", "4"],
    "HiPress HSDP cgx + int8 all-gather": ["--sync", "hipress", "--algorithm", "cgx",
                                           "--bits", "4", "--all-gather", "int8"],
}


#: training losses are smoothed over this many steps before they are compared with a target
SMOOTH = 10


def smoothed(losses: list[list[float]]) -> list[tuple[float, float]]:
    """(seconds, loss) with each loss the mean of the last ``SMOOTH`` steps'."""
    out = []
    for i in range(len(losses)):
        window = losses[max(0, i - SMOOTH + 1):i + 1]
        out.append((losses[i][0], sum(v for _, v in window) / len(window)))
    return out


def time_to(target: float, losses: list[list[float]]) -> float | None:
    """Seconds until the smoothed loss first reaches ``target``; None if it never does."""
    for t, loss in smoothed(losses)[SMOOTH - 1:]:
        if loss <= target:
            return t
    return None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench fsdp", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_nodes(parser)
    parser.add_argument("--hsdp", action="store_true",
                        help="HSDP: a replica per node (needs --nodes; see above)")
    parser.add_argument("--bandwidth", type=rate, default="1gbit")
    parser.add_argument("--steps", type=count(12), default=80)
    parser.add_argument("--dim", type=count(6), default=384, help="13.8M parameters")
    parser.add_argument("--batch", type=count(1), default=2, help="sequences per rank")
    parser.add_argument("--methods", nargs="+",
                        choices=[*METHODS, *HSDP_METHODS], help="default: all of the mode's")
    parser.add_argument("--out", type=Path, default=RESULTS / "fsdp.json")
    args = parser.parse_args(argv)
    ranks, per_node = nodes_of(args)
    table, base = (HSDP_METHODS, HSDP_BASE) if args.hsdp else (METHODS, BASE)
    if args.hsdp and args.nodes is None:
        parser.error("--hsdp needs --nodes and --ranks-per-node")
    methods = [base, *(m for m in dict.fromkeys(args.methods or table) if m != base)]
    unknown = [m for m in methods if m not in table]
    if unknown:
        parser.error(f"{', '.join(unknown)} not in this mode's methods: {', '.join(table)}")
    rows = []
    for method in methods:
        metrics = args.out.parent / f"fsdp-{method.replace(' ', '_')}.json"
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.unlink(missing_ok=True)
        # the ranks share this machine's cores: each script takes its share itself, as a
        # job whose ranks share cores does (nothing is exported for it)
        cmd = [str(HERE.parent / "examples" / "torch_fsdp_train.py"), *table[method],
               "--steps", str(args.steps), "--dim", str(args.dim), "--batch",
               str(args.batch), "--metrics", str(metrics),
               "--threads", str(max(1, (os.cpu_count() or 1) // ranks))]
        if args.hsdp:
            cmd += ["--hsdp", str(args.nodes)]
        print(f"== {method}", flush=True)
        code = run_shaped(ranks, args.bandwidth, cmd, per_node)
        if code or not metrics.exists():
            print(f"{method} failed with exit code {code}", file=sys.stderr)
            return 1
        result = json.loads(metrics.read_text())
        result["method"] = method
        clock, elapsed = [], 0.0
        for seconds, loss in zip(result["step_s"], result["losses"], strict=True):
            elapsed += seconds
            clock.append([elapsed, loss])
        result["clock"] = clock
        rows.append(result)
    report(rows, args)
    return 0


def report(rows: list[dict], args: argparse.Namespace) -> None:
    from rich.table import Table

    base = rows[0]
    curve = smoothed(base["clock"])
    target = curve[max(9, 3 * len(curve) // 4 - 1)][1]
    base_time = time_to(target, base["clock"])
    name = base["method"]
    where = f"{args.nodes} nodes x {args.ranks_per_node} ranks" if args.nodes else \
        f"{args.ranks} ranks"
    table = Table(title=f"{'HSDP' if args.hsdp else 'FSDP2'}, GPT-style LM: {where}, "
                        f"{args.bandwidth} shaped links, {args.steps} steps; target loss "
                        f"{target:.3f}")
    for col in ("method", "samples/s", f"vs {name}", "to target s", f"vs {name} ",
                "last loss", "MB sent/step", "identical"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        reach = time_to(target, r["clock"])
        r["target_loss"], r["time_to_target_s"] = target, reach
        sent = r.get("sent_per_step")
        table.add_row(r["method"], f"{r['samples_per_s']:.1f}",
                      f"{r['samples_per_s'] / base['samples_per_s']:.2f}x",
                      f"{reach:.1f}" if reach is not None else "never",
                      f"{base_time / reach:.2f}x" if reach and base_time else "-",
                      f"{smoothed(r['clock'])[-1][1]:.3f}",
                      f"{sent / 1e6:.2f}" if sent else "-",
                      "yes" if r["identical"] else "NO")
    make_console(120).print(table)
    write_json(args, methods=rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
