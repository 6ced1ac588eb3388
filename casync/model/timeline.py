"""Predicted timelines: the cost model turned into stages on lanes, and lanes scheduled.

A rank has a ``compute`` lane (codec kernels, merges), a ``net`` lane (its network
link, full duplex: a stage costs the larger of what it sends and receives; only a
message's bytes hold the link, its fixed latency overlaps other messages) and, with
several GPUs per node, an ``intra`` lane for traffic inside the node. A partition of a
tensor becomes a *chain* of stages that run in order; a stage occupies its lane for
``busy`` seconds and then waits ``wait`` more seconds for work that other ranks do
(an aggregator's merge, say), without holding any lane of ours.

The unit is the engine's: a chunk (``casync.chunks``) of many segments becomes one chain,
following ``casync.graphs`` as seen by an average rank (in ``ps`` every rank aggregates
1/N of each chunk). Its codec calls are batched over the chunk and its messages carry
the whole chunk, so fixed costs count once per call and message, not per tensor.
``Lanes`` places each stage in the earliest gap of its lane after the stage is ready
(list scheduling with backfilling, as the executor runs the highest-priority ready
task), so chunks pipeline.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from hipress_base.errors import ConfigError

from ..plan import Plan
from .costmodel import Cost, CostModel

__all__ = ["Stage", "Lanes", "chains", "on_host", "predict"]


@dataclass(frozen=True)
class Stage:
    """``busy`` seconds on ``lane``, then ``wait`` seconds of other ranks' work."""

    lane: str
    busy: float
    wait: float = 0.0


class Lanes:
    """Free time of each lane as sorted gaps; stages go into the first gap that fits."""

    def __init__(self) -> None:
        self._starts: dict[str, list[float]] = {}
        self._ends: dict[str, list[float]] = {}
        self.busy: dict[str, float] = {}  # seconds placed on each lane

    def copy(self) -> Lanes:
        other = Lanes()
        other._starts = {k: v.copy() for k, v in self._starts.items()}
        other._ends = {k: v.copy() for k, v in self._ends.items()}
        other.busy = dict(self.busy)
        return other

    def place(self, lane: str, ready: float, busy: float) -> float:
        """Occupy ``lane`` for ``busy`` seconds from the earliest time ≥ ``ready``;
        return when it ends."""
        if busy <= 0:
            return ready
        self.busy[lane] = self.busy.get(lane, 0.0) + busy
        starts = self._starts.setdefault(lane, [0.0])
        ends = self._ends.setdefault(lane, [math.inf])
        i = bisect.bisect_right(ends, ready)
        while True:
            begin = max(starts[i], ready)
            if begin + busy <= ends[i]:
                break
            i += 1
        end = begin + busy
        # Split gap i into the parts before and after [begin, end).
        pieces = [(s, e) for s, e in ((starts[i], begin), (end, ends[i])) if e - s > 1e-12]
        starts[i:i + 1] = [s for s, _ in pieces]
        ends[i:i + 1] = [e for _, e in pieces]
        return end

    def fill(self, lane: str, ready: float, busy: float) -> float:
        """Occupy ``busy`` seconds of ``lane`` from ``ready`` in the gaps as they come,
        split as needed (divisible work, such as backward's kernels between a codec's);
        return when the last piece ends."""
        end = ready
        while busy > 1e-12:
            starts = self._starts.setdefault(lane, [0.0])
            ends = self._ends.setdefault(lane, [math.inf])
            i = bisect.bisect_right(ends, end)
            begin = max(starts[i], end)
            piece = min(busy, ends[i] - begin)
            end = self.place(lane, begin, piece)
            busy -= piece
        return end

    def run(self, chain: list[Stage], ready: float) -> float:
        """Schedule a chain's stages in order from ``ready``; return when it finishes."""
        t = ready
        for stage in chain:
            t = self.place(stage.lane, t, stage.busy) + stage.wait
        return t


