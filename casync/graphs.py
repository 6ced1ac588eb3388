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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .chunks import Segment
from .context import Context
from .devices import LENGTH, HostMemory, Memory, Message, framed_payloads
from .executor import Graph, Lane, Task
from .transport import Handle, Posted

__all__ = ["Context", "BUILDERS", "slots", "build_ps", "build_scatter", "build_ring",
           "build_allgather", "build_none"]

_LENGTH = LENGTH
#: Elements up to which an uncompressed chunk's average runs on the thread that saw its
#: allreduce finish (``casync.executor``'s inline lane): so little copying that a
#: hand-off to the compute thread and back would cost a sizeable share of it.
INLINE_AVERAGE = 1 << 20


def slots(topology: str, world: int) -> int:
    """Tags one chunk's graph uses."""
    return {"ps": 2, "ring": 2 * max(world - 1, 1), "allgather": 1, "scatter": 1,
            "none": 1}[topology]


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

    return graph.task(name, Lane.COMPUTE, prio, run, deps), lambda: box[-1]


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
    sends = [graph.task(o.name, Lane.P2P, o.prio, _poster(ctx, o, tag), o.deps) for o in outs]
    return sends, [_recv(graph, ctx, i, tag) for i in ins]


def _poster(ctx: Context, out: _Out, tag: int) -> Callable[[], Handle]:
    return lambda: ctx.transport.isend(out.message().wire, out.dst, tag)


def _capacity(ctx: Context, segs: list[Segment], name: str) -> int:
    """The worst-case bytes of a message for ``segs``: what a receiver posts."""
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
    task = graph.task(spec.name, Lane.P2P, spec.prio,
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

        return sequencer.post(number, post, Handle(None, peer, Posted.EXCHANGE, None))

    task = graph.task(name, Lane.POST, prio, run, tuple(d for o in outs for d in o.deps))
    return [task] * len(outs), [(task, _constant(Message(b))) for b in buffers]


def _constant(message: Message) -> Got:
    return lambda: message


def _decode(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], message: Got,
            segs: list[Segment], accumulate: bool, scale: float | None,
            deps: tuple[Task | None, ...]) -> Task:
    def run() -> None:
        ctx.decode(message(), segs, accumulate, scale, name)

    return graph.task(name, Lane.COMPUTE, prio, run, deps)


@dataclass
class _Uploads:
    """The first stage of ``ps`` and ``scatter``: what each owner reduces, and the
    workers' messages to it."""

    owned: list[list[Segment]]  # per rank, the chunk's segments it owns
    mine: list[Segment]  # this rank's
    aggs: list[int]  # the other ranks this one sends to (they own segments here)
    workers: list[int]  # the ranks this one receives from (none if it owns nothing)
    sent: list[Task]
    got: list[tuple[Task, Got]]


def _upload(ctx: Context, graph: Graph) -> _Uploads:
    """A worker encodes the segments each other owner owns into one message for it; an
    owner posts a receive from every other rank."""
    rank, world = ctx.rank, ctx.world
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
    return _Uploads(owned, mine, aggs, workers, sent, got)


def build_ps(ctx: Context, graph: Graph) -> None:
    """Parameter server with co-located aggregators: each segment is reduced on its owner.

    Per chunk, a worker sends one message to each aggregator (the payloads of the
    segments it owns) and receives one reply; an aggregator merges the workers' messages
    in rank order, re-encodes once and sends the same bytes to every rank. Two stages:
    the uploads, then the replies.
    """
    assert ctx.codec is not None
    world = ctx.world
    mean = 1.0 / world
    up = _upload(ctx, graph)
    owned, mine, aggs, workers, sent, got = (up.owned, up.mine, up.aggs, up.workers,
                                             up.sent, up.got)
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


def build_scatter(ctx: Context, graph: Graph) -> None:
    """Compressed reduce-scatter, the first half of ``ps``: rank j owns shard j of every
    rank's tensor (``Chunker``). Per chunk, a worker sends one message to each owner (the
    payloads of the segments it owns); an owner merges the workers' messages into its
    own values in rank order, the last merge scaling the sum to the mean. Only the owner
    holds the mean; a rank's copy of the other shards is left as it was. One stage.
    """
    assert ctx.codec is not None
    up = _upload(ctx, graph)
    t_prev: Task | None = None
    for src, (t_recv, theirs) in zip(up.workers, up.got, strict=True):
        mean = 1.0 / ctx.world if src == up.workers[-1] else None
        t_prev = _decode(graph, ctx, f"agg/merge{src}", (2, src), theirs, up.mine, True,
                         mean, (t_prev, t_recv))


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
            return sequencer.post(number, reduce, Handle(None, -1, Posted.ALLREDUCE, flat))

        t_ar = graph.task("allreduce", Lane.POST, (0, 0), post)
    else:
        if not isinstance(memory, HostMemory):
            wire = ctx.scratch("flat-host", ctx.chunk.numel, np.float32, True)
            memory.to_host(wire, flat)
        t_ar = graph.task("allreduce", Lane.POST, (0, 0), lambda: ctx.transport.allreduce(wire))

    def average() -> None:
        with memory.active():
            if wire is not flat:
                memory.from_host(flat, wire)
            memory.scale(flat, scale)
            if not inplace:
                memory.scatter(flat, segs)

    lane = Lane.INLINE if ctx.chunk.numel <= INLINE_AVERAGE else Lane.COMPUTE
    graph.task("average", lane, (1, 0), average, deps=(t_ar,))


BUILDERS = {"ps": build_ps, "ring": build_ring, "allgather": build_allgather,
            "scatter": build_scatter, "none": build_none}

