"""``hipress.codec``: encode and decode gradients with a CompLL algorithm."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

# Module imports (not names): compll imports hipress.errors, so either package may be
# the one imported first.
from compll import compiler, interpreter
from compll.ir import Program

from .errors import ConfigError, PayloadError

__all__ = ["Codec", "codec", "algorithms", "TARGETS", "MAX_ELEMENTS"]

#: Backends a codec can run on. ``auto`` runs CUDA tensors on the GPU and everything
#: else on the CPU; ``ref`` is the NumPy reference interpreter, the oracle of the others.
TARGETS = ("auto", "cpu", "cuda", "ref")
#: CompLL counts and indexes elements in u32 (``size(g)``, ``n``, filter indices), so one
#: encode or decode takes at most this many; CaSync partitions larger tensors.
MAX_ELEMENTS = 2**32 - 1


def _check_count(n: int) -> None:
    if n > MAX_ELEMENTS:
        raise ConfigError(f"{n:,} elements is more than one encode or decode takes "
                          f"({MAX_ELEMENTS:,}, CompLL's u32 element count); split the tensor "
                          "and encode the pieces")


def algorithms() -> list[str]:
    """Names of the shipped compression algorithms (the ``dsl/*.cll`` files).

    Example:
        >>> "onebit" in hipress.algorithms()
        True
    """
    return compiler.algorithms()


def _is_torch(x: Any) -> bool:
    """A torch tensor, told apart without importing torch."""
    return type(x).__module__.startswith("torch")


def _is_cuda(x: Any) -> bool:
    return _is_torch(x) and x.device.type == "cuda"


def _as_float32(x: Any, what: str) -> np.ndarray:
    """A 1-D float32 NumPy view (or copy) of an array or CPU torch tensor."""
    if _is_torch(x):
        x = x.detach()
        if x.dtype != _torch().float32:
            x = x.float()  # fp16 / bf16 / f64 gradients are upcast
        x = x.contiguous().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ConfigError(f"{what} must hold floating-point values, not {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.float32)


def _torch() -> Any:
    import torch

    return torch


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
        self._kernels: dict[str, Any] = {}
        if target in ("cpu", "cuda"):
            self._kernel(target)  # build now, so a broken toolchain fails at construction

    def _kernel(self, target: str) -> Any:
        if target not in self._kernels:
            from compll.loaders import load_kernel

            self._kernels[target] = load_kernel(self.program, target)
        return self._kernels[target]

    def _backend(self, on_gpu: bool) -> str:
        if on_gpu and self.target in ("cpu", "ref"):
            raise ConfigError(f"the data is on the GPU but this codec's target is "
                              f"{self.target!r}; use target='cuda' or 'auto'")
        if not on_gpu and self.target == "cuda":
            raise ConfigError("target='cuda' needs CUDA tensors; move the data with .cuda() "
                              "or use target='auto'")
        if self.target == "auto":
            return "cuda" if on_gpu else "cpu"
        return self.target

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.program.param_values)

    def __repr__(self) -> str:
        params = compiler.describe_params(self.program)
        sep = ", " if params else ""
        return f"Codec({self.name!r}, target={self.target!r}, seed={self.seed}{sep}{params})"

    @property
    def unbiased(self) -> bool:
        """Whether the algorithm declares its decoded values unbiased estimates."""
        return bool(self.program.unbiased)

    def max_payload_bytes(self, n: int) -> int:
        """An upper bound on the payload size for ``n`` elements (exact for fixed layouts).

        Example:
            >>> buf = np.empty(c.max_payload_bytes(len(x)), np.uint8)  # fits any payload
        """
        from compll.loaders import payload_size_hint

        return payload_size_hint(self.program, int(n), int(n))

    def encode(self, x: Any, step: int | None = None, out: Any = None,
               residual: Any = None) -> Any:
        """Compress a gradient.

        Args:
            x: a float array, CPU tensor or (targets ``auto``/``cuda``) CUDA tensor;
                flattened, and upcast when not float32.
            step: the RNG step; by default the codec's own counter, which then advances.
            out: an optional uint8 buffer (array, or CUDA tensor for CUDA input) to write
                the payload into when it fits, so a caller can reuse one buffer per tensor;
                the payload returned is then a view of its first bytes. Ignored by
                target ``"ref"``.
            residual: error feedback's residual, a contiguous float32 array (CUDA tensor
                for CUDA input) of x's size: ``x`` is added into it in place
                (``residual += x``, in the kernel) and the payload is that of the sum.

        Returns:
            The payload: a 1-D uint8 array, or a uint8 CUDA tensor for CUDA input.
        """
        _check_count(int(x.numel()) if _is_torch(x) else np.size(x))
        if step is None:
            step = self.step
            self.step = (self.step + 1) & 0xFFFFFFFF
        step &= 0xFFFFFFFF
        if _is_cuda(x):
            self._backend(on_gpu=True)
            flat = x.detach().reshape(-1)
            if flat.dtype != _torch().float32:
                flat = flat.float()
            flat = flat.contiguous()
            if residual is not None:
                _check_buffer(residual, flat.numel(), "residual=", cuda=True)
            return self._kernel("cuda").encode(flat, self.seed, step, out, residual)
        data = _as_float32(x, "the gradient")
        backend = self._backend(on_gpu=False)
        res = None if residual is None else _check_buffer(residual, data.size, "residual=")
        if backend == "ref":
            if res is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    np.add(res, data, out=res)
                data = res
            return interpreter.encode(self.program, data, self.seed, step)
        into = None
        if out is not None:
            into = out.numpy() if _is_torch(out) else out
            if not isinstance(into, np.ndarray) or into.dtype != np.uint8 \
                    or not into.flags.c_contiguous:
                raise ConfigError("out= must be a contiguous uint8 array")
            into = into.reshape(-1)
        return self._kernel(backend).encode(data, self.seed, step, into, res)

    def decode(self, payload: Any, n: int, out: Any = None, accumulate: bool = False,
               scale: float = 1.0, feedback: bool = False) -> Any:
        """Decompress a payload of ``n`` elements.

        Args:
            payload: bytes, a uint8 array or tensor from ``encode`` (any codec instance with
                the same algorithm and parameters).
            n: the element count the caller expects; a mismatch is a PayloadError.
            out: an optional contiguous float32 array or tensor of ``n`` elements.
            accumulate: add the decoded values to ``out`` instead of overwriting it.
            scale: multiply the decoded values by this float32 first, in the same pass
                (``1 / world`` averages a sum; ``-1`` with ``accumulate`` subtracts).
            feedback: error feedback's update of its residual ``out``: accumulate, and set
                each non-finite result to 0 (so a NaN gradient does not poison later
                steps). Needs ``out``.

        Returns:
            ``out`` if given, else a new float32 array (a CUDA tensor for CUDA payloads).

        Raises:
            PayloadError: if the payload is malformed, truncated or from another codec;
                ``out`` is left as it was.
        """
        n = int(n)
        _check_count(n)
        scale = float(np.float32(scale))
        if (accumulate or feedback) and out is None:
            raise ConfigError("accumulate=True and feedback=True need out= to add into")
        if _is_cuda(payload):
            self._backend(on_gpu=True)
            torch = _torch()
            target = torch.empty(n, dtype=torch.float32, device=payload.device) \
                if out is None else _check_buffer(out, n, "out=", cuda=True)
            self._kernel("cuda").decode(payload.reshape(-1), n, target, accumulate, scale,
                                        feedback)
            return target
        buf = _as_payload(payload)
        backend = self._backend(on_gpu=False)
        dest = None if out is None else _check_buffer(out, n, "out=")
        if backend == "ref":
            values = interpreter.decode(self.program, buf, n)
            with np.errstate(invalid="ignore", over="ignore"):  # as quiet as the kernels
                if scale != 1.0:
                    values = values * np.float32(scale)
                if dest is None:
                    return values
                if accumulate or feedback:
                    dest += values
                else:
                    dest[...] = values
                if feedback:
                    dest[~np.isfinite(dest)] = 0.0
            return out
        if dest is None:
            dest = np.empty(n, dtype=np.float32)
            out = dest
        self._kernel(backend).decode(np.ascontiguousarray(buf), n, dest, accumulate, scale,
                                     feedback)
        return out


def _check_buffer(x: Any, n: int, what: str, cuda: bool = False) -> Any:
    """``x`` (``out=``, ``residual=``) as a flat contiguous float32 array, or CUDA tensor,
    of ``n`` elements, used in place; anything else is a ConfigError."""
    if cuda:
        if not (_is_cuda(x) and x.dtype == _torch().float32 and x.numel() == n
                and x.is_contiguous()):
            raise ConfigError(f"{what} must be a contiguous float32 CUDA tensor of {n} elements")
        return x
    arr = x.numpy() if _is_torch(x) else x
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.size != n \
            or not arr.flags.c_contiguous:
        raise ConfigError(f"{what} must be a contiguous float32 array of {n} elements")
    return arr.reshape(-1)


def _as_payload(payload: Any) -> np.ndarray:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=np.uint8)
    if _is_torch(payload):
        payload = payload.detach().cpu().numpy()
    arr = np.asarray(payload)
    if arr.dtype != np.uint8:
        raise PayloadError(f"a payload is a uint8 array, not {arr.dtype}")
    return arr.reshape(-1)


def codec(name_or_path: str | os.PathLike[str], target: str = "auto", seed: int = 0,
          **params: Any) -> Codec:
    """Build a codec for a shipped algorithm or a ``.cll`` file.

    Args:
        name_or_path: an algorithm name from ``algorithms()`` or a path to a ``.cll`` file.
        target: ``"auto"`` (CUDA tensors on the GPU, everything else on the CPU),
            ``"cpu"``, ``"cuda"``, or ``"ref"`` for the NumPy reference interpreter.
            Kernels are compiled on first use and cached (see ``compll.build``).
        seed: the RNG seed of stochastic algorithms.
        **params: overrides of the algorithm's ``param`` declarations.

    Returns:
        A ``Codec``.

    Raises:
        ConfigError: unknown algorithm, target or parameter, or a failed ``require``.
        CompileError: the DSL file does not parse or check, or a kernel fails to build.

    Example:
        >>> c = hipress.codec("dgc", ratio=0.01)
        >>> y = c.decode(c.encode(x), len(x))
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; available: {', '.join(TARGETS)}")
    return Codec(compiler.load(name_or_path, **params), target, seed)
