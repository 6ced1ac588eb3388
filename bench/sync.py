"""Synchronization benchmark: CaSync against uncompressed allreduce and a naive baseline.

N ranks synchronize a model's gradient profile (tensor sizes in backward order, see
``casync.model.models``) every step. In the same run, on the same ranks and links:

* ``allreduce``: uncompressed Gloo allreduce over 25 MB buckets (what DDP does);
* ``naive <algo>``: per tensor, encode, all-gather sizes and payloads, decode and sum —
  no pipelining, no batching (how compression is usually bolted on;
  ``casync.baselines``);
* ``casync <algo> <topology>``: the engine with its default static plan, or with
  ``auto`` the cost-model planner on a profile measured on the same ranks first;
* the lower bound of each algorithm: its compressed bytes over one link at the measured
  link rate, 2(N-1)/N of the payload each way, plus one encode and one decode of the
  whole gradient, timed on every rank at once (so with the same CPU contention);
* for each CaSync case, the critical path of its own graphs: the compute tasks one of its
  steps ran (every codec call a rank's graphs need, with error feedback's and the
  aggregators' extra work), run again back to back on every rank at once, plus the bytes
  the rank sent at the link rate; the engine's time above it is its own cost;
* messages per step per rank: point-to-point sends plus collectives.

Times are the slowest rank's, median over ``--steps`` after a warm-up step (two for
``auto``: one to fit its whole-model plan, one to set that plan up); the engine's cases
take their steps round-robin, one of each in turn. With
``--validate`` the run also profiles the primitives and prints what the simulator
(``casync.model.simulate``) predicts for each case, and its error.

    hipress bench sync                                   # 4 ranks on loopback
    sudo hipress bench sync --network shaped             # namespaces, 1 Gbit/s links
    sudo hipress bench sync --network shaped --nodes 2 --ranks-per-node 2
    torchrun --nnodes 16 --nproc-per-node 1 ... bench/sync.py   # a real cluster

Under torchrun (``RANK`` set) the script is a worker itself; otherwise it starts the
ranks locally, on loopback or inside shaped network namespaces (``hipress/hosts.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from casync.baselines import naive_step  # noqa: E402
from casync.chunks import CHUNK_ELEMS  # noqa: E402
from casync.hierarchy import INTRA_DTYPES  # noqa: E402
from casync.plan import COMPRESSED, HIERARCHICAL, MIN_COMPRESS  # noqa: E402
from hipress.cliargs import (  # noqa: E402
    Parser,
    add_nodes,
    algorithm,
    count,
    nodes_of,
    number,
    rate,
)
from hipress.distributed import destroy_process_group  # noqa: E402
from hipress.hosts import loopback, parse_rate, shaped  # noqa: E402
from hipress.launcher import run_on_hosts  # noqa: E402
from hipress.network import bind_to_master  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


# ------------------------------------------------------------------------------ worker


#: ``--profile many-small``: many small tensors, each compressed (what costs an engine
#: that pays per tensor)
MANY_SMALL = [(f"small{i}", 2000) for i in range(160)]


def _sizes(name: str, scale: float) -> list[tuple[str, int]]:
    from casync.model.models import profile

    sizes = MANY_SMALL if name == "many-small" else profile(name)
    return [(n, max(1, int(k * scale))) for n, k in sizes]


def _gradients(profile: list[tuple[str, int]], rank: int) -> list[np.ndarray]:
    r = np.random.default_rng(rank)
    return [(r.standard_normal(n) * 1e-3).astype(np.float32) for _, n in profile]


def _time_once(dist: Any, step: Any, reset: Any) -> float:
    """One ``step`` from a common start: the slowest rank's seconds."""
    import torch

    reset()
    dist.barrier()
    t0 = time.perf_counter()
    step()
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _timed(dist: Any, step: Any, reset: Any, steps: int, warmup: int = 1) -> list[float]:
    """Run ``step`` ``warmup`` + ``steps`` times; the slowest rank's seconds per timed
    step."""
    times = [_time_once(dist, step, reset) for _ in range(warmup + steps)]
    return times[warmup:]


