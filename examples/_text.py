"""Real text for the language model, shipped with every Python: the standard library's
own modules, read as bytes (a byte-level model: 256 tokens, no tokenizer, no download).

The top-level ``*.py`` files of the standard library, sorted by name, are split by file:
every tenth is held out, so the held-out loss measures text the model never saw (4.7 MB
of source on CPython 3.11: 4.2 MB to train on, 0.5 MB held out).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

__all__ = ["ByteText", "VOCAB"]

#: a byte-level model's vocabulary
VOCAB = 256


class ByteText:
    """Windows of ``length`` bytes of the standard library's source.

    ``batch(rank, step, n)`` gives rank ``rank``'s ``n`` training windows of ``step`` (the
    same in every run); ``held_out(n)`` the same ``n`` held-out windows every time.
    """

    def __init__(self, length: int = 65, holdout: int = 10) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(root.glob("*.py"))
        if len(files) < holdout:
            raise FileNotFoundError(f"the standard library's sources are not under {root}")
        held = [f for i, f in enumerate(files) if i % holdout == 0]
        train = [f for i, f in enumerate(files) if i % holdout != 0]
        self.length = length
        self.train = np.frombuffer(b"".join(f.read_bytes() for f in train), np.uint8)
        self.test = np.frombuffer(b"".join(f.read_bytes() for f in held), np.uint8)

    def _windows(self, text: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return text[starts[:, None] + np.arange(self.length)].astype(np.int64)

    def batch(self, rank: int, step: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([rank, step, 11])
        return self._windows(self.train, rng.integers(0, self.train.size - self.length, n))

    def held_out(self, n: int) -> np.ndarray:
        """``n`` windows spread evenly over the held-out text."""
        starts = np.linspace(0, self.test.size - self.length - 1, n).astype(np.int64)
        return self._windows(self.test, starts)
