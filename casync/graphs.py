"""Graph builders: compose the primitives into one task DAG per chunk.

A chunk (``casync.chunks``) holds segments of several tensors; every builder leaves the
average over ranks in each segment's elements. Each segment keeps its own payload, but a
message carries all of a chunk's payloads for one peer, end to end, and each encode or
decode task is one batched kernel call over its segments. Every rank decodes the same
payload bytes for the final values, so the result is bitwise identical on all ranks.

A message is the payloads' total length (8 bytes) and the payloads: a receiver posts a
buffer of the worst case and reads how much arrived from the front. A chunk's buffers
live on its tensors' device and its messages travel by that device's link
(``casync.devices``: host memory over Gloo, or CUDA memory staged through pinned host
buffers).

Priorities are ``(stage, index)``; a message's sender only depends on tasks of a lower
stage than the receive that waits for it (see ``casync.executor``).
"""

from __future__ import annotations

import ctypes
import zlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compll import Codec
from compll.constants import FEEDBACK
from compll.loaders import DECODE_ITEM, ENCODE_ITEM
from hipress.errors import PayloadError

from .chunks import Chunk, Segment
from .devices import LENGTH, HostMemory, Link, Memory, Message, framed_payloads, numel
from .executor import Graph, Task
from .feedback import ErrorFeedback
from .transport import Handle, Transport, tag_space

__all__ = ["Context", "BUILDERS", "slots", "build_ps", "build_ring", "build_allgather",
           "build_none"]

_LENGTH = LENGTH
#: Elements up to which an uncompressed chunk's average runs on the thread that saw its
#: allreduce finish (``casync.executor``'s inline lane): so little copying that a
#: hand-off to the compute thread and back would cost a sizeable share of it.
INLINE_AVERAGE = 1 << 20


@dataclass
class _Rows:
    """The rows of one batched call, with what fills them each step."""

    keys: tuple[tuple[str, int, int], ...]
    version: int
    items: np.ndarray
    offsets: np.ndarray
    cap: int
    sites: np.ndarray


