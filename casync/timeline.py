"""Predicted timelines: the cost model turned into stages on lanes, and lanes scheduled.

A rank has a ``compute`` lane (codec kernels, merges), a ``net`` lane (its network
link, full duplex: a stage costs the larger of what it sends and receives; only a
message's bytes hold the link, its fixed latency overlaps other messages) and, with
several GPUs per node, an ``intra`` lane for traffic inside the node. A partition of a
tensor becomes a *chain* of stages that run in order; a stage occupies its lane for
``busy`` seconds and then waits ``wait`` more seconds for work that other ranks do
(an aggregator's merge, say), without holding any lane of ours.

The chains follow ``casync.graphs`` as seen by an average rank: in ``ps`` every rank
aggregates 1/N of the partitions, so a stage's lane time is the per-rank share while
its latency is the aggregator's whole job. ``Lanes`` places each stage in the earliest
gap of its lane after the stage is ready (list scheduling with backfilling, as the
executor runs the highest-priority ready task), so partitions pipeline and tensors
overlap.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .costmodel import CostModel
from .plan import Plan

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

    def copy(self) -> Lanes:
        other = Lanes()
        other._starts = {k: v.copy() for k, v in self._starts.items()}
        other._ends = {k: v.copy() for k, v in self._ends.items()}
        return other

    def place(self, lane: str, ready: float, busy: float) -> float:
        """Occupy ``lane`` for ``busy`` seconds from the earliest time ≥ ``ready``;
        return when it ends."""
        if busy <= 0:
            return ready
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

    def run(self, chain: list[Stage], ready: float) -> float:
        """Schedule a chain's stages in order from ``ready``; return when it finishes."""
        t = ready
        for stage in chain:
            t = self.place(stage.lane, t, stage.busy) + stage.wait
        return t

    def busy_until(self, lane: str) -> float:
        """When the lane's last occupied stretch ends (0 if never used)."""
        starts = self._starts.get(lane)
        return starts[-1] if starts else 0.0


def _codec_stages(cost: CostModel, topology: str, algo: str, x: float, world: int) -> list[Stage]:
    """One compressed partition of ``x`` elements among ``world`` nodes."""
    g = cost.gpus
    n = world
    share = (n - 1) / n

    def enc(v: float) -> float:
        return cost.encode(algo, v / g)

    def dec(v: float) -> float:
        return cost.decode(algo, v / g)

    def nbytes(v: float) -> float:
        return g * cost.nbytes(algo, v / g)

    if topology == "ps":
        # The aggregator's link carries N-1 payloads; this rank's lane carries its 1/N
        # share of all the aggregators' bytes, and waits for the rest.
        wire, latency = cost.wire((n - 1) * nbytes(x))
        net = Stage("net", wire / n, wire - wire / n + latency)
        agg = (n - 1) * dec(x) + enc(x)
        return [Stage("compute", enc(x) * share, enc(x) / n), net,
                Stage("compute", agg / n, agg - agg / n), net,
                Stage("compute", dec(x))]  # the decode also averages
    if topology == "ring":
        c = x / n
        hop = Stage("net", *cost.wire(nbytes(c)))
        out = [Stage("compute", enc(c))]
        for _ in range(n - 1):
            out += [hop, Stage("compute", dec(c) + enc(c))]
        out += [hop for _ in range(n - 1)]
        return out + [Stage("compute", n * dec(c))]  # the decodes also average
    if topology == "allgather":
        return [Stage("compute", enc(x)), Stage("net", *cost.wire((n - 1) * nbytes(x))),
                Stage("compute", n * dec(x))]  # the last decode also averages
    raise ValueError(f"no compressed chain for topology {topology!r}")


def chains(cost: CostModel, plan: Plan, numel: int, world: int,
           engine: bool = True) -> list[list[Stage]]:
    """The stage chains of one tensor (or bucket) synchronized under ``plan``: one per
    partition, and before them one-stage chains of CPU work spent alongside (the
    engine's per-graph cost, a collective's share of the cores), all ready together.

    Args:
        cost: the cost model.
        plan: topology, algorithm and partitions K.
        numel: elements of the tensor.
        world: nodes taking part (``cost.gpus`` workers each).
        engine: add CaSync's own cost per partition sub-graph (``graph/TOPOLOGY``); off for
            baselines that do not run through the engine.

    Example:
        >>> cluster = CostModel.cluster(4, 1, 25e9)   # on paper: no per-graph cost
        >>> len(chains(cluster, Plan("ring", "onebit", 2), 1 << 20, 4))
        2
    """
    k = max(1, min(plan.partitions, numel))
    out, beside = [], []
    for i in range(k):
        x = numel // k + (1 if i < numel % k else 0)
        inner = [Stage("intra", cost.intra(4 * x))] if cost.gpus > 1 else []
        post = list(inner)
        if world > 1 and plan.topology == "none":
            # A collective runs alone on its group and its measured time already holds
            # its own CPU work, so it stays whole on the link, one after another; the
            # share of the cores it takes meanwhile is charged beside it. (With several
            # GPUs the node's shards cross its one link together.)
            busy = cost.allreduce(x, world)
            out.append(inner + [Stage("net", busy),
                                Stage("compute", cost.merge(x / cost.gpus))] + post)
            beside.append([Stage("compute", (1 - _overlap(cost)) * busy)])
            continue
        if world > 1:
            assert plan.algorithm is not None
            inner += _codec_stages(cost, plan.topology, plan.algorithm, x, world)
        out.append(on_host(cost, inner + post))
    overhead = cost.costs.get(f"graph/{plan.topology}")
    if engine and overhead is not None:
        # The engine's own cost of running a graph (tasks, dispatch, messages), measured
        # on one-partition graphs: each partition is such a sub-graph of its own. It is
        # spent on the cores while the sub-graph runs, as its tasks become ready, so it
        # occupies the compute lane beside the chain rather than before it.
        beside += [[Stage("compute", overhead.a)] for _ in out]
    return beside + out


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
            ready: float, engine: bool = True) -> float:
    """Schedule a tensor's chains on ``lanes`` from ``ready``; return when its last
    partition finishes."""
    return max((lanes.run(chain, ready)
                for chain in chains(cost, plan, numel, world, engine)), default=ready)
