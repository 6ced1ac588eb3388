"""Chunks: a step's tensors coalesced into a few units of work.

The engine pays per step, not per tensor. Each submitted tensor is cut into *segments*
(the plan's partitions, and pieces of at most ``chunk_elems``), and consecutive
segments with the same plan fill a *chunk* until it holds ``chunk_elems`` elements.
A chunk is one task graph: every segment keeps its own payload (its scales, residual
and RNG site), but the payloads of one chunk bound for one peer travel as one message,
and each encode or decode of a chunk is one batched kernel call. So the number of
messages in a step grows with the world size and the number of chunks, never with the
number of tensors.

Every rank submits the same tensors in the same order and plans them alike, so every
rank forms the same chunks and the same aggregator for each segment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hipress_base.errors import ConfigError

from .devices import numel
from .plan import OWNED, SCATTER, Plan
from .primitives import partition

__all__ = ["Entry", "Segment", "Chunk", "Chunker", "CHUNK_ELEMS", "RING_PIECE"]

#: Elements a chunk collects before it is sent (64 MiB of float32): large enough that a
#: chunk's fixed costs (its messages, its tasks' hand-offs between the engine's threads)
#: vanish against its codec work, small enough that a model's step pipelines over at
#: least two chunks (docs/benchmarks.md, "Measurements behind the code").
CHUNK_ELEMS = 16 << 20
#: Plans whose routes a chunker keeps at most (a model's planner has a few; one that
#: makes a new plan object per call must not grow the cache without bound).
_ROUTES = 4096
#: A ring cuts a tensor into up to N pieces of at least this many elements, one per run,
#: so that a chunk of one large tensor still spreads over every hop.
RING_PIECE = 65536


class Entry:
    """A submitted tensor: its float32 values, how to give them back, its completion.

    A plain class with slots: one is made per tensor per step, and a dataclass's
    generated ``__init__`` and a computed ``numel`` were a visible share of a submit.

    Attributes:
        buf: the flat float32 values: a NumPy array (host), or a tensor on the
            gradient's GPU.
        future: the ``casync.staging.Completion`` it counts towards (None in tests and
            the simulator).
        pending: segments not yet synchronized (set where the chunker cuts it, counted
            down by ``segment_done``).
        ptr: the address of ``buf`` (the batched kernels take addresses).
        memory: where ``buf`` lives (a ``casync.devices.Memory``); None: the host.
        ready: a CUDA event after the gradient was produced (and upcast): the engine's
            stream waits for it before reading ``buf``.
        numel: the elements of ``buf``.
        device: the device of ``buf`` ("cpu" for the host), as chunks are keyed.
    """

    __slots__ = ("name", "tensor", "buf", "write_back", "future", "pending", "ptr",
                 "memory", "ready", "numel", "device")

    def __init__(self, name: str, tensor: Any, buf: Any, *, write_back: bool = False,
                 future: Any = None, ptr: int = 0, memory: Any = None, ready: Any = None
                 ) -> None:
        self.name = name
        self.tensor = tensor
        self.buf = buf
        self.write_back = write_back
        self.future = future
        self.pending = 0
        self.ptr = ptr
        self.memory = memory
        self.ready = ready
        if memory is None:  # the host's buffers are NumPy arrays
            self.numel = buf.size
            self.device = "cpu"
        else:
            self.numel = numel(buf)
            self.device = str(memory.device)

    def segment_done(self) -> bool:
        """One of its segments is synchronized; True when that was the last. Callers hold
        the engine's completion lock: a tensor's segments finish on several threads."""
        self.pending -= 1
        return self.pending == 0


class Segment:
    """Elements ``[lo, hi)`` of a tensor: one payload, one residual, one RNG site.

    Not changed once made (a slots class rather than a frozen dataclass, whose
    ``__init__`` cost twice as much, for every tensor of every step).

    Attributes:
        entry: its ``Entry`` (the simulator's tensors stand in for them).
        owner: the rank that reduces it (``ps``'s aggregator, the end of a ring's
            reduce-scatter).
    """

    __slots__ = ("entry", "lo", "hi", "owner")

    def __init__(self, entry: Any, lo: int, hi: int, owner: int = 0) -> None:
        self.entry = entry
        self.lo = lo
        self.hi = hi
        self.owner = owner

    def __repr__(self) -> str:
        return (f"Segment({getattr(self.entry, 'name', self.entry)!r}, {self.lo}, {self.hi}, "
                f"owner={self.owner})")

    @property
    def n(self) -> int:
        return self.hi - self.lo

    @property
    def key(self) -> tuple[str, int, int]:
        """What names this segment across steps (error feedback keys its residuals so)."""
        return (self.entry.name, self.lo, self.hi)

    def view(self) -> Any:
        return self.entry.buf[self.lo:self.hi]

    @property
    def ptr(self) -> int:
        return int(self.entry.ptr) + 4 * self.lo

    def piece(self, lo: int, hi: int) -> Segment:
        """Elements ``[lo, hi)`` of this segment (offsets into it), as a segment."""
        return Segment(self.entry, self.lo + lo, self.lo + hi, self.owner)


@dataclass(eq=False)
class Chunk:
    """Segments with one plan and one device, synchronized by one graph."""

    plan: Plan
    segments: list[Segment] = field(default_factory=list)
    numel: int = 0
    #: its place among the step's chunks
    seq: int = 0
    #: the device of its tensors' buffers (``Entry.device``)
    device: str = "cpu"

    @property
    def label(self) -> str:
        """Names its tensors and its place in the step, for errors and traces."""
        names = list(dict.fromkeys(s.entry.name for s in self.segments))
        first, last = repr(names[0]) if names else "", repr(names[-1]) if names else ""
        if len(names) == 1:
            return f"tensor {first} (chunk {self.seq})"
        if len(names) == 2:
            return f"tensors {first}, {last} (chunk {self.seq})"
        return f"tensors {first} .. {last} ({len(names)} tensors, chunk {self.seq})"

    @property
    def key(self) -> tuple[Any, ...]:
        """The same for the same chunk in every step (scratch buffers are kept by it)."""
        first = self.segments[0].key if self.segments else ()
        return (self.plan.topology, first, self.device)

    def runs(self, world: int) -> list[list[Segment]]:
        """A ring's runs: run c holds the segments whose owner ends the reduce-scatter
        with it, rank (c - 1) mod N. A segment's run follows its owner, not the chunk's
        other tensors, so it is the same whatever else shares the chunk."""
        out: list[list[Segment]] = [[] for _ in range(world)]
        for seg in self.segments:
            out[(seg.owner + 1) % world].append(seg)
        return out


class Chunker:
    """Forms a step's chunks as tensors arrive; the same on every rank.

    Args:
        world: ranks in the group (aggregators for ``ps``).
        chunk_elems: elements a chunk collects before it is closed.
        coalesce: off, every segment is a chunk of its own (how per-tensor engines such as
            BytePS synchronize; the simulator models them so).
        fuse_raw: with ``coalesce`` off, uncompressed tensors still share chunks (how
            Horovod-based engines fuse them; the simulator's ring-DGC).
    """

    def __init__(self, world: int, chunk_elems: int = CHUNK_ELEMS,
                 coalesce: bool = True, fuse_raw: bool = False) -> None:
        self.world = world
        self.chunk_elems = int(chunk_elems)
        self.coalesce = coalesce
        self._alone = (not coalesce, not coalesce and not fuse_raw)  # compressed, raw
        #: open chunks by (id of their plan, device); the plans are ``_same``'s, whose
        #: identity stands for their value, so no plan is hashed per tensor
        self._open: dict[tuple[int, str], Chunk] = {}
        #: id(plan) -> (plan, its chunk's plan (any K), whether it compresses, has owners,
        #: is a ring); the plan is kept so that its id is not reused while it is here
        self._routes: dict[int, tuple[Plan, Plan, bool, bool, bool]] = {}
        #: one object per chunk plan: plans of several K that share chunks share it
        self._same: dict[Plan, Plan] = {}
        #: each segment's owner, chosen when it is first seen and kept: the same
        #: aggregator every step, whatever order later steps submit in
        self.owners: dict[tuple[str, int, int], int] = {}
        self._load = [0] * world
        self._segments = 0
        self._chunks = 0

    def add(self, entry: Any, plan: Plan) -> list[Chunk]:
        """Cut ``entry`` (an ``Entry``, or anything with its ``name``, ``numel``,
        ``device`` and ``pending``, as the simulator's tensors) into segments under
        ``plan``; returns the chunks this closed."""
        return self.add_many((entry,), (plan,))

    def add_many(self, entries: Iterable[Any], plans: Iterable[Plan]) -> list[Chunk]:
        """``add`` for each entry and its plan in turn, in one call: the chunks they
        closed, in order. A step hands over its tensors in batches (a DDP bucket, a
        step's gradients), and this loop is what a batch costs per tensor."""
        closed: list[Chunk] = []
        routes, opened, limit = self._routes, self._open, self.chunk_elems
        for entry, plan in zip(entries, plans, strict=True):
            route = routes.get(id(plan)) or self._route(plan)
            _, same, compress, owned, ring = route
            alone = self._alone[0 if compress else 1]
            n = entry.numel
            if owned and same.topology == SCATTER:
                closed += self._add_shards(entry, plan, same)
                continue
            k = plan.partitions_for(n) if compress else 1
            if n > k * limit:
                k = -(-n // limit)
            if ring and self.coalesce:  # a per-tensor engine runs one ring a partition
                k = max(k, min(self.world, n // RING_PIECE))
            device = entry.device  # a chunk's tensors share a device
            key = (id(same), device)
            entry.pending = k
            chunk = opened.get(key)
            if k == 1:  # most tensors: one segment, without the loop below
                if chunk is None:
                    chunk = opened[key] = Chunk(same, device=device)
                chunk.segments.append(Segment(entry, 0, n, self._owner((entry.name, 0, n), n)
                                              if owned else 0))
                chunk.numel += n
                if chunk.numel >= limit or alone:
                    closed.append(self._close(key))
                continue
            for sl in partition(n, k):
                lo, hi = sl.start, sl.stop
                if chunk is None:
                    chunk = opened[key] = Chunk(same, device=device)
                owner = self._owner((entry.name, lo, hi), hi - lo) if owned else 0
                chunk.segments.append(Segment(entry, lo, hi, owner))
                chunk.numel += hi - lo
                if chunk.numel >= limit or alone:
                    closed.append(self._close(key))
                    chunk = None
        return closed

    def _add_shards(self, entry: Any, plan: Plan, same: Plan) -> list[Chunk]:
        """A reduce-scatter's tensor: shard j (of ``world`` equal shards) is owned by rank
        j, each shard cut into pieces as a tensor of its size would be."""
        n, world = entry.numel, self.world
        if n % world:
            raise ConfigError(f"a reduce-scatter of {entry.name!r} needs a length that "
                              f"divides into {world} shards, not {n}")
        shard = n // world
        pieces = [(owner, owner * shard + sl.start, owner * shard + sl.stop)
                  for owner in range(world) if shard
                  for sl in partition(shard, max(plan.partitions_for(shard),
                                                 -(-shard // self.chunk_elems)))]
        pieces = pieces or [(0, 0, 0)]  # an empty tensor still completes
        entry.pending = len(pieces)
        closed = []
        key = (id(same), entry.device)
        for owner, lo, hi in pieces:
            chunk = self._open.get(key)
            if chunk is None:
                chunk = self._open[key] = Chunk(same, device=entry.device)
            chunk.segments.append(Segment(entry, lo, hi, owner))
            chunk.numel += hi - lo
            if chunk.numel >= self.chunk_elems or not self.coalesce:
                closed.append(self._close(key))
        return closed

    def _route(self, plan: Plan) -> tuple[Plan, Plan, bool, bool, bool]:
        """What ``add`` needs of ``plan``, worked out once per plan: chunks mix any K."""
        if len(self._routes) >= _ROUTES:  # a planner that makes a new plan per call
            self._routes.clear()
        topology = plan.topology
        chunk_plan = Plan(topology, plan.algorithm, 1, plan.params)
        same = self._same.setdefault(chunk_plan, chunk_plan)
        route = self._routes[id(plan)] = (plan, same, plan.compress,
                                          topology in OWNED, topology == "ring")
        return route

    def flush(self) -> list[Chunk]:
        """Close every open chunk, in the order they were opened."""
        return [self._close(key) for key in list(self._open)]

    def end_step(self) -> None:
        self._load = [0] * self.world
        self._segments = 0
        self._chunks = 0

    def _close(self, key: tuple[int, str]) -> Chunk:
        chunk = self._open.pop(key)
        chunk.seq = self._chunks
        self._chunks += 1
        return chunk

    def _owner(self, key: tuple[str, int, int], n: int) -> int:
        """A segment's owner: on first sight the least-loaded rank of the step so far,
        ties rotating with the segment's place in the step; then the same one every
        step, so an aggregator's residual is applied at its next re-encode even when the
        order changes (DDP rebuilds its buckets after its first step)."""
        start = self._segments % self.world
        self._segments += 1
        load = self._load
        rank = self.owners.get(key, -1)
        if rank < 0:
            rank = start
            for step in range(1, self.world):  # the first least loaded, counting from start
                r = (start + step) % self.world
                if load[r] < load[rank]:
                    rank = r
            self.owners[key] = rank
        load[rank] += n
        return rank
