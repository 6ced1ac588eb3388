"""What a graph builder works with besides its chunk (``Context``): who we are, what to
compress with, how messages travel, and the buffers and batch rows a chunk keeps across
steps."""

from __future__ import annotations

import zlib
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from compll import Codec
from compll.constants import FEEDBACK
from compll.loaders import DECODE_ITEM, ENCODE_ITEM
from hipress_base.errors import PayloadError

from .chunks import Chunk, Segment
from .devices import LENGTH, GlooLink, HostMemory, Link, Memory, Message, numel
from .feedback import ErrorFeedback
from .transport import Transport, tag_space

__all__ = ["Context"]

_LENGTH = LENGTH


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
            self.link = GlooLink(HostMemory(), self.transport)

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
        if merge is not None and not segs:
            self.decode(merge, segs, True, None, merge_site)  # checks that it is empty
            merge = None
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