@dataclass
class Context:
    """What a builder needs besides the chunk: who we are and what to compress with."""

    transport: Transport
    codec: Codec | None
    feedback: ErrorFeedback | None
    step: int
    tag: int
    chunk: Chunk
    pool: dict[Hashable, Any] = field(default_factory=dict)
    #: the rows of batched calls, kept across steps (``_rows``)
    rows: dict[Hashable, _Rows] = field(default_factory=dict)
    #: how the chunk's messages travel, and the memory its buffers live in
    link: Link | None = None

    def __post_init__(self) -> None:
        if self.link is None:
            self.link = Link(HostMemory(), self.transport)

    @property
    def memory(self) -> Memory:
        assert self.link is not None
        return self.link.memory

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world(self) -> int:
        return self.transport.size

    def tag_of(self, slot: int) -> int:
        return (self.tag + slot) % tag_space

    def rng_step(self, seg: Segment, role: str) -> int:
        """A distinct RNG step per step, rank and encode site, so ranks round independently
        (the same as ``encode`` computes for its rows)."""
        site = zlib.crc32(repr((seg.key, role)).encode())
        mix = (self.step * 0x9E3779B1 + self.rank * 0x85EBCA77) & 0xFFFFFFFF
        return (site * 0xC2B2AE3D + mix) & 0xFFFFFFFF

    def scratch(self, site: Hashable, size: int, dtype: type, host: bool = False) -> Any:
        """A buffer that belongs to this chunk and site across steps (pages stay mapped),
        on the chunk's memory, or with ``host`` in host memory that copies to and from
        it fast (pinned, for CUDA).

        Reuse is safe: a step's sends and receives complete before the next step starts.
        """
        memory = self.memory
        key = (self.chunk.key, site, np.dtype(dtype).str, "host" if host else memory.device)
        buf = self.pool.get(key)
        if buf is None or len(buf) < size:
            new = memory.host_empty if host or isinstance(memory, HostMemory) else memory.empty
            buf = self.pool[key] = new(max(size, 1), dtype)
        return buf[:size]

    def capacity(self, segs: list[Segment]) -> int:
        assert self.codec is not None
        return _LENGTH + sum(self.codec.max_payload_bytes(s.n) for s in segs)

    def residuals(self, segs: list[Segment], role: str) -> list[Any] | None:
        if self.feedback is None:
            return None
        return [self.feedback.site((*s.key, role), s.n, self.memory) for s in segs]

    def _rows(self, kind: str, site: Hashable, segs: list[Segment],
              role: str | None) -> _Rows:
        """The rows of a batched call at ``site``, kept across steps: what does not change
        while the site's segments stay the same (counts, capacities, residual addresses,
        RNG sites) is filled once."""
        keys = tuple(s.key for s in segs)
        version = self.feedback.version if self.feedback is not None else -1
        cache_key = (self.chunk.key, kind, site)
        rows = self.rows.get(cache_key)
        if rows is not None and rows.keys == keys and rows.version == version:
            return rows
        assert self.codec is not None
        res = self.residuals(segs, role) if kind == "encode" and role is not None else None
        items = np.zeros(len(segs), ENCODE_ITEM if kind == "encode" else DECODE_ITEM)
        caps = np.array([self.codec.max_payload_bytes(s.n) for s in segs], np.uint64)
        items["n"] = [s.n for s in segs]
        if res is not None:
            items["r"] = [self.memory.ptr(r) for r in res]
            # the CPU kernels defer the update (feedback.py)
            if isinstance(self.memory, HostMemory) and self.codec.defers_feedback():
                assert self.feedback is not None and role is not None
                kept = [self.feedback.kept((*s.key, role), self.codec, int(cap))
                        for s, cap in zip(segs, caps, strict=True)]
                items["keep"] = [k.ctypes.data for k in kept]
        offsets = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.uint64) \
            if len(segs) else np.zeros(0, np.uint64)
        if kind == "encode":
            items["cap"] = caps
        sites = np.array([zlib.crc32(repr((s.key, role)).encode()) for s in segs]
                         if kind == "encode" else [], np.uint64)
        version = self.feedback.version if self.feedback is not None else -1  # kept() may bump it
        rows = self.rows[cache_key] = _Rows(keys, version, items, offsets, int(caps.sum()),
                                            sites)
        return rows

    def encode(self, segs: list[Segment], role: str, site: Hashable,
               merge: Message | None = None, merge_site: Hashable = None) -> Message:
        """One message: the payloads of ``segs`` behind their length; with error feedback,
        of each segment plus the role's residual, which the same call updates.

        With ``merge`` (a received message for ``segs``), first add what it decodes to into
        the segments, as ``decode`` with ``accumulate`` does: an aggregator's last merge
        and its re-encode. The CPU kernels do both in one pass over the values
        (``hp_merge_encode_batch``), with the same float operations in the same order as
        the two calls, so the bytes are the same; the CUDA kernels run the two batched
        calls behind the same entry point, the reference target the two codec calls."""
        codec = self.codec
        assert codec is not None
        if merge is not None and (codec.target == "ref" or not segs):
            self.decode(merge, segs, True, None, merge_site)  # no segments: checks it is empty
            merge = None
        if codec.target == "ref":
            return self._encode_arrays(segs, role, site)
        payload = None
        if merge is not None:
            assert self.link is not None
            with self.memory.active():
                payload = self.link.payloads(
                    merge, lambda size: self.scratch(("unstaged", merge_site), size, np.uint8))
        with self.memory.active():  # new residuals are zeroed on the engine's stream
            rows = self._rows("encode", site, segs, role)
        out = self.scratch(("payload", site), _LENGTH + rows.cap, np.uint8)
        items = rows.items
        if len(segs):
            items["g"] = [s.ptr for s in segs]
            items["out"] = rows.offsets + np.uint64(self.memory.ptr(out) + _LENGTH)
            # A distinct RNG step per step, rank and encode site: ranks round independently.
            mix = np.uint64((self.step * 0x9E3779B1 + self.rank * 0x85EBCA77) & 0xFFFFFFFF)
            items["step"] = (rows.sites * np.uint64(0xC2B2AE3D) + mix) & np.uint64(0xFFFFFFFF)
            items["flags"] = FEEDBACK if self.feedback is not None else 0
        assert self.link is not None
        with self.memory.active():
            total = codec.encode_items(items, out, merge=payload) if len(segs) else 0
            return self.link.outgoing(
                out, total, lambda size: self.scratch(("staged", site), size, np.uint8, True))

    def decode(self, message: Message, segs: list[Segment], accumulate: bool,
               scale: float | None, site: Hashable = None) -> None:
        """Decode a message into ``segs`` (or add to them); ``scale`` turns a sum into the
        mean."""
        codec = self.codec
        assert codec is not None and self.link is not None
        with self.memory.active():
            payload = self.link.payloads(
                message, lambda size: self.scratch(("unstaged", site), size, np.uint8))
        size = numel(payload)
        if codec.target == "ref":
            self._decode_arrays(payload, segs, accumulate, scale)
            return
        if not segs:
            if size:
                raise PayloadError(f"{size} bytes for no segments")
            return
        rows = self._rows("decode", site, segs, None)
        items = rows.items
        items["out"] = [s.ptr for s in segs]
        items["p"][0] = self.memory.ptr(payload)
        items["size"][0] = size
        with self.memory.active():
            codec.decode_items(items, accumulate, 1.0 if scale is None else scale,
                               cuda=self.memory.cuda,
                               scale_sum=accumulate and scale is not None)

    def _encode_arrays(self, segs: list[Segment], role: str, site: Hashable) -> Message:
        """``encode`` through the codec's array interface (the reference target, on the
        host only)."""
        assert self.codec is not None
        if not isinstance(self.memory, HostMemory):
            raise PayloadError("the reference codec (target='ref') runs on host memory only")
        out = self.scratch(("payload", site), self.capacity(segs), np.uint8)
        res = self.residuals(segs, role)
        payload, _ = self.codec.encode_batch(
            [s.view() for s in segs], out=out[_LENGTH:],
            steps=[self.rng_step(s, role) for s in segs], residuals=res,
            feedback=res is not None)
        out[:_LENGTH].view(np.uint64)[0] = payload.size
        return Message(out[:_LENGTH + payload.size], out[_LENGTH:_LENGTH + payload.size])

    def _decode_arrays(self, payload: np.ndarray, segs: list[Segment], accumulate: bool,
                       scale: float | None) -> None:
        assert self.codec is not None
        views = [s.view() for s in segs]
        ns = [s.n for s in segs]
        if accumulate and scale is not None:  # the mean of the whole sum
            self.codec.decode_batch(payload, ns, views, accumulate=True)
            for v in views:
                np.multiply(v, np.float32(scale), out=v)
        else:  # one pass: the decoded values, scaled
            self.codec.decode_batch(payload, ns, views, accumulate=accumulate,
                                    scale=1.0 if scale is None else scale)


