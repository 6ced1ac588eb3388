"""Predict one iteration's synchronization: strategies, backward order and the lanes.

``simulate`` walks a model's gradients in backward order (each ready when backward has
produced it), groups them the way a strategy does (DDP's 25 MB buckets, the engine's
chunks, BytePS's per-tensor partitions), plans each group and schedules its stages on
one rank's lanes (``casync.timeline``). The planner, the
simulator and the validation against ``bench sync`` share this one model.

Strategies: ``allreduce`` (uncompressed, 25 MB buckets), ``naive`` (per tensor:
encode, all-gather, decode all, one after another), ``powersgd`` (torch's hook:
per bucket a rank-r P allreduce then a Q allreduce), and ``casync`` with any planner
(``StaticPlanner`` for fixed strategies such as BytePS-onebit or ring-DGC,
``CostPlanner`` for the planner).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .chunks import CHUNK_ELEMS, Chunk, Chunker
from .costmodel import Cost, CostModel
from .plan import Greedy, Plan, Planner
from .timeline import Lanes, Stage, on_host, predict

__all__ = ["Gradient", "Unit", "Result", "simulate", "ready_times", "DDP_BUCKET"]

DDP_BUCKET = 25 << 20 >> 2  # DDP's default bucket_cap_mb, in float32 elements


@dataclass(frozen=True)
class Gradient:
    """A gradient tensor and the time (seconds from the start of backward) it is ready."""

    name: str
    numel: int
    ready: float = 0.0


@dataclass(frozen=True)
class Unit:
    """What one chunk (or bucket) carried: its label, size, plan, predicted times and how
    many tensors it held."""

    name: str
    numel: int
    plan: Plan | None
    ready: float
    finish: float
    tensors: int = 1


@dataclass
class Result:
    """A simulated iteration: when synchronization ends and what each unit did."""

    strategy: str
    end: float
    units: list[Unit] = field(default_factory=list)

    @property
    def compressed(self) -> int:
        return sum(u.numel for u in self.units if u.plan is not None and u.plan.compress)


def ready_times(layers: Sequence[Any], backward_s: float) -> list[Gradient]:
    """Spread ``backward_s`` over ``layers`` (``casync.models.Layer``) by their work
    weights; a gradient is ready when backward has done its layer."""
    weights = [max(layer.work, 0.0) for layer in layers]
    total = sum(weights) or 1.0
    out, t = [], 0.0
    for layer, w in zip(layers, weights, strict=True):
        t += backward_s * w / total
        out.append(Gradient(layer.name, layer.numel, t))
    return out


def _groups(grads: Sequence[Gradient], limit: int) -> list[list[Gradient]]:
    """Consecutive gradients in groups of at least ``limit`` elements (DDP buckets)."""
    out: list[list[Gradient]] = [[]]
    for g in grads:
        if sum(x.numel for x in out[-1]) >= limit:
            out.append([])
        out[-1].append(g)
    return [group for group in out if group]


def _label(group: list[Gradient]) -> str:
    return f"bucket[{group[0].name}..{group[-1].name}]" if len(group) > 1 else group[0].name


@dataclass(eq=False)
class _Tensor:
    """A gradient as the chunker sees it (``casync.chunks.Entry``'s fields it reads)."""

    name: str
    numel: int
    pending: int = 0
    device: str = "cpu"


def _casync(cost: CostModel, world: int, grads: Sequence[Gradient], planner: Planner,
            chunk_elems: int, coalesce: bool) -> Result:
    """The engine's grouping: tensors planned one by one in arrival order, cut into
    segments and coalesced into chunks (``casync.chunks.Chunker``); each chunk is
    scheduled when it closes, as one chain."""
    if isinstance(planner, Greedy) and planner.fitted is not None:
        planner = planner.fitted  # a whole-model plan: follow it
    lanes = Lanes()
    if isinstance(planner, Greedy):
        planner.lanes = Lanes()  # its per-tensor choices, from an empty iteration
    result = Result("casync", 0.0)
    chunker = Chunker(world, chunk_elems, coalesce)

    def run(chunks: list[Chunk], ready: float) -> None:
        for chunk in chunks:
            finish = predict(lanes, cost, chunk.plan, chunk.numel, world, ready,
                             segments=len(chunk.segments))
            result.units.append(Unit(chunk.label, chunk.numel, chunk.plan, ready, finish,
                                     len({id(s.entry) for s in chunk.segments})))

    for g in grads:
        if isinstance(planner, Greedy):
            plan = planner.choose(g.name, g.numel, world, g.ready).plan
        else:
            plan = planner.plan(g.name, g.numel, world)
        run(chunker.add(_Tensor(g.name, g.numel), plan), g.ready)
    run(chunker.flush(), grads[-1].ready if grads else 0.0)
    result.end = max((u.finish for u in result.units), default=0.0)
    return result


def _naive(cost: CostModel, world: int, grads: Sequence[Gradient], algo: str) -> Result:
    """Per tensor: encode, all-gather sizes and payloads, decode every payload; serial."""
    lanes, result, t = Lanes(), Result("naive", 0.0), 0.0
    g_ = cost.gpus
    for g in grads:
        x = g.numel / g_
        y = cost.nbytes(algo, x)
        peers = world * g_ - 1
        # The exchange: all-gathers of the sizes, then of the payloads. Besides the
        # codec: zero the sum, average it, copy it back (three passes), and what the
        # baseline's own code costs per tensor (profiled as ``naive``).
        own = cost.costs[Cost.NAIVE.key()].a if Cost.NAIVE.key() in cost.costs else 0.0
        # It encodes without error feedback (``casync.baselines``), whatever the engine does.
        chain = [Stage("compute", cost.plain_encode(algo, x) + own),
                 Stage("net", cost.exchange(y, peers + 1)),
                 Stage("compute", (peers + 1) * cost.accumulate(algo, x) + 3 * cost.merge(x))]
        t = lanes.run(on_host(cost, chain), max(t, g.ready))
        result.units.append(Unit(g.name, g.numel, Plan("allgather", algo, 1), g.ready, t))
    result.end = t
    return result


def _powersgd(cost: CostModel, world: int, grads: Sequence[Gradient], rank: int) -> Result:
    """torch's powerSGD_hook per DDP bucket: vectors and the P factors in one allreduce,
    orthogonalize, Q factors in a second, then decompress (square matrices assumed)."""
    flops = cost._get(Cost.FLOPS.key())
    lanes, result = Lanes(), Result("powersgd", 0.0)
    for members in _groups(grads, DDP_BUCKET):
        name, numel, ready = _label(members), sum(g.numel for g in members), members[-1].ready
        mats = [g.numel for g in members if g.numel >= 4096]
        vec = sum(g.numel for g in members if g.numel < 4096)
        sides = [math.isqrt(n) for n in mats]
        p = sum(rank * s for s in sides) + vec
        work = sum(2.0 * n * rank for n in mats)
        orth = sum(4.0 * s * rank * rank for s in sides)
        chain = [Stage("compute", flops(work)), Stage("net", cost.allreduce(p, world)),
                 Stage("compute", flops(orth) + flops(work)),
                 Stage("net", cost.allreduce(sum(rank * s for s in sides), world)),
                 Stage("compute", flops(work))]
        if cost.gpus > 1:
            chain = [Stage("intra", cost.intra(4 * p)), *chain]
        finish = lanes.run(on_host(cost, chain), ready)
        result.units.append(Unit(name, numel, None, ready, finish))
    result.end = max((u.finish for u in result.units), default=0.0)
    return result


def simulate(cost: CostModel, world: int, grads: Sequence[Gradient], strategy: str, *,
             planner: Planner | None = None, algorithm: str = "onebit",
             chunk_elems: int = CHUNK_ELEMS, coalesce: bool = True,
             powersgd_rank: int = 4) -> Result:
    """Predict when one iteration's synchronization of ``grads`` ends.

    Args:
        cost: the cost model (a measured profile or ``CostModel.cluster``).
        world: nodes (ranks) taking part.
        grads: gradients in backward order with their ready times.
        strategy: ``allreduce``, ``naive``, ``powersgd`` or ``casync``.
        planner: for ``casync``: a ``StaticPlanner`` or a ``CostPlanner``.
        algorithm: for ``naive``.
        chunk_elems: the engine's chunk size (``casync.chunks``).
        coalesce: off, a chunk per tensor partition (per-tensor engines: BytePS).
        powersgd_rank: the rank of PowerSGD's factors.

    Returns:
        A ``Result`` with the end time (seconds after backward started) and the units.

    Example:
        >>> grads = [Gradient(n, k) for n, k in profile("resnet50")]
        >>> simulate(cost, 4, grads, "allreduce").end
    """
    if strategy == "allreduce":
        lanes, result = Lanes(), Result("allreduce", 0.0)
        for group in _groups(grads, DDP_BUCKET):
            name, numel, ready = _label(group), sum(g.numel for g in group), group[-1].ready
            plan = Plan("none", None, 1)
            # The chain holds DDP's own passes: the copy into the flat bucket, the average
            # and the copy back out (charging the copies here as well counted them twice).
            end = predict(lanes, cost, plan, numel, world, ready, engine=False)
            result.units.append(Unit(name, numel, plan, ready, end))
        result.end = max((u.finish for u in result.units), default=0.0)
        return result
    if strategy == "naive":
        return _naive(cost, world, grads, algorithm)
    if strategy == "powersgd":
        return _powersgd(cost, world, grads, powersgd_rank)
    if strategy == "casync":
        if planner is None:
            raise ValueError("strategy 'casync' needs a planner")
        return _casync(cost, world, grads, planner, chunk_elems, coalesce)
    raise ValueError(f"unknown strategy {strategy!r}; choose allreduce, naive, powersgd "
                     "or casync")