def _allreduce_step(dist: Any, tensors: list[Any]) -> None:
    import torch

    bucket: list[Any] = []
    size = 0
    works = []
    for t in tensors + [None]:
        if t is not None:
            bucket.append(t)
            size += t.numel() * 4
        if bucket and (t is None or size >= BUCKET_BYTES):
            flat = torch.cat(bucket)
            works.append((dist.all_reduce(flat, async_op=True), flat, bucket))
            bucket, size = [], 0
    world = dist.get_world_size()
    for work, flat, parts in works:
        work.wait()
        flat /= world
        offset = 0  # copy back into the gradients, as DDP does
        for p in parts:
            p.copy_(flat[offset:offset + p.numel()])
            offset += p.numel()


def _messages_of(sync: Any) -> int:
    """Messages an engine has sent: a flat engine's transport's count; a hierarchical
    engine's, both levels (its flat engines' and its intra-node collectives). The
    benchmark reads inside the engines on purpose."""
    wire = getattr(sync, "wire", None)
    if wire is None:
        return _messages(sync.transport)
    return sum(_messages(e.transport) for e in wire.engines) + int(wire.intra_collectives)


def _across(sync: Any) -> int:
    """Bytes across the network: a hierarchical engine's intra-node ones stay on the
    node."""
    wire = getattr(sync, "wire", None)
    return int(wire.across_bytes) if wire is not None else int(sync.bytes_sent)


def _messages(transport: Any) -> int:
    return int(transport.messages_sent + transport.collectives)


def _max_over_ranks(dist: Any, value: float) -> float:
    import torch

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _critical_path(dist: Any, sync: Any, step: Any, reset: Any) -> float:
    """The compute work of one step of ``sync``'s graphs, timed alone on every rank at
    once: run a step with the executor's trace on, then run its compute tasks again back
    to back (their messages are still in the receive buffers). The slowest rank's time."""
    executor = getattr(sync, "inner", sync).executor  # a hierarchical one's across nodes
    executor.trace, executor.ran = [], []
    reset()
    step()
    ran, executor.trace, executor.ran = executor.ran, None, []
    dist.barrier()
    t0 = time.perf_counter()
    for work in ran:
        work()
    return _max_over_ranks(dist, time.perf_counter() - t0)


