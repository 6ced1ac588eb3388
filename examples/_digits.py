"""The digits task the framework examples share: data split and a replica check."""

from __future__ import annotations

import hashlib

import numpy as np


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, ...]:
    """scikit-learn's bundled digits (no download): 80 % train, 20 % test, scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def batches(n: int, batch: int, rank: int, world: int, epoch: int) -> list[np.ndarray]:
    """This rank's sample indices for each step of one epoch (a shared shuffle, strided)."""
    order = np.random.default_rng(1000 + epoch).permutation(n)[rank::world]
    steps = n // (batch * world)
    return [order[i * batch:(i + 1) * batch] for i in range(steps)]


def digest(arrays: list[np.ndarray]) -> str:
    """A hash of the model's parameters: equal on every rank when replicas agree."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    return h.hexdigest()[:16]