def slots(topology: str, world: int) -> int:
    """Tags one chunk's graph uses."""
    return {"ps": 2, "ring": 2 * max(world - 1, 1), "allgather": 1, "none": 1}[topology]


Got = Callable[[], Message]


def _encode(graph: Graph, ctx: Context, name: str, prio: tuple[int, int],
            segs: list[Segment], role: str, deps: tuple[Task | None, ...] = (),
            merge: tuple[str, Got] | None = None) -> tuple[Task, Got]:
    """An encode task and a getter for the message it produces; with ``merge`` (a site
    and a received message), the task first adds that message into ``segs``
    (``Context.encode``)."""
    box: list[Message] = []

    def run() -> None:
        if merge is None:
            box.append(ctx.encode(segs, role, name))
        else:
            box.append(ctx.encode(segs, role, name, merge[1](), merge[0]))

    return graph.task(name, "compute", prio, run, deps), lambda: box[-1]


@dataclass
class _Out:
    """A send of a stage: the message of an encode (or a received one), to ``dst``."""

    name: str
    prio: tuple[int, int]
    message: Got
    dst: int
    deps: tuple[Task | None, ...]


@dataclass
class _In:
    """A receive of a stage: the message for ``segs`` from ``src``."""

    name: str
    prio: tuple[int, int]
    segs: list[Segment]
    src: int


def _messages(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], tag: int,
              outs: list[_Out], ins: list[_In]) -> tuple[list[Task], list[tuple[Task, Got]]]:
    """Post one stage's messages: the tasks after which each send has been posted, and
    for each receive the task after which its message is here, with a getter for it.

    On host-wire links every send and every receive is a p2p task of its own (receives
    have no inputs: they are posted as soon as the graph is added). On the nccl link the
    stage is one batch (``_exchange``)."""
    assert ctx.link is not None
    if ctx.link.device_wire:
        return _exchange(graph, ctx, name, prio, tag, outs, ins)
    sends = [graph.task(o.name, "p2p", o.prio, _poster(ctx, o, tag), o.deps) for o in outs]
    return sends, [_recv(graph, ctx, i, tag) for i in ins]


