"""Predict one iteration's synchronization: strategies, backward order and the lanes.

``simulate`` walks a model's gradients in backward order (each ready when backward has
produced it), groups them the way a strategy does (DDP's 25 MB buckets, the engine's
chunks, BytePS's per-tensor partitions), plans each group and schedules its stages on
one rank's lanes (``casync.model.timeline``). The planner, the
simulator and the validation against ``bench sync`` share this one model.

Strategies: ``allreduce`` (uncompressed, 25 MB buckets), ``naive`` (per tensor:
encode, all-gather, decode all, one after another), ``powersgd`` (torch's hook:
per bucket a rank-r P allreduce then a Q allreduce, with its per-matrix kernels),
``byteps`` (BytePS: per 4 MB partition, reduced inside the node, copied to the host,
compressed there and pushed to and pulled from CPU servers) and ``casync`` with any
planner (``StaticPlanner`` for fixed strategies such as ring-DGC, ``CostPlanner`` for
the planner).

Where the cost model's compute lane is the processor backward runs on (a cluster's GPUs,
``CostModel.shares_compute``), backward's layers run on that lane too, in order: a
kernel placed while backward runs delays the layers after it (time sharing that loses
no work, the engine's kernels first), so compression is never free under backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hipress_base.errors import ConfigError

from ..chunks import CHUNK_ELEMS, Chunk, Chunker
from ..plan import Greedy, Plan, Planner
from .costmodel import Cost, CostModel, Linear
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
    """A simulated iteration: when synchronization ends and what each unit did; where
    backward shares the compute lane, when backward ends and the lane's time that was
    not backward (``kernels``)."""

    strategy: str
    end: float
    units: list[Unit] = field(default_factory=list)
    backward_end: float = 0.0
    kernels: float = 0.0
    #: for CaSync on several GPUs per node: "hierarchical" or "flat" (the planner's)
    level: str = ""

    @property
    def finish(self) -> float:
        """When both synchronization and backward are done."""
        return max(self.end, self.backward_end)

    @property
    def compressed(self) -> int:
        return sum(u.numel for u in self.units if u.plan is not None and u.plan.compress)


def ready_times(layers: Sequence[Any], backward_s: float) -> list[Gradient]:
    """Spread ``backward_s`` over ``layers`` (``casync.model.models.Layer``) by their work
    weights; a gradient is ready when backward has done its layer."""
    weights = [max(layer.work, 0.0) for layer in layers]
    total = sum(weights) or 1.0
    out, t = [], 0.0
    for layer, w in zip(layers, weights, strict=True):
        t += backward_s * w / total
        out.append(Gradient(layer.name, layer.numel, t))
    return out


class _Backward:
    """Backward's layers on the compute lane, where the cost model says it is shared:
    gradient i's layer takes the time between its ready time and gradient i-1's, from
    the end of the layer before or of the kernels placed in between. Elsewhere a
    gradient is ready when ``Gradient.ready`` says."""

    def __init__(self, cost: CostModel, lanes: Lanes) -> None:
        self.on, self.lanes = cost.shares_compute, lanes
        self.end = self.given = self.work = 0.0

    def ready(self, g: Gradient) -> float:
        if not self.on:
            self.end = max(self.end, g.ready)
            return g.ready
        work, self.given = max(g.ready - self.given, 0.0), max(g.ready, self.given)
        self.work += work
        self.end = self.lanes.fill("compute", self.end, work)
        return self.end

    def finish(self, result: Result) -> Result:
        result.backward_end = self.end
        result.kernels = self.lanes.busy.get("compute", 0.0) - self.work
        result.end = max((u.finish for u in result.units), default=0.0)
        return result


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
            chunk_elems: int, coalesce: bool, fuse_raw: bool = False) -> Result:
    """The engine's grouping: tensors planned one by one in arrival order, cut into
    segments and coalesced into chunks (``casync.chunks.Chunker``); each chunk is
    scheduled when it closes, as one chain."""
    if isinstance(planner, Greedy) and planner.fitted is not None:
        planner = planner.fitted  # a whole-model plan: follow it
    lanes = Lanes()
    backward = _Backward(cost, lanes)
    if isinstance(planner, Greedy):
        planner.lanes = Lanes()  # its per-tensor choices, from an empty iteration
    result = Result("casync", 0.0)
    chunker = Chunker(world, chunk_elems, coalesce, fuse_raw)

    def run(chunks: list[Chunk], ready: float) -> None:
        for chunk in chunks:
            finish = predict(lanes, cost, chunk.plan, chunk.numel, world, ready,
                             segments=len(chunk.segments))
            result.units.append(Unit(chunk.label, chunk.numel, chunk.plan, ready, finish,
                                     len({id(s.entry) for s in chunk.segments})))

    for g in grads:
        ready = backward.ready(g)
        if isinstance(planner, Greedy):
            plan = planner.choose(g.name, g.numel, world, ready).plan
        else:
            plan = planner.plan(g.name, g.numel, world)
        run(chunker.add(_Tensor(g.name, g.numel), plan), ready)
    run(chunker.flush(), backward.end)
    return backward.finish(result)


def _naive(cost: CostModel, world: int, grads: Sequence[Gradient], algo: str) -> Result:
    """Per tensor: encode, all-gather sizes and payloads, decode every payload; serial."""
    lanes, result, t = Lanes(), Result("naive", 0.0), 0.0
    backward = _Backward(cost, lanes)
    g_ = cost.gpus
    for g in grads:
        ready = backward.ready(g)
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
        t = lanes.run(on_host(cost, chain), max(t, ready))
        result.units.append(Unit(g.name, g.numel, Plan("allgather", algo, 1), ready, t))
    return backward.finish(result)


def _powersgd(cost: CostModel, world: int, grads: Sequence[Gradient], rank: int) -> Result:
    """torch's powerSGD_hook per DDP bucket (square matrices assumed): error feedback
    adds the residual in; P = M Q per matrix and one allreduce of the vectors and the
    Ps; Gram-Schmidt orthogonalizes each P column by column (small kernels: a norm, a
    division and a projection per later column); Q = Mᵀ P and its allreduce; the
    approximation P Qᵀ and the new residual. Per matrix its kernels pay a launch each."""
    flops = cost._get(Cost.FLOPS.key())
    launch = cost.costs.get(Cost.LAUNCH.key(), Linear(0.0, 0.0)).a
    lanes, result = Lanes(), Result("powersgd", 0.0)
    backward = _Backward(cost, lanes)
    for members in _groups(grads, DDP_BUCKET):
        name, numel = _label(members), sum(g.numel for g in members)
        ready = max(backward.ready(g) for g in members)
        mats = [g.numel for g in members if g.numel >= 4096]
        vec = sum(g.numel for g in members if g.numel < 4096)
        sides = [math.isqrt(n) for n in mats]
        p = sum(rank * s for s in sides) + vec
        work = sum(2.0 * n * rank for n in mats)
        # Gram-Schmidt: per column a norm and a division, a dot and an update per later one
        orth_kernels = len(mats) * (2 * rank + rank * (rank - 1))
        orth = sum(4.0 * s * rank * rank for s in sides)
        # per matrix: two GEMMs before the first allreduce and one after each, copies in
        # and out of the flat buffers; error feedback's passes over the whole bucket
        passes = 3 * cost.merge(numel)
        chain = [Stage("compute", passes + flops(work) + 3 * len(mats) * launch),
                 Stage("net", cost.allreduce(p, world)),
                 Stage("compute", flops(orth) + orth_kernels * launch + flops(work)
                       + 2 * len(mats) * launch),
                 Stage("net", cost.allreduce(sum(rank * s for s in sides), world)),
                 Stage("compute", flops(work) + 3 * len(mats) * launch + passes)]
        if cost.gpus > 1:
            chain = [Stage("intra", cost.intra(4 * p)), *chain]
        finish = lanes.run(on_host(cost, chain), ready)
        result.units.append(Unit(name, numel, None, ready, finish))
    return backward.finish(result)


def _byteps(cost: CostModel, world: int, grads: Sequence[Gradient], algo: str,
            min_compress: int = 16384, partition: int = 1 << 20) -> Result:
    """BytePS with a compressor: per 4 MB partition of a tensor, an NCCL reduce-scatter
    inside the node, each GPU's share copied to host memory, compressed on the CPU
    (under ``min_compress`` elements: raw), pushed to the servers, which decompress,
    sum and recompress on their CPUs, pulled back, decompressed, copied to the GPU and
    all-gathered inside the node. Its CPU work runs beside the GPUs (a ``cpu`` lane)."""
    lanes, result = Lanes(), Result("byteps", 0.0)
    backward = _Backward(cost, lanes)
    g_ = cost.gpus
    cpu = cost._get(Cost.CPU.key(algo))
    for g in grads:
        ready = backward.ready(g)
        for lo in range(0, max(g.numel, 1), partition):
            x = min(partition, g.numel - lo) if g.numel else 0
            mine = x / g_  # this GPU's share of the partition
            raw = x < min_compress
            nbytes = 4 * mine if raw else cost.nbytes(algo, mine)
            inner = [Stage("intra", cost.intra(4 * x))] if g_ > 1 else []
            copy = Stage("pcie", cost._get(Cost.PCIE.key())(4 * mine))
            code = Stage("cpu", cost.merge(mine) if raw else cpu(mine))
            # A node's server owns 1/N of the partitions: it decodes and sums N pushes
            # and re-encodes the sum, on as many threads as a GPU's worker has.
            work = world * cost.merge(x) if raw else (world + 1) * cpu(x)
            server = Stage("server", work / world)
            push = Stage("net", *cost.wire(g_ * nbytes))  # the node's GPUs share its link
            chain = [*inner, copy, code, push, server, push, code, copy, *inner]
            finish = lanes.run(chain, ready)
            result.units.append(Unit(f"{g.name}[{lo}]", x, None if raw else
                                     Plan("ps", algo, 1), ready, finish))
    return backward.finish(result)


def simulate(cost: CostModel, world: int, grads: Sequence[Gradient], strategy: str, *,
             planner: Planner | None = None, algorithm: str = "onebit",
             chunk_elems: int = CHUNK_ELEMS, coalesce: bool = True,
             fuse_raw: bool = False, powersgd_rank: int = 4) -> Result:
    """Predict when one iteration's synchronization of ``grads`` ends.

    Args:
        cost: the cost model (a measured profile or ``CostModel.cluster``).
        world: nodes (ranks) taking part.
        grads: gradients in backward order with their ready times.
        strategy: ``allreduce``, ``naive``, ``powersgd``, ``byteps`` or ``casync``.
        planner: for ``casync``: a ``StaticPlanner`` or a ``CostPlanner``.
        algorithm: for ``naive`` and ``byteps``.
        chunk_elems: the engine's chunk size (``casync.chunks``).
        coalesce: off, a chunk per tensor partition (per-tensor engines).
        fuse_raw: with ``coalesce`` off, uncompressed tensors still share chunks
            (Horovod's tensor fusion, under ring-DGC).
        powersgd_rank: the rank of PowerSGD's factors.

    Returns:
        A ``Result`` with the end time (seconds after backward started) and the units.

    Example:
        >>> grads = [Gradient(n, k) for n, k in profile("resnet50")]
        >>> simulate(cost, 4, grads, "allreduce").end
    """
    if strategy == "allreduce":
        lanes, result = Lanes(), Result("allreduce", 0.0)
        backward = _Backward(cost, lanes)
        for group in _groups(grads, DDP_BUCKET):
            name, numel = _label(group), sum(g.numel for g in group)
            ready = max(backward.ready(g) for g in group)
            plan = Plan("none", None, 1)
            # The chain holds DDP's own passes: the copy into the flat bucket, the average
            # and the copy back out (charging the copies here as well counted them twice).
            end = predict(lanes, cost, plan, numel, world, ready, engine=False)
            result.units.append(Unit(name, numel, plan, ready, end))
        return backward.finish(result)
    if strategy == "naive":
        return _naive(cost, world, grads, algorithm)
    if strategy == "powersgd":
        return _powersgd(cost, world, grads, powersgd_rank)
    if strategy == "byteps":
        return _byteps(cost, world, grads, algorithm)
    if strategy == "casync":
        if planner is None:
            raise ConfigError("strategy 'casync' needs a planner")
        return _casync(cost, world, grads, planner, chunk_elems, coalesce, fuse_raw)
    raise ConfigError(f"unknown strategy {strategy!r}; choose allreduce, naive, powersgd, "
                     "byteps or casync")
