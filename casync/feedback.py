"""Error feedback: carry what compression dropped into the next step's encode."""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

import numpy as np

from compll import Codec

from .devices import HostMemory, Memory, numel

__all__ = ["ErrorFeedback"]

_versions = itertools.count(1)  # unique across instances: a cache keyed by one stays valid


class ErrorFeedback:
    """Residuals keyed by encode site (tensor segment and role), one per rank.

    An encode compresses ``x + residual`` and keeps ``(x + residual) - decode(payload)``
    for the next step, so the sum of what is synchronized tracks the sum of the
    gradients (Seide et al. 2014; Karimireddy et al. 2019). Workers keep one residual
    per tensor segment; aggregators and ring hops one per re-encode. The kernels do
    both updates: the encode adds ``x`` into the residual, and a decode with
    ``feedback`` subtracts the payload's values, zeroing
    what is not finite (a NaN or Inf gradient would poison every later step).

    On the CPU, CaSync's batched encodes defer the second update to the site's next
    encode, which runs it inside its first pass over the residual (``kept``): the
    residual then holds ``x + residual`` until that encode, or until it is read here
    (``residual``, ``state_dict``), which settles it first. Either way it ends with the
    same bits.

    Example:
        >>> ef = ErrorFeedback()
        >>> payload = ef.encode(codec, grad, step=0, key=("fc.weight", 0, "worker"))
    """

    def __init__(self) -> None:
        # NumPy arrays, or tensors on the device of their segment's gradient (CUDA)
        self._residuals: dict[Hashable, Any] = {}
        # per site, [u64 size | payload] the residual still owes, and the codec to decode it
        self._kept: dict[Hashable, tuple[np.ndarray, Codec]] = {}
        #: changes whenever residual buffers are replaced, so that callers that hold
        #: their addresses (the engine's batched calls) know to look them up again
        self.version = next(_versions)

    def __len__(self) -> int:
        return len(self._residuals)

    def residual(self, key: Hashable) -> Any:
        """The residual an encode site carries, or None before its first encode."""
        self.settle(key)
        return self._residuals.get(key)

    def kept(self, key: Hashable, codec: Codec, cap: int) -> np.ndarray:
        """The host buffer in which the site's deferred update waits for its next encode:
        8 bytes of payload size (0: nothing owed), then up to ``cap`` payload bytes of
        ``codec`` (``hp::EncItem``'s keep). The batched encode reads and writes it."""
        entry = self._kept.get(key)
        if entry is not None and entry[0].size >= cap + 8 and _same(entry[1], codec):
            return entry[0]
        self.settle(key)
        buf = np.zeros(cap + 8, np.uint8)
        self._kept[key] = (buf, codec)
        self.version = next(_versions)
        return buf

    def settle(self, key: Hashable | None = None) -> None:
        """Apply the deferred update of ``key`` (default: of every site) now."""
        for k in list(self._kept) if key is None else [key]:
            entry = self._kept.get(k)
            if entry is None:
                continue
            buf, codec = entry
            residual = self._residuals.get(k)
            size = int(buf[:8].view(np.uint64)[0])
            if size and residual is not None:
                codec.decode(buf[8:8 + size], numel(residual), out=residual, scale=-1.0,
                             feedback=True)
            buf[:8] = 0

    def site(self, key: Hashable, n: int, memory: Memory | None = None) -> Any:
        """The residual of ``key`` for ``n`` elements on ``memory`` (default the host),
        zeros on first use (or when the site's size changed); a residual loaded from a
        checkpoint moves to ``memory`` on first use. The buffer lives as long as the
        site: no page faults on later steps."""
        residual = self._residuals.get(key)
        host = memory is None or isinstance(memory, HostMemory)
        on = "host" if host else f"torch:{memory.device}"  # type: ignore[union-attr]
        if residual is None or numel(residual) != n or _where(residual) != on:
            if residual is not None:
                self.version = next(_versions)
                if numel(residual) == n:
                    self.settle(key)
                else:  # starts afresh: its pending update no longer applies
                    self._kept.pop(key, None)
            values = residual if residual is not None and numel(residual) == n else None
            if host:
                fresh = np.zeros(n, np.float32)
                if values is not None:
                    fresh[...] = _host(values)
            else:
                assert memory is not None
                fresh = memory.empty(n, np.float32)
                if values is None:
                    fresh.zero_()
                else:
                    memory.from_host(fresh, _host(values))
            residual = self._residuals[key] = fresh
        return residual

    def reset(self) -> None:
        """Forget every residual (e.g. after the model was reloaded)."""
        self._residuals.clear()
        self._kept.clear()
        self.version = next(_versions)

    def state_dict(self) -> dict[Hashable, np.ndarray]:
        """A host copy of every residual, by site."""
        self.settle()
        return {key: _host(r).copy() for key, r in self._residuals.items()}

    def load_state_dict(self, state: dict[Hashable, np.ndarray]) -> None:
        """Replace the residuals with ``state``'s (from ``state_dict``)."""
        self._kept.clear()
        self._residuals = {key: np.array(np.asarray(r), dtype=np.float32, order="C",
                                         copy=True).reshape(-1)
                           for key, r in state.items()}
        self.version = next(_versions)

    def encode(self, codec: Codec, x: np.ndarray, step: int, key: Hashable,
               out: np.ndarray | None = None) -> np.ndarray:
        """Encode ``x`` plus the site's residual (into ``out`` if given); update the residual."""
        self.settle(key)
        residual = self.site(key, x.size)
        payload = codec.encode(x, step=step, out=out, residual=residual)
        codec.decode(payload, residual.size, out=residual, scale=-1.0, feedback=True)
        return payload


def _same(a: Codec, b: Codec) -> bool:
    """Whether ``a`` decodes what ``b`` encodes."""
    return a is b or (a.name, a.params) == (b.name, b.params)


def _where(x: Any) -> str:
    return "host" if isinstance(x, np.ndarray) else f"torch:{x.device}"


def _host(x: Any) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()
