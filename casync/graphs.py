"""Graph builders: compose the primitives into one task DAG per tensor partition.

Every builder synchronizes a contiguous float32 buffer in place: it reads the local
gradient from ``buf`` and leaves the average over ranks there. Every rank decodes the
same payload bytes for the final values, so the result is bitwise identical on all ranks.

Priorities are ``(partition, stage)``; a message's sender only depends on tasks of a
lower stage than the receive that waits for it (see ``casync.executor``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from hipress.codec import Codec

from . import primitives as P
from .executor import Graph, Task
from .feedback import ErrorFeedback
from .segments import Segmented
from .transport import Handle, Transport, tag_space

__all__ = ["Context", "BUILDERS", "slots", "build_ps", "build_ring", "build_allgather",
           "build_none"]


@dataclass
class Context:
    """What a builder needs besides the buffer: who we are and what to compress with."""

    transport: Transport
    codec: Codec | None
    feedback: ErrorFeedback | None
    step: int
    tag: int
    key: Hashable
    pool: dict[Hashable, np.ndarray] = field(default_factory=dict)
    #: offsets of the tensors fused into the graph's buffer, for per-tensor payloads
    bounds: list[int] | None = None
    buffer: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world(self) -> int:
        return self.transport.size

    def tag_of(self, part: int, slot: int, per_part: int) -> int:
        return (self.tag + part * per_part + slot) % tag_space

    def rng_step(self, *site: object) -> int:
        """A distinct RNG step per step, rank and encode site, so ranks round independently."""
        return zlib.crc32(repr((self.step, self.rank, site)).encode())

    def scratch(self, site: Hashable, size: int, dtype: type) -> np.ndarray:
        """A buffer that belongs to this tensor and site across steps (pages stay mapped).

        Reuse is safe: a step's sends and receives complete before the next step starts.
        """
        key = (self.key, site, np.dtype(dtype).str)
        buf = self.pool.get(key)
        if buf is None or buf.size < size:
            buf = self.pool[key] = np.empty(max(size, 1), dtype)
        return buf[:size]

    def codec_for(self, x: np.ndarray) -> Any:
        """The codec for ``x``, a view of the graph's buffer: one payload per fused tensor."""
        assert self.codec is not None
        if self.bounds is None or self.buffer is None:
            return self.codec
        start = (x.ctypes.data - self.buffer.ctypes.data) // x.itemsize
        stop = start + x.size
        inner = [b - start for b in self.bounds if start < b < stop]
        if not inner:
            return self.codec
        return Segmented(self.codec, [0, *inner, x.size])

    def encode(self, x: np.ndarray, *site: object) -> np.ndarray:
        codec = self.codec_for(x)
        key = (self.key, *site) if self.feedback is not None else None
        out = self.scratch(("payload", *site), codec.max_payload_bytes(x.size), np.uint8)
        return P.encode(codec, x, self.rng_step(*site), self.feedback, key, out)


def slots(topology: str, world: int) -> int:
    """Tags one partition of a graph uses."""
    return {"ps": 2, "ring": 2 * max(world - 1, 1), "allgather": 1, "none": 1}[topology]


Payload = Callable[[], np.ndarray]


def _encode(graph: Graph, ctx: Context, name: str, prio: tuple[int, int],
            x: np.ndarray, site: tuple[object, ...],
            deps: tuple[Task | None, ...] = ()) -> tuple[Task, Payload]:
    """An encode task and a getter for the payload it produces."""
    box: list[np.ndarray] = []

    def run() -> None:
        box.append(ctx.encode(x, *site))

    return graph.task(name, "compute", prio, run, deps), lambda: box[-1]


def _send(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], payload: Payload,
          dst: int, tag: int, deps: tuple[Task | None, ...]) -> Task:
    def run() -> Handle:
        return P.send(ctx.transport, payload(), dst, tag)

    return graph.task(name, "post", prio, run, deps)


