"""Several tensors, one message: a codec over consecutive tensors of a fused buffer.

Bulk synchronization batches small tensors into one buffer so they travel as one
message. Compressing the buffer as a whole would give every tensor the same scale
(onebit's means, minmax8's range), which costs accuracy when layers' gradients differ
in magnitude. ``Segmented`` encodes each tensor's slice as its own payload and lays the
payloads end to end; each payload's header gives its length, so the message splits
back without an index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from compll.payload import framed_size
from hipress.codec import Codec
from hipress.errors import PayloadError

__all__ = ["Segmented"]


class Segmented:
    """``codec`` applied per segment; ``bounds`` are offsets ``[0, b1, ..., n]``.

    Has the methods of a ``Codec`` that the engine uses, so error feedback and the
    graph builders work on it unchanged.
    """

    def __init__(self, codec: Codec, bounds: list[int]) -> None:
        self.codec = codec
        self.bounds = bounds
        self.unbiased = codec.unbiased

    def __repr__(self) -> str:
        return f"Segmented({self.codec!r}, {len(self.bounds) - 1} segments)"

    def _segments(self, n: int) -> list[tuple[int, int]]:
        if n != self.bounds[-1]:
            raise PayloadError(f"segments cover {self.bounds[-1]} elements, not {n}")
        return list(zip(self.bounds[:-1], self.bounds[1:], strict=True))

    def max_payload_bytes(self, n: int) -> int:
        return sum(self.codec.max_payload_bytes(b - a) for a, b in self._segments(n))

    def encode(self, x: np.ndarray, step: int | None = None, out: Any = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        if out is None or out.size < self.max_payload_bytes(x.size):
            out = np.empty(self.max_payload_bytes(x.size), np.uint8)
        pos = 0
        base = 0 if step is None else step
        for i, (a, b) in enumerate(self._segments(x.size)):
            payload = self.codec.encode(x[a:b], step=(base + i) & 0xFFFFFFFF, out=out[pos:],
                                        residual=None if residual is None else residual[a:b])
            if payload.ctypes.data != out[pos:].ctypes.data:  # did not fit: copy it in
                out[pos:pos + payload.size] = payload
            pos += payload.size
        return out[:pos]

    def decode(self, payload: Any, n: int, out: Any = None, accumulate: bool = False,
               scale: float = 1.0, feedback: bool = False) -> Any:
        if out is None:
            out = np.empty(n, np.float32)
        buf = np.asarray(payload).reshape(-1)
        pos = 0
        for a, b in self._segments(n):
            size = framed_size(buf[pos:])
            self.codec.decode(buf[pos:pos + size], b - a, out=out[a:b], accumulate=accumulate,
                              scale=scale, feedback=feedback)
            pos += size
        if pos != buf.size:
            raise PayloadError(f"{buf.size - pos} bytes follow the last segment's payload")
        return out
