"""``hipress profile`` and ``hipress plan``: measure the primitives, then plan a model."""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.table import Table

from casync import Synchronizer
from casync.model.costmodel import Cost, CostModel, Linear
from casync.model.models import PROFILES, TIMINGS, layers
from casync.model.planner import choose_level
from casync.model.profiler import measure
from casync.model.simulate import Gradient, ready_times, simulate
from casync.transport import Transport, parse_rate

from .cliargs import Parser, algorithm, count, number
from .cliargs import rate as link_rate
from .distributed import destroy_process_group
from .errors import ConfigError
from .launcher import run, run_shaped
from .output import console as make_console

__all__ = ["profile_main", "plan_main", "fit_table"]


def _cells(key: str, fit: Any) -> tuple[str, str, str]:
    """a, b and b as a rate, in the units of the primitive ``key``."""
    if key.startswith(Cost.BYTES.key("")):
        return f"{fit.a:.0f} B", f"{fit.b:.4f} B/elem", f"{fit.b * 8:.3f} bits/elem"
    if key.startswith(Cost.TENSOR.key("")):
        return f"{fit.a * 1e6:.1f}", "-", "-"
    if key.startswith(Cost.BULK.key("")):
        return "-", f"{fit.b:.3g} s/elem", "-"
    unit, width = ("s/B", 1) if key in (Cost.SEND.key(), Cost.INTRA.key()) else ("s/elem", 4)
    rate = f"{width / fit.b / 1e9:.2f} GB/s" if fit.b > 0 else "-"
    return f"{fit.a * 1e6:.1f}", f"{fit.b:.3g} {unit}", rate


def fit_table(cost: Any, title: str) -> Any:
    """A rich table of a cost model's fits: a, b (also as a rate), R²."""
    table = Table(title=title)
    for col in ("primitive", "a (µs)", "b", "rate", "R²"):
        table.add_column(col, justify="left" if col == "primitive" else "right")
    for key, fit in sorted(cost.costs.items()):
        table.add_row(key, *_cells(key, fit), f"{fit.r2:.3f}")
    return table


def _profile_worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist  # torch loads only in the ranks that profile

    if args.threads:  # the kernels follow torch's setting
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    transport = Transport()
    say = print if transport.rank == 0 else (lambda *_: None)
    # a job of several nodes: the links inside and between them fitted apart
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cost = measure(transport, tuple(args.algorithms), steps=Synchronizer.time_steps, reps=args.reps,
                   target=args.target, per_node=local if 1 < local < transport.size else 1,
                   say=lambda s: say(f"  {s}"))
    cost.meta["network"] = args.network
    if transport.rank == 0:
        cost.save(args.out)
        where = f"{cost.world} nodes x {cost.gpus} ranks" if cost.gpus > 1 \
            else f"{cost.world} ranks"
        make_console(100).print(fit_table(cost, f"cost profile: {where} on "
                                                 f"{cost.meta['host']}"))
        print(f"wrote {args.out}")
    dist.barrier()
    destroy_process_group()
    return 0