def _link_rate(dist: Any, rank: int, peer: int = 1, nbytes: int = 16 << 20) -> float:
    """Goodput of one link (rank 0 -> ``peer``) in bytes/s, measured with Gloo."""
    import torch

    buf = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(buf, peer)
    elif rank == peer:
        dist.recv(buf, 0)
    took = torch.tensor([time.perf_counter() - t0 if rank == peer else 0.0],
                        dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return nbytes / float(took)


def _probe(dist: Any, rank: int, size: int = 64 << 10, count: int = 200) -> dict[str, float]:
    """Per-message cost of a worst-case receive buffer against a size message first."""
    import torch

    payload = torch.zeros(size, dtype=torch.uint8)
    big = torch.empty(4 * size, dtype=torch.uint8)
    out: dict[str, float] = {}
    for mode in ("capacity", "exchange"):
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(count):
            if rank == 0 and mode == "capacity":
                dist.send(payload, 1, tag=i)
            elif rank == 1 and mode == "capacity":
                dist.recv(big, 0, tag=i)
            elif rank == 0:
                dist.send(torch.tensor([size], dtype=torch.int64), 1, tag=i)
                dist.send(payload, 1, tag=i)
            elif rank == 1:
                n = torch.zeros(1, dtype=torch.int64)
                dist.recv(n, 0, tag=i)
                dist.recv(torch.empty(int(n), dtype=torch.uint8), 0, tag=i)
        out[f"{mode}_us"] = (time.perf_counter() - t0) / count * 1e6
    return out


def _bench_algorithm(dist: Any, args: argparse.Namespace, algo: str, tensors: list[Any],
                     flat: np.ndarray, reset: Any, link_Bps: float, cost: Any,
                     say: Any, allreduce: Any, allreduce_times: list[float]
                     ) -> list[dict[str, Any]]:
    """Lower bound, naive baseline and CaSync per topology for one algorithm; the Gloo
    allreduce takes its turn among the topologies (its times go to ``allreduce_times``)."""
    import hipress
    from casync import Engine, StaticPlanner, engine

    world = dist.get_world_size()
    codec = hipress.codec(algo)
    payload = codec.encode(flat).copy()
    enc_buf = np.empty(codec.max_payload_bytes(flat.size), np.uint8)
    dec_buf = np.empty_like(flat)
    enc = statistics.median(_timed(dist, lambda: codec.encode(flat, out=enc_buf), reset,
                                   args.steps))
    dec = statistics.median(_timed(dist, lambda: codec.decode(payload, flat.size, out=dec_buf),
                                   reset, args.steps))
    link = 2 * (world - 1) / world * payload.nbytes
    bound = {"case": f"lower bound {algo}", "algorithm": algo, "topology": "-",
             "encode_s": enc, "decode_s": dec, "payload_bytes": int(payload.nbytes),
             "bytes_per_rank": link, "seconds": enc + dec + link / link_Bps}
    rows = [bound]
    if args.naive:
        times = _timed(dist, lambda: naive_step(dist, codec, tensors), reset, args.steps)
        rows.append({"case": f"naive {algo}", "algorithm": algo, "topology": "allgather",
                     "seconds": statistics.median(times)})
        say(f"naive {algo}: {rows[-1]['seconds']:.3f} s")
    # The engine under every topology and the allreduce, timed round-robin (one step of
    # each in turn), so that the machine's slow drifts land on all of them alike: auto is
    # compared with the fixed strategies, and each with the allreduce, fairly.
    syncs: dict[str, Engine] = {}
    for topo in args.topologies:
        flat_topo = topo if topo in COMPRESSED else "ps"  # auto's default; across nodes
        planner: Any = StaticPlanner(algo, flat_topo, min_compress=args.min_compress)
        if topo == "auto":
            from casync.model.planner import CostPlanner

            planner = CostPlanner(cost.flat(), (algo,))  # over every rank
        # hierarchical: its nodes from LOCAL_WORLD_SIZE (--ranks-per-node), ps across
        levels = {"intra_dtype": args.intra_dtype} if topo == HIERARCHICAL else {}
        syncs[topo] = engine(algo, topo if topo == HIERARCHICAL else flat_topo,
                             timeout=600, chunk_elems=args.chunk_elems, planner=planner,
                             **levels)

    names = [f"t{i}" for i in range(len(tensors))]

    def step_of(sync: Engine) -> Any:
        def step() -> None:
            sync.submit_many(zip(names, tensors, strict=True))  # as DDP hands a bucket
            sync.synchronize()
        return step

    sent0, msgs0 = {}, {}
    for topo, sync in syncs.items():
        # auto: the engine fits its whole-model plan after its first step, and the step
        # after is the first to run that plan (its buffers and residuals): warm up both.
        _timed(dist, step_of(sync), reset, 0, warmup=2 if topo == "auto" else 1)
        sent0[topo] = sync.bytes_sent
        sent0[f"{topo} across"] = _across(sync)
        msgs0[topo] = _messages_of(sync)
    times: dict[str, list[float]] = {topo: [] for topo in syncs}
    for _ in range(args.steps):
        for topo, sync in syncs.items():
            times[topo].append(_time_once(dist, step_of(sync), reset))
        allreduce_times.append(_time_once(dist, allreduce, reset))
    for topo, sync in syncs.items():
        steps = max(args.steps, 1)
        sent = (sync.bytes_sent - sent0[topo]) / steps
        messages = _max_over_ranks(dist, (_messages_of(sync) - msgs0[topo]) / steps)
        across = (_across(sync) - sent0.get(f"{topo} across", 0)) / steps
        critical = _critical_path(dist, sync, step_of(sync), reset) + across / link_Bps
        rows.append({"case": f"casync {algo} {topo}", "algorithm": algo, "topology": topo,
                     "seconds": statistics.median(times[topo]), "all_seconds": times[topo],
                     "bytes_per_rank": sent, "messages_per_step": messages,
                     "critical_s": critical})
        choice = getattr(sync.planner, "choice", "")  # what auto's whole-model plan is
        if choice:
            rows[-1]["plan"] = choice
        sync.close()
        say(f"casync {algo} {topo}: {rows[-1]['seconds']:.3f} s"
            + (f" (planned: {choice})" if choice else ""))
    say(f"lower bound {algo}: {bound['seconds']:.3f} s (encode {enc * 1e3:.0f} ms, "
        f"decode {dec * 1e3:.0f} ms)")
    return rows


def _predict(rows: list[dict[str, Any]], cost: Any, world: int,
             sizes: list[tuple[str, int]], args: argparse.Namespace) -> None:
    """Add the simulator's prediction to every measured row it models."""
    from casync.model.planner import CostPlanner
    from casync.model.simulate import Gradient, simulate
    from casync.plan import StaticPlanner

    grads = [Gradient(name, n) for name, n in sizes]  # all ready at once, as here
    flat = cost.flat()  # on nodes, the flat cases: every rank on its share of the link
    for row in rows:
        case, algo, topo = row["case"], row["algorithm"], row["topology"]
        if case == "allreduce":
            result = simulate(flat, world, grads, "allreduce")
        elif case.startswith("naive"):
            result = simulate(flat, world, grads, "naive", algorithm=algo)
        elif case.startswith("casync") and topo == HIERARCHICAL:
            # the levels inside a node priced by ``intra``, ps across world / gpus nodes
            result = simulate(cost, world // cost.gpus, grads, "casync",
                              planner=StaticPlanner(algo, "ps", min_compress=args.min_compress),
                              chunk_elems=args.chunk_elems)
        elif case.startswith("casync"):
            if topo == "auto":  # what the engine follows after its first (warm-up) step
                planner: Any = CostPlanner(flat, (algo,))
                planner.fit(grads, world, chunk_elems=args.chunk_elems)
            else:
                planner = StaticPlanner(algo, topo, min_compress=args.min_compress)
            result = simulate(flat, world, grads, "casync", planner=planner,
                              chunk_elems=args.chunk_elems)
        else:
            continue
        row["predicted_s"] = result.end
        row["error"] = result.end / row["seconds"] - 1


def worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if args.threads:  # as a job whose ranks share cores sets it (the kernels follow)
        torch.set_num_threads(args.threads)
    bind_to_master()  # on a cluster: Gloo on the interface that reaches node 0
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    sizes = _sizes(args.profile, args.scale)
    tensors_np = _gradients(sizes, rank)
    originals = [t.copy() for t in tensors_np]
    tensors = [torch.from_numpy(t) for t in tensors_np]
    flat = np.concatenate(originals)

    def reset() -> None:
        for t, o in zip(tensors_np, originals, strict=True):
            np.copyto(t, o)

    rows: list[dict[str, Any]] = []
    # Started by ``orchestrate`` on local test hosts, or directly (torchrun, hipress run,
    # Slurm) on a cluster, whose links are what they are: their rate is measured below.
    local = os.environ.get(_LOCAL)
    result: dict[str, Any] = {"profile": args.profile, "world": world,
                              "elements": int(flat.size), "network": local or "cluster",
                              "rate": args.bandwidth if local == "shaped" else None,
                              "scale": args.scale, "host": platform.node(), "rows": rows}
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on this node
    if world > 1:
        # between nodes where ranks share nodes (the first rank of node 1)
        peer = per_node if 1 < per_node < world else 1
        result["link_Bps"] = _link_rate(dist, rank, peer)
        say(f"link rate rank 0 -> {peer}: {result['link_Bps'] * 8 / 1e9:.2f} Gbit/s")
        if args.probe:
            result["probe"] = _probe(dist, rank)
            say(f"transport probe: {result['probe']}")

    def allreduce() -> None:
        _allreduce_step(dist, tensors)

    times = _timed(dist, allreduce, reset, args.steps)
    rows.append({"case": "allreduce", "algorithm": "none", "topology": "gloo",
                 "seconds": statistics.median(times), "all_seconds": times,
                 "bytes_per_rank": 2 * (world - 1) / world * flat.nbytes})
    say(f"allreduce: {rows[-1]['seconds']:.3f} s")
    cost = None
    if args.validate or "auto" in args.topologies:
        from casync import Synchronizer
        from casync.model.profiler import measure
        from casync.transport import Transport

        # on nodes: the links inside and between them fitted apart
        cost = measure(Transport(), tuple(args.algorithms), steps=Synchronizer.time_steps,
                       per_node=per_node if 1 < per_node < world else 1)
        result["cost_model"] = cost.to_json()
        say("profiled the primitives on these ranks")
        if cost.gpus > 1:
            from casync.model.planner import LevelChooser

            for algo in args.algorithms:
                chooser = LevelChooser(cost, world // cost.gpus, (algo,))
                levels = [chooser.hierarchical(n) for _, n in sizes]
                result.setdefault("levels", {})[algo] = {
                    "hierarchical_tensors": sum(levels), "tensors": len(levels),
                    "hierarchical_elements": sum(n for (_, n), h in zip(sizes, levels,
                                                                         strict=True) if h)}
                say(f"plan='auto' on these nodes ({algo}): {sum(levels)} of {len(levels)} "
                    "tensors through the hierarchical levels, the rest flat")
    for algo in args.algorithms:
        rows += _bench_algorithm(dist, args, algo, tensors, flat, reset,
                                 result.get("link_Bps", float("inf")), cost, say,
                                 allreduce, times)
    # the reference over all its steps, most of them taken between the engine's
    rows[0]["seconds"] = statistics.median(times)
    if cost is not None and args.validate:
        _predict(rows, cost, world, sizes, args)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        if not local:  # on a cluster no orchestrator prints it
            report(result, args.out)
    dist.barrier()
    destroy_process_group()
    return 0


# ------------------------------------------------------------------------ orchestrator


def report(result: dict[str, Any], out: Path) -> None:
    from rich.table import Table

    rows = result["rows"]
    base = next(r["seconds"] for r in rows if r["case"] == "allreduce")
    naive = {r["algorithm"]: r["seconds"] for r in rows if r["case"].startswith("naive")}
    bound = {r["algorithm"]: r["seconds"] for r in rows if r["case"].startswith("lower")}
    rate = result.get("link_Bps", 0) * 8 / 1e9
    table = Table(title=f"{result['profile']} ({result['elements']:,} floats), "
                        f"{result['world']} ranks, {result['network']} network, "
                        f"link {rate:.2f} Gbit/s measured")
    predicted = any("predicted_s" in r for r in rows)
    cols = ["case", "sync ms", "vs allreduce", "vs naive", "/ lower bound", "critical ms",
            "/ critical", "MB/rank", "msgs/step"]
    cols += ["predicted ms", "error"] if predicted else []
    for col in cols:
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        algo = r["algorithm"]
        casync = r["case"].startswith("casync")
        table.add_row(
            r["case"], f"{r['seconds'] * 1e3:.1f}", f"{base / r['seconds']:.1f}x",
            f"{naive[algo] / r['seconds']:.1f}x" if casync and algo in naive else "-",
            f"{r['seconds'] / bound[algo]:.2f}" if casync and algo in bound else "-",
            f"{r['critical_s'] * 1e3:.1f}" if "critical_s" in r else "-",
            f"{r['seconds'] / r['critical_s']:.2f}" if "critical_s" in r else "-",
            f"{r['bytes_per_rank'] / 1e6:.1f}" if "bytes_per_rank" in r else "-",
            f"{r['messages_per_step']:.0f}" if "messages_per_step" in r else "-",
            *([f"{r['predicted_s'] * 1e3:.1f}", f"{r['error']:+.0%}"] if "predicted_s" in r
              else ["-", "-"] if predicted else []))
    make_console(150).print(table)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [r["case"] for r in rows]
    colors = ["grey" if n == "allreduce" else "tab:green" if n.startswith("lower")
              else "tab:orange" if n.startswith("naive") else "tab:blue" for n in names]
    ax.barh(names, [r["seconds"] * 1e3 for r in rows], color=colors)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("sync time per step, ms (log)")
    ax.set_title(f"{result['profile']}, {result['world']} ranks, {result['network']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


#: set by ``orchestrate`` for its workers: which local test network they run on
_LOCAL = "HIPRESS_BENCH_NETWORK"


def orchestrate(args: argparse.Namespace, argv: list[str]) -> int:
    ranks, per_node = nodes_of(args)
    if per_node > 1 and args.network != "shaped":
        raise SystemExit("--ranks-per-node needs --network shaped")
    if args.threads is None:  # the test hosts share this machine's cores
        argv = [*argv, "--threads", str(max(1, (os.cpu_count() or 1) // ranks))]
    hosts_cm = shaped(ranks // per_node, args.bandwidth, per_node=per_node) \
        if args.network == "shaped" else loopback(ranks)
    with hosts_cm as hosts:
        codes = run_on_hosts(hosts, [sys.executable, __file__, *argv],
                             dict(os.environ, PYTHONPATH=str(HERE.parent),
                                  **{_LOCAL: args.network}))
    if any(codes):
        print(f"ranks exited with {codes}", file=sys.stderr)
        return 1
    report(json.loads(args.out.read_text()), args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(prog="hipress bench sync", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_nodes(parser)
    parser.add_argument("--profile", default="resnet50",
                        help="gradient profile: resnet50, vgg19, bert-base, ..., or "
                             "many-small (160 tensors of 2,000 floats)")
    parser.add_argument("--algorithms", nargs="+", type=algorithm, default=["onebit", "dgc"])
    parser.add_argument("--topologies", nargs="+", default=list(COMPRESSED),
                        choices=[*COMPRESSED, HIERARCHICAL, "auto"],
                        help="ps, ring, allgather, hierarchical (uncompressed inside each "
                             "node of --ranks-per-node, ps across), and auto (the "
                             "cost-model planner on a profile measured at the start of "
                             "the run)")
    parser.add_argument("--intra-dtype", choices=INTRA_DTYPES, default="float32",
                        help="what hierarchical's levels inside a node send")
    parser.add_argument("--validate", action="store_true",
                        help="profile the primitives first and print the simulator's "
                             "prediction and error next to every measured case")
    parser.add_argument("--steps", type=count(1), default=3, help="timed steps after a warm-up")
    parser.add_argument("--scale", type=number(above=0), default=1.0,
                        help="multiply every tensor size (e.g. 0.01 for a quick check)")
    parser.add_argument("--network", choices=["loopback", "shaped"], default="loopback")
    parser.add_argument("--bandwidth", type=rate, default="1gbit",
                        help="shaped link rate (tc syntax)")
    parser.add_argument("--chunk-elems", type=count(1), default=CHUNK_ELEMS,
                        help="elements a CaSync chunk collects before it is sent")
    parser.add_argument("--min-compress", type=count(0), default=MIN_COMPRESS,
                        help="CaSync's static plans leave smaller tensors uncompressed "
                             "(0 for --profile many-small: compress every tensor)")
    parser.add_argument("--no-naive", dest="naive", action="store_false",
                        help="skip the naive baseline")
    parser.add_argument("--probe", action="store_true",
                        help="also measure one worst-case message against a size exchange")
    parser.add_argument("--threads", type=count(1),
                        help="torch.set_num_threads in each rank, which the kernels follow "
                             "(default: on this machine's test hosts, its cores / the "
                             "ranks; on a cluster, torch's own)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sync.json")
    args = parser.parse_args(argv)
    parse_rate(args.bandwidth)
    if "RANK" in os.environ:
        return worker(args)
    return orchestrate(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
