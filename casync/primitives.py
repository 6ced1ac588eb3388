"""The building blocks every strategy is composed of.

Compute: ``encode``, ``decode`` (``accumulate=True`` fuses decode and merge), ``merge``.
Communication: ``send``, ``recv`` (with ``received`` to read a payload off its buffer).
Layout: ``partition``. The graph builders use nothing else.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from compll import Codec
from compll.payload import framed_size

from .feedback import ErrorFeedback
from .transport import Handle, Transport

__all__ = ["partition", "encode", "decode", "merge", "send", "recv", "received"]


def partition(n: int, k: int) -> list[slice]:
    """Cut ``n`` elements into ``k`` contiguous slices whose sizes differ by at most one.

    Example:
        >>> partition(10, 3)
        [slice(0, 4, None), slice(4, 7, None), slice(7, 10, None)]
    """
    base, extra = divmod(n, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return [slice(bounds[i], bounds[i + 1]) for i in range(k)]


def encode(codec: Codec, x: np.ndarray, step: int, feedback: ErrorFeedback | None = None,
           key: Hashable = None, out: np.ndarray | None = None) -> np.ndarray:
    """Compress ``x`` (into ``out`` when it fits); with ``feedback``, compress ``x`` plus
    the residual of ``key``."""
    if feedback is not None:
        return feedback.encode(codec, x, step, key, out)
    return codec.encode(x, step=step, out=out)


def decode(codec: Codec, payload: np.ndarray, out: np.ndarray,
           accumulate: bool = False, scale: float = 1.0) -> None:
    """Decompress ``payload`` into ``out`` (its length is the element count), or add to it;
    the values are multiplied by ``scale`` in the same pass."""
    codec.decode(payload, out.size, out=out, accumulate=accumulate, scale=scale)


def merge(acc: np.ndarray, x: np.ndarray) -> None:
    """Add ``x`` into ``acc`` in place."""
    np.add(acc, x, out=acc)


def send(transport: Transport, payload: np.ndarray, dst: int, tag: int) -> Handle:
    """Post ``payload`` to rank ``dst``; the handle keeps the buffer alive."""
    return transport.isend(payload, dst, tag)


def recv(transport: Transport, capacity: int, src: int, tag: int,
         buffer: np.ndarray | None = None) -> Handle:
    """Post a receive of up to ``capacity`` bytes from rank ``src`` (into ``buffer``)."""
    return transport.irecv(capacity, src, tag, buffer)


def received(handle: Handle, count: int = 1) -> np.ndarray:
    """The ``count`` payloads a completed receive holds, laid end to end: its buffer cut
    where the last payload's header says it ends."""
    end = 0
    for _ in range(count):
        end += framed_size(handle.buffer[end:])
    return handle.buffer[:end]