def _recv(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], x: np.ndarray,
          src: int, tag: int) -> tuple[Task, Payload]:
    """A receive of the payload(s) for ``x``, a view of the graph's buffer."""
    codec = ctx.codec_for(x)
    capacity = codec.max_payload_bytes(x.size)
    count = len(codec.bounds) - 1 if isinstance(codec, Segmented) else 1
    handle = P.recv(ctx.transport, capacity, src, tag,
                    ctx.scratch(("recv", name), capacity, np.uint8))
    return (graph.task(name, "recv", prio, None, handle=handle),
            lambda: P.received(handle, count))


def _decode(graph: Graph, ctx: Context, name: str, prio: tuple[int, int], payload: Payload,
            out: np.ndarray, accumulate: bool, scale: float | None,
            deps: tuple[Task | None, ...]) -> Task:
    """Decode (or decode-and-merge) into ``out``; ``scale`` turns the sum into the mean."""
    def run() -> None:
        codec = ctx.codec_for(out)
        if accumulate and scale is not None:  # the mean of the whole sum
            P.decode(codec, payload(), out, True)
            np.multiply(out, np.float32(scale), out=out)
        else:  # one pass: the decoded values, scaled
            P.decode(codec, payload(), out, accumulate, 1.0 if scale is None else scale)

    return graph.task(name, "compute", prio, run, deps)


def build_ps(ctx: Context, graph: Graph, buf: np.ndarray, parts: list[slice],
             owners: list[int]) -> None:
    """Parameter server with co-located aggregators: partition i is reduced on owners[i]."""
    assert ctx.codec is not None
    rank, world = ctx.rank, ctx.world
    for p, (sl, agg) in enumerate(zip(parts, owners, strict=True)):
        x = buf[sl]
        up, down = ctx.tag_of(p, 0, 2), ctx.tag_of(p, 1, 2)
        if rank != agg:
            t_enc, mine = _encode(graph, ctx, f"p{p}/encode", (p, 0), x,
                                  (p, "worker"))
            t_send = _send(graph, ctx, f"p{p}/send", (p, 1), mine, agg, up, (t_enc,))
            t_recv, result = _recv(graph, ctx, f"p{p}/recv", (p, 3), x, agg, down)
            _decode(graph, ctx, f"p{p}/decode", (p, 4), result, x, False, 1.0 / world,
                    (t_recv, t_send))
            continue
        # The aggregator merges into its own values as they are (no encode round trip);
        # they are read nowhere else, and the final decode overwrites them.
        t_prev: Task | None = None
        for src in range(world):
            if src != rank:
                t_recv, theirs = _recv(graph, ctx, f"p{p}/recv{src}", (p, 1), x, src, up)
                t_prev = _decode(graph, ctx, f"p{p}/merge{src}", (p, 2), theirs, x, True,
                                 None, (t_prev, t_recv))
        t_enc, total = _encode(graph, ctx, f"p{p}/reencode", (p, 2), x,
                               (p, "aggregator"), (t_prev,))
        for dst in range(world):
            if dst != rank:
                _send(graph, ctx, f"p{p}/send{dst}", (p, 3), total, dst, down, (t_enc,))
        _decode(graph, ctx, f"p{p}/decode", (p, 4), total, x, False, 1.0 / world, (t_enc,))