class _Costs:
    """The model's primitive costs for one chain, with or without their fixed parts."""

    def __init__(self, cost: CostModel, algo: str | None, fixed: bool) -> None:
        self.cost, self.algo, self.fixed, self.g = cost, algo, fixed, cost.gpus

    def _at(self, key: str, x: float) -> float:
        fit = self.cost._get(key)
        return fit(x) if self.fixed else fit.b * x

    def enc(self, v: float) -> float:
        return self._at(Cost.ENCODE.key(self.algo), v / self.g)

    def dec(self, v: float) -> float:
        return self._at(Cost.DECODE.key(self.algo), v / self.g)

    def acc(self, v: float) -> float:
        key = Cost.ACCUMULATE.key(self.algo)
        if key not in self.cost.costs:
            key = Cost.DECODE.key(self.algo)
        return self._at(key, v / self.g)

    def fuse(self, v: float) -> float:
        """A merge and the re-encode after it: one call where the profile timed it."""
        key = Cost.FUSE.key(self.algo)
        if key not in self.cost.costs:
            return self.acc(v) + self.enc(v)
        return self._at(key, v / self.g)

    def nbytes(self, v: float) -> float:
        return self.g * self.cost.nbytes(str(self.algo), v / self.g)

    def wire(self, nbytes: float) -> Stage:
        busy, latency = self.cost.wire(nbytes)
        return Stage("net", busy, latency if self.fixed else 0.0)


def _codec_stages(c: _Costs, topology: str, x: float, world: int) -> list[Stage]:
    """One compressed chunk of ``x`` elements among ``world`` nodes, as seen by a rank."""
    n = world
    if topology == "ps":
        # Every rank aggregates 1/N of the chunk and works for the rest: one batched encode
        # and one message per aggregator, N-1 merges (the last inside the re-encode's call)
        # and a final decode of its own share, one reply from each aggregator and their
        # decodes.
        share, mine = x / n, x - x / n
        wire = c.wire((n - 1) * c.nbytes(share))
        agg = (n - 2) * c.acc(share) + c.fuse(share) + c.dec(share)
        return [Stage("compute", (n - 1) * c.enc(share)), wire, Stage("compute", agg), wire,
                Stage("compute", (n - 1) * c.dec(share) if mine else 0.0)]
    if topology == "ring":
        run = x / n
        hop = c.wire(c.nbytes(run))
        out = [Stage("compute", c.enc(run))]
        for _ in range(n - 1):
            out += [hop, Stage("compute", c.fuse(run))]
        out += [hop for _ in range(n - 1)]
        return out + [Stage("compute", n * c.dec(run))]  # the decodes also average
    if topology == "allgather":
        # the first decode overwrites, the others add (the last one also averages)
        return [Stage("compute", c.enc(x)), c.wire((n - 1) * c.nbytes(x)),
                Stage("compute", c.dec(x) + (n - 1) * c.acc(x))]
    raise ConfigError(f"no compressed chain for topology {topology!r}")


