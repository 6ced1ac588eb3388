"""Cluster simulation: scaling of each strategy on N nodes x G GPUs, from the cost model.

For every model profile (tensor sizes in backward order, backward time on one
V100-class GPU: ``casync.model.models.TIMINGS``), every node count and link rate, one
iteration is simulated (``casync.model.simulate``) for:

* ``allreduce``      uncompressed ring allreduce over 25 MB buckets (Horovod, DDP);
* ``byteps-onebit``  BytePS: 4 MB partitions reduced inside the node, copied to the host,
                     onebit on the CPU, CPU servers; tensors under 64 KB raw;
* ``ring-dgc``       DGC (0.1 %) over the compressed ring, one ring per 4 MB partition,
                     tensors under 262,144 raw (fused, as Horovod fuses them);
* ``naive``          per tensor: onebit encode, all-gather, decode all (GRACE-style);
* ``powersgd``       torch's PowerSGD hook, rank 4, per 25 MB bucket, with its per-matrix
                     kernels and error feedback;
* ``casync-onebit``, ``casync-dgc``  the engine with the cost-model planner, which also
                     chooses between the hierarchical topology (uncompressed inside a
                     node) and a flat one over every GPU.

Backward runs on the GPU that the codec kernels use (``CostModel.shares_compute``): an
iteration takes forward + max(backward as the kernels delayed it, sync end); scaling
efficiency is the single-GPU iteration time over that (weak scaling, same batch per
GPU). The cluster's costs are ``CostModel.cluster``: the figures of
``casync.model.cluster.ASSUMPTIONS``, each with its source, none measured here. The run
prints them, and beside each strategy the ones its prediction rests on.

    hipress bench simulate                          # all models, 1..16 nodes x 8 GPUs
    hipress bench simulate --models resnet50 --nodes 16 --bandwidths 25gbit
    hipress bench simulate --profile profile.json   # this host's measured costs instead
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from casync.model.cluster import ASSUMPTIONS, rests_on  # noqa: E402
from casync.model.costmodel import CostModel  # noqa: E402
from casync.model.models import PROFILES, TIMINGS, layers  # noqa: E402
from casync.model.planner import choose_level  # noqa: E402
from casync.model.simulate import Result, ready_times, simulate  # noqa: E402
from casync.plan import StaticPlanner  # noqa: E402
from casync.transport import parse_rate  # noqa: E402
from hipress.cliargs import Parser, count, rate  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
STRATEGIES = ("allreduce", "byteps-onebit", "ring-dgc", "naive", "powersgd",
              "casync-onebit", "casync-dgc")


def run_strategy(cost: CostModel, nodes: int, grads: list[Any], name: str) -> Result:
    """One iteration's synchronization under strategy ``name`` (``Result.level`` says
    which topology level CaSync's planner chose)."""
    if name in ("allreduce", "naive", "powersgd"):
        return simulate(cost, nodes, grads, name)
    if name == "byteps-onebit":
        return simulate(cost, nodes, grads, "byteps", algorithm="onebit")
    if name == "ring-dgc":  # a ring per compressed partition; raw tensors fused (Horovod)
        return simulate(cost, nodes, grads, "casync", coalesce=False, fuse_raw=True,
                        planner=StaticPlanner("dgc", "ring", min_compress=262144))
    if name.startswith("casync-"):
        return choose_level(cost, nodes, grads, (name.split("-", 1)[1],))[1]
    raise ValueError(f"unknown strategy {name!r}")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench simulate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--nodes", nargs="+", type=count(1), default=[1, 2, 4, 8, 16])
    parser.add_argument("--gpus", type=count(1), default=8, help="GPUs per node")
    parser.add_argument("--bandwidths", nargs="+", type=rate, default=["25gbit", "100gbit"])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        choices=list(STRATEGIES))
    parser.add_argument("--profile", type=Path,
                        help="use this measured profile's compute costs instead of the "
                             "V100 figures (its link costs are replaced by --bandwidths)")
    parser.add_argument("--out", type=Path, default=RESULTS / "simulate.json")
    args = parser.parse_args(argv)

    from rich.progress import track

    rows: list[dict[str, Any]] = []
    jobs = [(m, bw, n) for m in args.models for bw in args.bandwidths for n in args.nodes]
    t0 = time.perf_counter()
    for model, bw, nodes in track(jobs, description="simulating", transient=True):
        cost = CostModel.cluster(nodes, args.gpus, parse_rate(bw), ("onebit", "dgc"))
        if args.profile:
            measured = CostModel.load(args.profile)
            for key, fit in measured.costs.items():
                if key.split("/")[0] in ("encode", "decode", "merge"):
                    cost.costs[key] = fit
        timing = TIMINGS[model]
        grads = ready_times(layers(model), timing.backward_ms / 1e3)
        single = (timing.forward_ms + timing.backward_ms) / 1e3
        for name in args.strategies:
            res = run_strategy(cost, nodes, grads, name)
            backward = max(timing.backward_ms / 1e3, res.backward_end)
            iteration = timing.forward_ms / 1e3 + max(backward, res.end)
            rows.append({"model": model, "bandwidth": bw, "nodes": nodes, "gpus": args.gpus,
                         "strategy": name, "sync_end_s": res.end, "backward_s": backward,
                         "kernels_s": res.kernels, "iteration_s": iteration,
                         "efficiency": single / iteration, "level": res.level,
                         "rests_on": list(rests_on(name))})
    seconds = time.perf_counter() - t0
    result = {"rows": rows, "gpus": args.gpus, "seconds": seconds,
              "assumptions": {k: vars(a) for k, a in ASSUMPTIONS.items()},
              "timings": {m: vars(TIMINGS[m]) for m in args.models},
              "profile": str(args.profile) if args.profile else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    report(result, make_console(130))
    plot(result, args.out.with_suffix(".png"))
    print(f"simulated {len(rows)} iterations in {seconds:.1f} s; wrote {args.out} and "
          f"{args.out.with_suffix('.png')}")
    return 0


def report(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    rows = result["rows"]
    stated = Table(title="what the predictions rest on (casync.model.cluster; none measured "
                         "here)")
    for column in ("key", "value", "prices", "source"):
        stated.add_column(column, overflow="fold")
    for key, a in result.get("assumptions", {}).items():
        stated.add_row(key, f"{a['value']:g} {a['unit']}", a["what"], a["source"])
    console.print(stated)
    top = max(r["nodes"] for r in rows)
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    for bw in dict.fromkeys(r["bandwidth"] for r in rows):
        table = Table(title=f"scaling efficiency, {top} nodes x {result['gpus']} GPUs, {bw} "
                            "(simulated); last columns: casync-onebit speedup over")
        table.add_column("model")
        for s in strategies:
            table.add_column(s, justify="right")
        others = [s for s in strategies if s != "casync-onebit"] \
            if "casync-onebit" in strategies else []
        for s in others:
            table.add_column(f"x {s}", justify="right")
        for model in dict.fromkeys(r["model"] for r in rows):
            sel = {r["strategy"]: r for r in rows
                   if r["model"] == model and r["bandwidth"] == bw and r["nodes"] == top}
            cells = [f"{sel[s]['efficiency']:.2f}" for s in strategies]
            if others:
                mine = sel["casync-onebit"]["iteration_s"]
                cells += [f"{sel[s]['iteration_s'] / mine:.2f}" for s in others]
            table.add_row(model, *cells)
        console.print(table)
    levels = sorted({(r["strategy"], r["level"]) for r in rows if r.get("level")})
    for strategy in strategies:
        chosen = ", ".join(sorted({lv for s, lv in levels if s == strategy}))
        console.print(f"  {strategy} rests on: "
                      f"{', '.join(rests_on(strategy))}"
                      + (f" (levels chosen: {chosen})" if chosen else ""))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    bws = list(dict.fromkeys(r["bandwidth"] for r in rows))
    fig, axes = plt.subplots(len(bws), len(models), figsize=(3 * len(models), 3 * len(bws)),
                             squeeze=False, sharey=True)
    for i, bw in enumerate(bws):
        for j, model in enumerate(models):
            ax = axes[i][j]
            for s in dict.fromkeys(r["strategy"] for r in rows):
                pts = sorted((r["nodes"], r["efficiency"]) for r in rows
                             if r["model"] == model and r["bandwidth"] == bw
                             and r["strategy"] == s)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=s)
            ax.set_title(f"{model}, {bw}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            if j == 0:
                ax.set_ylabel("scaling efficiency")
            if i == len(bws) - 1:
                ax.set_xlabel(f"nodes (x{result['gpus']} GPUs)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