def _poster(ctx: Context, out: _Out, tag: int) -> Callable[[], Handle]:
    return lambda: ctx.transport.isend(out.message().wire, out.dst, tag)


def _capacity(ctx: Context, segs: list[Segment], name: str) -> int:
    """The worst-case bytes of a message for ``segs``: what a receiver posts."""
    assert ctx.codec is not None
    if ctx.codec.target == "ref":
        return ctx.capacity(segs)
    return _LENGTH + ctx._rows("recv", name, segs, None).cap


def _recv(graph: Graph, ctx: Context, spec: _In, tag: int) -> tuple[Task, Got]:
    """A receive into host memory (pinned when the chunk is on a GPU), posted as soon as
    the graph is added; its task completes when the message is here."""
    capacity = _capacity(ctx, spec.segs, spec.name)
    buffer = ctx.scratch(("recv", spec.name), capacity, np.uint8, True)
    box: list[Message] = []

    def message() -> Message:
        """The message that arrived: its length and payloads, no more (what a ring
        forwards); its payloads are moved to the chunk's memory once, on first use."""
        if not box:
            assert task.handle is not None
            buf = task.handle.buffer
            box.append(Message(buf[:_LENGTH + framed_payloads(buf).size]))
        return box[0]

    # Posted by the executor's p2p thread, as sends are: a Gloo receive's post waits on
    # the same pair lock, which would stall the building (submitting) thread.
    task = graph.task(spec.name, "p2p", spec.prio,
                      lambda: ctx.transport.irecv(capacity, spec.src, tag, buffer))
    return task, message


def _exchange(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], tag: int,
              outs: list[_Out], ins: list[_In]) -> tuple[list[Task], list[tuple[Task, Got]]]:
    """A stage as one batch of sends and receives on device memory, posted in the link's
    order (its number is taken now, as graphs are built in the same order on every rank)
    once the messages it sends exist; it completes when all of them have."""
    assert ctx.link is not None and ctx.link.sequencer is not None
    if not outs and not ins:
        return [], []
    sequencer = ctx.link.sequencer
    number = sequencer.number()
    buffers = [ctx.scratch(("recv", i.name), _capacity(ctx, i.segs, i.name), np.uint8)
               for i in ins]

    def run() -> Handle:
        sends = [(o.message().wire, o.dst) for o in outs]
        recvs = [(b, i.src) for b, i in zip(buffers, ins, strict=True)]
        peer = (outs[0].dst if outs else ins[0].src) if len(outs) + len(ins) == 1 else -1

        def post() -> Any:
            with ctx.memory.active():  # NCCL takes the current device (per thread)
                return ctx.transport.exchange(sends, recvs, tag)

        return sequencer.post(number, post, Handle(None, peer, "exchange", None))

    task = graph.task(name, "post", prio, run, tuple(d for o in outs for d in o.deps))
    return [task] * len(outs), [(task, _constant(Message(b))) for b in buffers]


def _constant(message: Message) -> Got:
    return lambda: message


def _decode(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], message: Got,
            segs: list[Segment], accumulate: bool, scale: float | None,
            deps: tuple[Task | None, ...]) -> Task:
    def run() -> None:
        ctx.decode(message(), segs, accumulate, scale, name)

    return graph.task(name, "compute", prio, run, deps)


