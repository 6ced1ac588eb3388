"""The digits task the framework examples share: data split and a replica check."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import numpy as np


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (no download): 1797 8x8 images as rows of 64 values
    scaled to [0, 1], and their labels.

    Read from the CSV that scikit-learn ships, as its ``load_digits`` does, without
    importing scikit-learn: that import (SciPy's statistics among it) took 2.3 s of every
    rank's start-up, longer than the examples' training steps.
    """
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    folders = spec.submodule_search_locations if spec is not None else None
    csv = Path(list(folders)[0]) / "datasets" / "data" / "digits.csv.gz" if folders else None
    if csv is not None and csv.is_file():
        table = np.loadtxt(csv, delimiter=",")
        data, target = table[:, :-1], table[:, -1]
    else:  # a layout this does not know: let scikit-learn find its file
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        data, target = digits.data, digits.target
    return (data / 16.0).astype(np.float32), target.astype(np.int64)


def load_digits_split(seed: int = 0) -> tuple[np.ndarray, ...]:
    """The digits (``load_digits``): 80 % train, 20 % test."""
    x, y = load_digits()
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
