"""``hipress.codec``: encode and decode gradients with a CompLL algorithm."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import compll
from compll import interpreter
from compll.compiler import describe_params
from compll.ir import Program

from .errors import ConfigError, PayloadError

__all__ = ["Codec", "codec", "algorithms", "TARGETS"]

#: Backends a codec can run on. The reference interpreter is the oracle for the others.
TARGETS = ("ref",)


def algorithms() -> list[str]:
    """Names of the shipped compression algorithms (the ``dsl/*.cll`` files).

    Example:
        >>> "onebit" in hipress.algorithms()
        True
    """
    return compll.algorithms()


def _as_float32(x: Any, what: str) -> np.ndarray:
    """A 1-D float32 NumPy view (or copy) of an array or CPU torch tensor."""
    if type(x).__module__.startswith("torch"):
        if x.device.type != "cpu":
            raise ConfigError(f"{what} is on {x.device}; this codec runs on the CPU")
        x = x.detach()
        if x.dtype != _torch_float32(x):
            x = x.float()  # fp16 / bf16 / f64 gradients are upcast
        x = x.contiguous().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ConfigError(f"{what} must hold floating-point values, not {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.float32)


def _torch_float32(t: Any) -> Any:
    import torch

    return torch.float32


class Codec:
    """One compression algorithm with fixed parameters, on one target.

    ``encode`` turns a float32 vector into a self-describing uint8 payload; ``decode``
    turns it back. Stochastic algorithms draw from a counter-based RNG keyed by
    ``seed`` and a step that advances with every ``encode``; both travel in the
    payload header, so any rank decodes any payload to the same values.
    """

    def __init__(self, program: Program, target: str, seed: int) -> None:
        self.program = program
        self.target = target
        self.seed = int(seed) & 0xFFFFFFFF
        self.step = 0

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.program.param_values)

    def __repr__(self) -> str:
        params = describe_params(self.program)
        sep = ", " if params else ""
        return f"Codec({self.name!r}, target={self.target!r}, seed={self.seed}{sep}{params})"

    def encode(self, x: Any, step: int | None = None) -> np.ndarray:
        """Compress a gradient.

        Args:
            x: a float array or CPU torch tensor (flattened; non-float32 is upcast).
            step: the RNG step; by default the codec's own counter, which then advances.

        Returns:
            The payload, a 1-D uint8 array.
        """
        data = _as_float32(x, "the gradient")
        if step is None:
            step = self.step
            self.step = (self.step + 1) & 0xFFFFFFFF
        return interpreter.encode(self.program, data, self.seed, step)

    def decode(self, payload: Any, n: int, out: Any = None, accumulate: bool = False) -> Any:
        """Decompress a payload of ``n`` elements.

        Args:
            payload: bytes or a uint8 array from ``encode`` (any codec instance with
                the same algorithm and parameters).
            n: the element count the caller expects; a mismatch is a PayloadError.
            out: an optional float32 array or CPU tensor of ``n`` elements to write to.
            accumulate: add the decoded values to ``out`` instead of overwriting it.

        Returns:
            ``out`` if given, else a new float32 array.

        Raises:
            PayloadError: if the payload is malformed, truncated or from another codec.
        """
        buf = _as_payload(payload)
        values = interpreter.decode(self.program, buf, int(n))
        if out is None:
            if accumulate:
                raise ConfigError("accumulate=True needs out= to accumulate into")
            return values
        target = out.numpy() if type(out).__module__.startswith("torch") else out
        if not isinstance(target, np.ndarray) or target.dtype != np.float32 \
                or target.size != n or not target.flags.c_contiguous:
            raise ConfigError(f"out= must be a contiguous float32 array of {n} elements")
        flat = target.reshape(-1)
        if accumulate:
            flat += values
        else:
            flat[...] = values
        return out


def _as_payload(payload: Any) -> np.ndarray:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=np.uint8)
    if type(payload).__module__.startswith("torch"):
        payload = payload.detach().cpu().numpy()
    arr = np.asarray(payload)
    if arr.dtype != np.uint8:
        raise PayloadError(f"a payload is a uint8 array, not {arr.dtype}")
    return arr.reshape(-1)


def codec(name_or_path: str | os.PathLike[str], target: str = "ref", seed: int = 0,
          **params: Any) -> Codec:
    """Build a codec for a shipped algorithm or a ``.cll`` file.

    Args:
        name_or_path: an algorithm name from ``algorithms()`` or a path to a ``.cll`` file.
        target: the backend; ``"ref"`` is the NumPy reference interpreter.
        seed: the RNG seed of stochastic algorithms.
        **params: overrides of the algorithm's ``param`` declarations.

    Returns:
        A ``Codec``.

    Raises:
        ConfigError: unknown algorithm, target or parameter, or a failed ``require``.
        CompileError: the DSL file does not parse or check.

    Example:
        >>> c = hipress.codec("dgc", ratio=0.01)
        >>> y = c.decode(c.encode(x), len(x))
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    return Codec(compll.load(name_or_path, **params), target, seed)