def build_ps(ctx: Context, graph: Graph) -> None:
    """Parameter server with co-located aggregators: each segment is reduced on its owner.

    Per chunk, a worker sends one message to each aggregator (the payloads of the
    segments it owns) and receives one reply; an aggregator merges the workers' messages
    in rank order, re-encodes once and sends the same bytes to every rank. Two stages:
    the uploads, then the replies.
    """
    assert ctx.codec is not None
    rank, world = ctx.rank, ctx.world
    mean = 1.0 / world
    owned = [[s for s in ctx.chunk.segments if s.owner == agg] for agg in range(world)]
    mine = owned[rank]
    aggs = [agg for agg in range(world) if agg != rank and owned[agg]]
    uploads = []
    for agg in aggs:
        t_up, upload = _encode(graph, ctx, f"to{agg}/encode", (0, agg), owned[agg], "worker")
        uploads.append(_Out(f"to{agg}/send", (1, agg), upload, agg, (t_up,)))
    workers = [src for src in range(world) if src != rank] if mine else []
    sent, got = _messages(graph, ctx, "up", (1, 0), ctx.tag_of(0), uploads,
                          [_In(f"agg/recv{src}", (1, src), mine, src) for src in workers])
    replies: list[_Out] = []
    total: Got | None = None
    t_enc: Task | None = None
    if mine:
        # The aggregator merges into its own values as they are (no encode round trip);
        # they are read nowhere else, and the final decode overwrites them. The last
        # merge is part of the re-encode (one pass over the values); the earlier ones
        # run as their messages arrive.
        t_prev: Task | None = None
        for src, (t_recv, theirs) in zip(workers[:-1], got[:-1], strict=True):
            t_prev = _decode(graph, ctx, f"agg/merge{src}", (2, src), theirs, mine, True,
                             None, (t_prev, t_recv))
        if workers:
            t_recv, theirs = got[-1]
            t_enc, total = _encode(graph, ctx, "agg/encode", (2, world), mine, "aggregator",
                                   (t_prev, t_recv), (f"agg/merge{workers[-1]}", theirs))
        else:  # a group of one
            t_enc, total = _encode(graph, ctx, "agg/encode", (2, world), mine, "aggregator")
        replies = [_Out(f"agg/send{dst}", (3, dst), total, dst, (t_enc,)) for dst in workers]
    _, back = _messages(graph, ctx, "down", (3, 0), ctx.tag_of(1), replies,
                        [_In(f"from{agg}/recv", (3, agg), owned[agg], agg) for agg in aggs])
    for agg, t_send, (t_recv, reply) in zip(aggs, sent, back, strict=True):
        # After the send: the encode has read these values before they are overwritten.
        _decode(graph, ctx, f"from{agg}/decode", (4, agg), reply, owned[agg], False, mean,
                (t_recv, t_send))
    if total is not None:
        _decode(graph, ctx, "agg/decode", (4, world), total, mine, False, mean, (t_enc,))


def build_ring(ctx: Context, graph: Graph) -> None:
    """Compressed ring: reduce-scatter re-encoding at each hop, then forward as is.

    The chunk's segments are grouped into N runs by their owners (``Chunk.runs``). At
    reduce-scatter hop h, rank r receives run (r-h-1) mod N from its left, adds its own
    values and re-encodes; after N-1 hops it owns run (r+1) mod N. The allgather forwards
    the owners' messages unchanged, so every rank decodes the same bytes. Each of the
    2(N-1) hops is a stage: one send to the right, one receive from the left.
    """
    assert ctx.codec is not None
    rank, world = ctx.rank, ctx.world
    left, right = (rank - 1) % world, (rank + 1) % world
    mean = 1.0 / world
    runs = ctx.chunk.runs(world)
    t_last, message = _encode(graph, ctx, "rs-encode", (0, 0), runs[rank], "worker")
    send = _Out("rs-send0", (1, 0), message, right, (t_last,))
    for h in range(world - 1):
        c = (rank - h - 1) % world
        _, [(t_recv, incoming)] = _messages(
            graph, ctx, f"rs-hop{h}", (2 * h + 1, 0), ctx.tag_of(h), [send],
            [_In(f"rs-recv{h}", (2 * h + 1, 0), runs[c], left)])
        # Run c is read at this hop only; merge into it (final decodes overwrite it) in
        # the re-encode's call.
        owner = h == world - 2
        t_last, message = _encode(graph, ctx, f"rs-encode{h}", (2 * h + 2, 1), runs[c],
                                  "owner" if owner else "hop", (t_last, t_recv),
                                  (f"rs-merge{h}", incoming))
        name = f"rs-send{h + 1}" if not owner else "ag-send0"
        send = _Out(name, (2 * h + 3, 0), message, right, (t_last,))
    # Our own reduced run: decode the bytes every other rank decodes.
    own = (rank + 1) % world
    _decode(graph, ctx, f"decode{own}", (2 * world, 0), message, runs[own], False, mean,
            (t_last,))
    for g in range(world - 1):
        c = (rank - g) % world
        stage = 2 * world + 2 * g + 1
        _, [(t_recv, final)] = _messages(
            graph, ctx, f"ag-hop{g}", (stage, 0), ctx.tag_of(world - 1 + g),
            [send] if send is not None else [],
            [_In(f"ag-recv{g}", (stage, 0), runs[c], left)])
        send = _Out(f"ag-send{g + 1}", (stage + 1, 0), final, right, (t_recv,))
        # t_last ends the reduce-scatter, after every read of this rank's values.
        _decode(graph, ctx, f"decode{c}", (stage + 1, 1), final, runs[c], False, mean,
                (t_recv, t_last))