def build_ring(ctx: Context, graph: Graph, buf: np.ndarray, parts: list[slice],
               owners: list[int]) -> None:
    """Compressed ring: reduce-scatter re-encoding at each hop, then forward chunks as is.

    At reduce-scatter hop h, rank r receives chunk (r-h-1) mod N from its left, adds its
    own values and re-encodes; after N-1 hops it owns chunk (r+1) mod N. The allgather
    forwards the owners' payloads unchanged, so every rank decodes the same bytes.
    """
    assert ctx.codec is not None
    rank, world = ctx.rank, ctx.world
    left, right = (rank - 1) % world, (rank + 1) % world
    per = slots("ring", world)
    mean = 1.0 / world
    for p, sl in enumerate(parts):
        x = buf[sl]
        chunks = [x[c] for c in P.partition(x.size, world)]
        t_last, payload = _encode(graph, ctx, f"p{p}/encode", (p, 0),
                                  chunks[rank], (p, "worker"))
        _send(graph, ctx, f"p{p}/rs-send0", (p, 1), payload, right, ctx.tag_of(p, 0, per),
              (t_last,))
        for h in range(world - 1):
            c = (rank - h - 1) % world
            t_recv, incoming = _recv(graph, ctx, f"p{p}/rs-recv{h}", (p, 2 * h + 1),
                                     chunks[c], left, ctx.tag_of(p, h, per))
            # Chunk c is read at this hop only; merge into it (final decodes overwrite it).
            t_merge = _decode(graph, ctx, f"p{p}/rs-merge{h}", (p, 2 * h + 2), incoming,
                              chunks[c], True, None, (t_last, t_recv))
            site = (p, "owner") if h == world - 2 else (p, "hop", c)
            t_last, payload = _encode(graph, ctx, f"p{p}/rs-encode{h}", (p, 2 * h + 2),
                                      chunks[c], site, (t_merge,))
            name = f"p{p}/rs-send{h + 1}" if h < world - 2 else f"p{p}/ag-send0"
            _send(graph, ctx, name, (p, 2 * h + 3), payload, right,
                  ctx.tag_of(p, h + 1, per), (t_last,))
        # Our own reduced chunk: decode the bytes every other rank decodes.
        own = (rank + 1) % world
        _decode(graph, ctx, f"p{p}/decode{own}", (p, 2 * world), payload, chunks[own],
                False, mean, (t_last,))
        for g in range(world - 1):
            c = (rank - g) % world
            stage = 2 * world + 2 * g + 1
            t_recv, final = _recv(graph, ctx, f"p{p}/ag-recv{g}", (p, stage), chunks[c], left,
                                  ctx.tag_of(p, world - 1 + g, per))
            if g < world - 2:
                _send(graph, ctx, f"p{p}/ag-send{g + 1}", (p, stage + 1), final, right,
                      ctx.tag_of(p, world + g, per), (t_recv,))
            # t_last ends the reduce-scatter, after every read of this rank's values.
            _decode(graph, ctx, f"p{p}/decode{c}", (p, stage + 1), final, chunks[c], False,
                    mean, (t_recv, t_last))


def build_allgather(ctx: Context, graph: Graph, buf: np.ndarray, parts: list[slice],
                    owners: list[int]) -> None:
    """Every rank encodes, payloads go to every rank, each decodes and sums in rank order."""
    assert ctx.codec is not None
    rank, world = ctx.rank, ctx.world
    for p, sl in enumerate(parts):
        x = buf[sl]
        tag = ctx.tag_of(p, 0, 1)
        t_enc, mine = _encode(graph, ctx, f"p{p}/encode", (p, 0), x,
                              (p, "worker"))
        sends = tuple(_send(graph, ctx, f"p{p}/send{dst}", (p, 1), mine, dst, tag, (t_enc,))
                      for dst in range(world) if dst != rank)
        t_prev: Task = t_enc
        for src in range(world):
            payload, t_in = mine, None
            if src != rank:
                t_in, payload = _recv(graph, ctx, f"p{p}/recv{src}", (p, 2), x, src, tag)
            last = src == world - 1
            # The same summation order on every rank keeps the results bitwise identical.
            t_prev = _decode(graph, ctx, f"p{p}/decode{src}", (p, 3), payload, x, src != 0,
                             1.0 / world if last else None,
                             (t_prev, t_in, *(sends if last else ())))


def build_none(ctx: Context, graph: Graph, buf: np.ndarray, parts: list[slice],
               owners: list[int]) -> None:
    """Plain (uncompressed) allreduce per partition, then the average."""
    scale = np.float32(1.0 / ctx.world)
    for p, sl in enumerate(parts):
        x = buf[sl]
        t_ar = graph.task(f"p{p}/allreduce", "post", (p, 0),
                          partial(ctx.transport.allreduce, x))
        graph.task(f"p{p}/average", "compute", (p, 1),
                   partial(np.multiply, x, scale, out=x), deps=(t_ar,))


BUILDERS = {"ps": build_ps, "ring": build_ring, "allgather": build_allgather,
            "none": build_none}
