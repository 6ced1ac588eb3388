"""The engine's own costs beyond its primitives, for the cost model: the engine's steps,
timed by the engine itself (``casync.plan.StepTimer``, ``Synchronizer.time_steps``),
against what the model of their primitives predicts (per chunk graph, per segment, per
element of bulk steps), and the naive baseline's per tensor. ``casync.model.profiler``
measures the primitives and calls ``engine_costs`` last."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from compll import codec as make_codec

from ..baselines import naive_step
from ..plan import COMPRESSED, StaticPlanner, StepTimer
from ..transport import Transport
from .costmodel import Cost, CostModel, Linear
from .simulate import Gradient, simulate

__all__ = ["engine_costs"]


def _engine_overhead(transport: Transport, steps: StepTimer, model: CostModel, algo: str,
                     topology: str, reps: int) -> tuple[Linear, Linear]:
    """The engine's own cost beyond its primitives, per chunk graph (``graph/TOPOLOGY``'s
    a) and per segment (``tensor/TOPOLOGY``).

    Real Synchronizer steps of tiny tensors are timed for two counts, each tensor in a
    chunk of its own (the slope per chunk) and all of them in one chunk (per segment);
    each slope beyond what the primitives predict for the same steps is the overhead."""
    algorithm = "none" if topology == "none" else algo
    planner = _flat_planner(algorithm, topology)
    tiny = 256

    def slope(shapes: list[tuple[int, int, int]]) -> float:
        measured = transport.max_over_ranks([
            steps(transport, planner, algorithm, ce, n, size, reps)
            for n, size, ce in shapes])
        predicted = [_predict_steps(model, transport.size, planner, n, size, ce)
                     for n, size, ce in shapes]
        per = shapes[1][0] - shapes[0][0]
        return ((measured[1] - measured[0]) - (predicted[1] - predicted[0])) / per

    per_tensor = max(slope([(16, tiny, 1 << 30), (64, tiny, 1 << 30)]), 0.0)
    per_chunk = max(slope([(16, tiny, tiny), (64, tiny, tiny)]) - per_tensor, 0.0)
    return Linear(per_chunk, 0.0), Linear(per_tensor, 0.0)


#: the bulk steps that price the engine's cost per element: eight tensors in two chunks
_BULK = (8, 1 << 22)


def _bulk_overhead(transport: Transport, steps: StepTimer, model: CostModel, algo: str,
                   topology: str, reps: int) -> Linear:
    """What the engine adds per element of a large step beyond its primitives
    (``bulk/ALGO/TOPOLOGY``): the threads that share the cores with the kernels, and the
    waits between ranks. Steps of eight 4M-float tensors in two chunks, measured against
    what the model (with the per-chunk and per-segment costs above) predicts for them."""
    algorithm = "none" if topology == "none" else algo
    planner = _flat_planner(algorithm, topology)
    count, size = _BULK
    measured = transport.max_over_ranks([steps(transport, planner, algorithm, 4 * size,
                                                  count, size, reps)])[0]
    predicted = _predict_steps(model, transport.size, planner, count, size, 4 * size)
    return Linear(0.0, max(measured - predicted, 0.0) / (count * size))


def _flat_planner(algorithm: str, topology: str) -> Any:
    return StaticPlanner(algorithm, topology if topology != "none" else "ps", min_compress=0,
                         partition_bytes=1 << 40)


def _predict_steps(model: CostModel, world: int, planner: Any, count: int, size: int,
                   chunk_elems: int) -> float:
    return simulate(model, world, [Gradient(f"g{i}", size) for i in range(count)], "casync",
                    planner=planner, chunk_elems=chunk_elems).end


def _naive_overhead(transport: Transport, model: CostModel, algo: str, reps: int) -> Linear:
    """The naive baseline's cost per tensor beyond the primitives it calls (its Python,
    its allocations, the waits for the slowest rank at every collective): steps of T tiny
    tensors timed for two T, the slope beyond what the model predicts for them."""
    import torch

    codec = make_codec(algo)
    counts, size = (16, 64), 256
    measured = []
    for count in counts:
        tensors = [torch.ones(size) for _ in range(count)]
        naive_step(transport.dist, codec, tensors, transport.group)
        times = []
        for _ in range(reps):
            transport.dist.barrier(group=transport.group)
            t0 = time.perf_counter()
            naive_step(transport.dist, codec, tensors, transport.group)
            times.append(time.perf_counter() - t0)
        measured.append(statistics.median(times))
    measured = transport.max_over_ranks(measured)
    predicted = [simulate(model, transport.size, [Gradient(f"g{i}", size) for i in range(n)],
                          "naive", algorithm=algo).end for n in counts]
    slope = ((measured[1] - measured[0]) - (predicted[1] - predicted[0])) / (counts[1] - counts[0])
    return Linear(max(slope, 0.0), 0.0)


def engine_costs(transport: Transport, steps: StepTimer, costs: dict[str, Linear],
                  overlap: float, algorithms: tuple[str, ...], reps: int,
                  say: Callable[[str], Any]) -> None:
    """Fit the engine's own costs beyond its primitives into ``costs``: the naive
    baseline's per tensor, per chunk graph and segment, and per element of bulk steps."""
    model = CostModel(transport.size, dict(costs), 1, {}, overlap)
    if algorithms:
        costs[Cost.NAIVE.key()] = _naive_overhead(transport, model, algorithms[0], reps)
        say(f"naive baseline's own cost per tensor: {costs[Cost.NAIVE.key()].a * 1e6:.0f} µs")
    for topo in ("none", *COMPRESSED) if algorithms else ("none",):
        costs[Cost.GRAPH.key(topo)], costs[Cost.TENSOR.key(topo)] = _engine_overhead(
            transport, steps, model, algorithms[0] if algorithms else "none", topo, reps)
        say(f"engine overhead per {topo} chunk: {costs[Cost.GRAPH.key(topo)].a * 1e6:.0f} µs, "
            f"per segment: {costs[Cost.TENSOR.key(topo)].a * 1e6:.1f} µs")
    model = CostModel(transport.size, dict(costs), 1, {}, overlap)
    for algo in algorithms:
        for topo in COMPRESSED:
            key = Cost.BULK.key(algo, topo)
            costs[key] = _bulk_overhead(transport, steps, model, algo, topo, reps)
            say(f"engine overhead of {algo} {topo} per element: "
                f"{costs[key].b * 1e9:.2f} ns")
    if algorithms:
        costs[Cost.BULK.key("none")] = _bulk_overhead(transport, steps, model,
                                                      algorithms[0], "none", reps)