def profile_main(argv: list[str]) -> int:
    """``hipress profile``: fit t(x) = a + b·x for every primitive on N ranks."""
    parser = Parser(
        prog="hipress profile",
        description="Measure encode/decode per algorithm, merge, send and allreduce on N "
                    "ranks and fit t(x) = a + b*x. Under torchrun (RANK set) it profiles "
                    "that job's group; otherwise it starts --ranks local ranks.")
    parser.add_argument("--ranks", type=count(2), default=4, help="local ranks to start")
    parser.add_argument("--ranks-per-node", type=count(1), default=1,
                        help="with --network shaped: ranks sharing each node's namespace "
                             "(the profile then fits the links inside and between nodes)")
    parser.add_argument("--algorithms", nargs="+", type=algorithm, default=["onebit", "dgc"])
    parser.add_argument("--network", choices=["loopback", "paced", "shaped"],
                        default="loopback", help="paced: software pacing at --bandwidth; "
                        "shaped: namespaces with tc-shaped links (root)")
    parser.add_argument("--bandwidth", type=link_rate, default="1gbit")
    parser.add_argument("--reps", type=count(1), default=5)
    parser.add_argument("--target", default="auto", choices=["auto", "cpu", "cuda", "ref"],
                        help="codec target")
    parser.add_argument("-o", "--out", type=Path, default=Path("profile.json"))
    parser.add_argument("--threads", type=count(1),
                        help="torch.set_num_threads in each rank, which the kernels follow "
                             "(default: torch's; on this machine's shaped test hosts, its "
                             "cores / the ranks)")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        return _profile_worker(args)
    argv = list(argv)
    if "-o" not in argv and "--out" not in argv:
        argv += ["--out", str(args.out.resolve())]
    cmd = [sys.executable, "-m", "hipress", "profile", *argv]
    if args.network == "shaped":
        if args.threads is None:  # the test hosts share this machine's cores
            cmd += ["--threads", str(max(1, (os.cpu_count() or 1) // args.ranks))]
        return run_shaped(args.ranks, args.bandwidth, cmd, per_node=args.ranks_per_node)
    if args.ranks_per_node != 1:
        parser.error("--ranks-per-node needs --network shaped")
    return run(args.ranks, cmd, bandwidth=args.bandwidth if args.network == "paced" else None)


def _plan_parser() -> Parser:
    parser = Parser(
        prog="hipress plan",
        description="Plan every gradient of a model (compress?, topology, partitions) and "
                    "predict its sync time. With --profile, from measured costs; without, "
                    "for a V100-class cluster (see casync.model.costmodel.CostModel.cluster).")
    parser.add_argument("--profile", type=Path, help="a `hipress profile` JSON")
    parser.add_argument("--model", default="resnet50", choices=sorted(PROFILES))
    parser.add_argument("--nodes", type=count(1),
                        help="nodes (default: the profile's ranks, or 16)")
    parser.add_argument("--gpus", type=count(1), default=None,
                        help="GPUs per node (cluster: 8)")
    parser.add_argument("--bandwidth", type=link_rate, help="inter-node link rate, e.g. 100gbit "
                        "(overrides the profile's measured send rate)")
    parser.add_argument("--algorithms", nargs="+", type=algorithm, default=["onebit"])
    parser.add_argument("--backward-ms", type=number(minimum=0),
                        help="backward time spread over the "
                        "tensors (default: the model's V100 figure for a cluster, 0 — all "
                        "ready at once, as in bench sync — for a profile)")
    parser.add_argument("--all", action="store_true", help="list every tensor, not the top 30")
    return parser


def _costs(args: Any) -> tuple[CostModel, int, float]:
    """The cost model ``hipress plan`` plans on, the nodes, and the backward time (ms)."""
    rate = parse_rate(args.bandwidth) if args.bandwidth else None
    if args.profile:
        cost = CostModel.load(args.profile)
        nodes = args.nodes if args.nodes is not None else cost.world
        if rate is not None:
            send = cost.costs.get(Cost.SEND.key(), Linear(25e-6, 0))
            cost.costs[Cost.SEND.key()] = Linear(send.a, 8 / (0.9 * rate), send.r2, send.floor)
            cost.costs.pop(Cost.ALLREDUCE.key(), None)  # measured at another rate
        backward = args.backward_ms if args.backward_ms is not None else 0.0
    else:
        nodes = args.nodes if args.nodes is not None else 16
        gpus = args.gpus if args.gpus is not None else 8
        cost = CostModel.cluster(nodes, gpus, rate or 100e9, tuple(args.algorithms))
        backward = TIMINGS[args.model].backward_ms if args.backward_ms is None \
            else args.backward_ms
    if nodes < 1:
        raise ConfigError("--nodes must be at least 1")
    return cost, nodes, backward


def plan_main(argv: list[str]) -> int:
    """``hipress plan``: the planner's decisions for a model, from a profile or a cluster."""
    args = _plan_parser().parse_args(argv)
    cost, nodes, backward = _costs(args)
    grads = ready_times(layers(args.model), backward / 1e3) if backward > 0 else \
        [Gradient(layer.name, layer.numel) for layer in layers(args.model)]
    # on nodes of several workers: flat or hierarchical, each with its whole-model plan
    planner, planned = choose_level(cost, nodes, grads, tuple(args.algorithms))
    base = simulate(cost, nodes, grads, "allreduce")

    table = Table(title=f"{args.model} on {nodes} node(s) x {cost.gpus} worker(s), "
                        f"{'profile ' + str(args.profile) if args.profile else 'cluster model'}")
    for col in ("chunk", "elements", "tensors", "decision", "ready ms", "sync ms"):
        table.add_column(col, justify="left" if col in ("chunk", "decision") else "right")
    units = planned.units if args.all else sorted(
        planned.units, key=lambda u: -u.numel)[:30]
    for u in units:
        plan = u.plan
        assert plan is not None
        what = "none (allreduce)" if not plan.compress else f"{plan.algorithm} {plan.topology}"
        table.add_row(u.name[:60], f"{u.numel:,}", str(u.tensors), what,
                      f"{u.ready * 1e3:.1f}", f"{(u.finish - u.ready) * 1e3:.2f}")
    console = make_console(120)
    console.print(table)
    share = planned.compressed / max(sum(g.numel for g in grads), 1)
    console.print(f"predicted sync end: {planned.end * 1e3:.1f} ms after backward starts "
                  f"(backward {backward:.0f} ms); uncompressed allreduce: "
                  f"{base.end * 1e3:.1f} ms; {share:.0%} of the elements compressed")
    others = ", ".join(f"{label} {t * 1e3:.1f} ms" for label, t in planner.predictions.items())
    level = f"{planned.level} topology, " if planned.level else ""
    console.print(f"whole-model plan: {level}{planner.choice} (candidates: {others})")
    return 0