def build_allgather(ctx: Context, graph: Graph) -> None:
    """Every rank encodes the chunk, the message goes to every rank, each decodes and
    sums in rank order. One stage."""
    assert ctx.codec is not None
    rank, world = ctx.rank, ctx.world
    segs = ctx.chunk.segments
    t_enc, mine = _encode(graph, ctx, "encode", (0, 0), segs, "worker")
    peers = [r for r in range(world) if r != rank]
    sends, got = _messages(graph, ctx, "exchange", (1, 0), ctx.tag_of(0),
                           [_Out(f"send{dst}", (1, dst), mine, dst, (t_enc,)) for dst in peers],
                           [_In(f"recv{src}", (2, src), segs, src) for src in peers])
    received = dict(zip(peers, got, strict=True))
    t_prev: Task = t_enc
    for src in range(world):
        message, t_in = mine, None
        if src != rank:
            t_in, message = received[src]
        last = src == world - 1
        # The same summation order on every rank keeps the results bitwise identical.
        t_prev = _decode(graph, ctx, f"decode{src}", (3, src), message, segs, src != 0,
                         1.0 / world if last else None,
                         (t_prev, t_in, *(sends if last else ())))


def _contiguous(segs: list[Segment], memory: Memory) -> Any:
    """The segments' elements as one array when they lie end to end in memory (a DDP
    bucket's gradients do), else None. The array borrows their memory."""
    if not segs:
        return None
    host = isinstance(memory, HostMemory)
    # tensors must also be views of one storage (a bucket's) to be viewed as one
    storage = None if host else segs[0].entry.buf.untyped_storage().data_ptr()
    start = at = segs[0].ptr
    for s in segs:
        if s.ptr != at or (storage is not None
                           and s.entry.buf.untyped_storage().data_ptr() != storage):
            return None
        at += 4 * s.n
    total = (at - start) // 4
    if storage is None:
        return np.ctypeslib.as_array((ctypes.c_float * total).from_address(start))
    return segs[0].entry.buf.as_strided((total,), (1,), (start - storage) // 4)


def build_none(ctx: Context, graph: Graph) -> None:
    """Plain (uncompressed) allreduce of the chunk, then the average: in place when its
    segments lie end to end, else through one buffer copied in now (so that every rank
    posts its allreduces in the same order) and back after. A staged chunk on a GPU is
    copied to pinned host memory now and back after (Gloo reduces host memory); the nccl
    link reduces it where it is."""
    segs = ctx.chunk.segments
    if ctx.chunk.numel == 0:
        return  # nothing to reduce: an empty graph finishes at once, on every rank
    memory = ctx.memory
    scale = 1.0 / ctx.world
    flat = _contiguous(segs, memory)
    inplace = flat is not None
    if flat is None:
        flat = ctx.scratch("flat", ctx.chunk.numel, np.float32)
        memory.gather(flat, segs)
    wire = flat
    link = ctx.link
    assert link is not None
    if link.sequencer is not None:  # nccl: reduce the device buffer, in the link's order
        sequencer, number = link.sequencer, link.sequencer.number()

        def reduce() -> Any:
            with memory.active():  # NCCL's stream waits for the engine's
                return ctx.transport.allreduce_device(flat)

        def post() -> Handle:
            return sequencer.post(number, reduce, Handle(None, -1, "allreduce", flat))

        t_ar = graph.task("allreduce", "post", (0, 0), post)
    else:
        if not isinstance(memory, HostMemory):
            wire = ctx.scratch("flat-host", ctx.chunk.numel, np.float32, True)
            memory.to_host(wire, flat)
        t_ar = graph.task("allreduce", "post", (0, 0), lambda: ctx.transport.allreduce(wire))

    def average() -> None:
        with memory.active():
            if wire is not flat:
                memory.from_host(flat, wire)
            memory.scale(flat, scale)
            if not inplace:
                memory.scatter(flat, segs)

    lane = "inline" if ctx.chunk.numel <= INLINE_AVERAGE else "compute"
    graph.task("average", lane, (1, 0), average, deps=(t_ar,))


BUILDERS = {"ps": build_ps, "ring": build_ring, "allgather": build_allgather,
            "none": build_none}