def chains(cost: CostModel, plan: Plan, numel: int, world: int, segments: int = 1,
           engine: bool = True, fixed: bool = True) -> list[list[Stage]]:
    """The stage chains of one chunk of ``numel`` elements in ``segments`` segments
    synchronized under ``plan``: its chain, and before it one-stage chains of CPU work
    spent alongside (the engine's cost per chunk graph and per segment, a collective's
    share of the cores), all ready together.

    Args:
        cost: the cost model.
        plan: topology and algorithm (a chunk mixes tensors of any K).
        numel: elements of the chunk.
        world: nodes taking part (``cost.gpus`` workers each).
        segments: payloads in the chunk (a tensor's partitions count one each).
        engine: add CaSync's own cost per graph, per segment and per element
            (``graph/TOPOLOGY``, ``tensor/TOPOLOGY``, ``bulk/ALGO/TOPOLOGY``); off for
            baselines that do not run through the engine.
        fixed: count fixed costs (latencies, per-call costs); off to price what one more
            tensor adds to a chunk shared with others (the planner's per-tensor choice).

    Example:
        >>> cluster = CostModel.cluster(4, 1, 25e9)   # on paper: no per-graph cost
        >>> len(chains(cluster, Plan("ring", "onebit", 2), 1 << 20, 4))
        1
    """
    x = float(numel)
    inner = [Stage("intra", cost.intra(4 * x))] if cost.gpus > 1 else []
    out: list[list[Stage]] = []
    beside: list[list[Stage]] = []
    if world > 1 and plan.topology == "none":
        # A collective runs alone on its group and its measured time already holds its own
        # CPU work, so it stays whole on the link, one after another; the share of the
        # cores it takes meanwhile is charged beside it. The engine copies the chunk into
        # one buffer first and averages it and copies it back after.
        busy = cost.allreduce(x, world, fixed)
        merge = cost.merge(x / cost.gpus) if fixed \
            else cost._get(Cost.MERGE.key()).b * x / cost.gpus
        out.append(inner + [Stage("compute", merge), Stage("net", busy),
                            Stage("compute", 2 * merge)] + inner)
        beside.append([Stage("compute", (1 - _overlap(cost)) * busy)])
    elif world > 1:
        assert plan.algorithm is not None
        c = _Costs(cost, plan.algorithm, fixed)
        out.append(on_host(cost, inner + _codec_stages(c, plan.topology, x, world) + inner))
    else:
        out.append(inner)
    if engine:
        beside += _engine_stages(cost, plan, x, segments, fixed)
    return beside + out


def _engine_stages(cost: CostModel, plan: Plan, x: float, segments: int,
                   fixed: bool) -> list[list[Stage]]:
    """The engine's own cost of running a chunk's graph (tasks, dispatch, messages), of
    each segment in it and of each element (threads sharing the cores, waits between
    ranks), measured on the engine: spent on the cores while the graph runs, so it
    occupies the compute lane beside the chain rather than before it."""
    per_graph = cost.costs.get(Cost.GRAPH.key(plan.topology))
    per_tensor = cost.costs.get(Cost.TENSOR.key(plan.topology))
    bulk = cost.costs.get(Cost.BULK.key(plan.algorithm, plan.topology) if plan.compress
                          else Cost.BULK.key("none"))
    out = []
    if per_graph is not None and fixed:
        out.append([Stage("compute", per_graph.a)])
    if bulk is not None:
        out.append([Stage("compute", bulk.b * x)])
    if per_tensor is not None:
        out.append([Stage("compute", segments * per_tensor.a)])
    return out


def _overlap(cost: CostModel) -> float:
    return min(max(cost.overlap, 0.0), 1.0)


def on_host(cost: CostModel, chain: list[Stage]) -> list[Stage]:
    """Charge communication to the CPU as far as the host cannot overlap it.

    With ``cost.overlap`` = o (measured: how much of a send's time the cores stay free),
    a network stage keeps the share o on the link and puts the share 1 - o on the
    compute lane first: o = 1 is a separate link, o = 0 — several ranks on few cores
    over loopback — puts all of it on the cores.
    """
    o = _overlap(cost)
    if o >= 1.0:
        return chain
    out: list[Stage] = []
    for s in chain:
        if s.lane != "net":
            out.append(s)
            continue
        out.append(Stage("compute", (1 - o) * s.busy))
        if o > 0:
            out.append(Stage("net", o * s.busy, s.wait))
        else:
            out[-1] = Stage("compute", s.busy, s.wait)
    return out


def predict(lanes: Lanes, cost: CostModel, plan: Plan, numel: int, world: int,
            ready: float, segments: int = 1, engine: bool = True, fixed: bool = True) -> float:
    """Schedule a chunk's chains on ``lanes`` from ``ready``; return when it finishes."""
    return max((lanes.run(chain, ready)
                for chain in chains(cost, plan, numel, world, segments, engine, fixed)),
               default=ready)
