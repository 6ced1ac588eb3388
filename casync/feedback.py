"""Error feedback: carry what compression dropped into the next step's encode."""

from __future__ import annotations

import itertools
from collections.abc import Hashable

import numpy as np

from compll import Codec

__all__ = ["ErrorFeedback"]

_versions = itertools.count(1)  # unique across instances: a cache keyed by one stays valid


class ErrorFeedback:
    """Residuals keyed by encode site (tensor segment and role), one per rank.

    An encode compresses ``x + residual`` and keeps ``(x + residual) - decode(payload)``
    for the next step, so the sum of what is synchronized tracks the sum of the
    gradients (Seide et al. 2014; Karimireddy et al. 2019). Workers keep one residual
    per tensor segment; aggregators and ring hops one per re-encode. The kernels do
    both updates: the encode adds ``x`` into the residual, and a decode with
    ``feedback`` (or a decode's ``fb`` output) subtracts the payload's values, zeroing
    what is not finite (a NaN or Inf gradient would poison every later step).

    Example:
        >>> ef = ErrorFeedback()
        >>> payload = ef.encode(codec, grad, step=0, key=("fc.weight", 0, "worker"))
    """

    def __init__(self) -> None:
        self._residuals: dict[Hashable, np.ndarray] = {}
        #: changes whenever residual buffers are replaced, so that callers that hold
        #: their addresses (the engine's batched calls) know to look them up again
        self.version = next(_versions)

    def __len__(self) -> int:
        return len(self._residuals)

    def residual(self, key: Hashable) -> np.ndarray | None:
        """The residual an encode site carries, or None before its first encode."""
        return self._residuals.get(key)

    def site(self, key: Hashable, n: int) -> np.ndarray:
        """The residual of ``key`` for ``n`` elements, zeros on first use (or when the
        site's size changed). The buffer lives as long as the site: no page faults on
        later steps."""
        residual = self._residuals.get(key)
        if residual is None or residual.size != n:
            if residual is not None:
                self.version = next(_versions)
            residual = self._residuals[key] = np.zeros(n, np.float32)
        return residual

    def reset(self) -> None:
        """Forget every residual (e.g. after the model was reloaded)."""
        self._residuals.clear()
        self.version = next(_versions)

    def state_dict(self) -> dict[Hashable, np.ndarray]:
        """A copy of every residual, by site."""
        return {key: r.copy() for key, r in self._residuals.items()}

    def load_state_dict(self, state: dict[Hashable, np.ndarray]) -> None:
        """Replace the residuals with ``state``'s (from ``state_dict``)."""
        self._residuals = {key: np.array(r, dtype=np.float32, order="C", copy=True).reshape(-1)
                           for key, r in state.items()}
        self.version = next(_versions)

    def encode(self, codec: Codec, x: np.ndarray, step: int, key: Hashable,
               out: np.ndarray | None = None) -> np.ndarray:
        """Encode ``x`` plus the site's residual (into ``out`` if given); update the residual."""
        residual = self.site(key, x.size)
        payload = codec.encode(x, step=step, out=out, residual=residual)
        codec.decode(payload, residual.size, out=residual, scale=-1.0, feedback=True)
        return payload
