"""The buffers a ``Codec`` reads and writes: NumPy arrays and torch tensors (CPU or
CUDA) checked, flattened and addressed for the kernels, and payloads framed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError, PayloadError

from .constants import FEEDBACK, MAX_ELEMENTS
from .loaders import ENCODE_ITEM

__all__ = ["check_count", "is_torch", "is_cuda", "as_float32", "torch_module", "numel", "ptr",
           "float_input", "encode_items", "byte_buffer", "check_buffer", "as_payload"]


def check_count(n: int) -> None:
    if n > MAX_ELEMENTS:
        raise ConfigError(f"{n:,} elements is more than one encode or decode takes "
                          f"({MAX_ELEMENTS:,}, CompLL's u32 element count); split the tensor "
                          "and encode the pieces")


def is_torch(x: Any) -> bool:
    """A torch tensor, told apart without importing torch."""
    return type(x).__module__.startswith("torch")


def is_cuda(x: Any) -> bool:
    return is_torch(x) and x.device.type == "cuda"


def as_float32(x: Any, what: str) -> np.ndarray:
    """A 1-D float32 NumPy view (or copy) of an array or CPU torch tensor."""
    if is_torch(x):
        x = x.detach()
        if x.dtype != torch_module().float32:
            x = x.float()  # fp16 / bf16 / f64 gradients are upcast
        x = x.contiguous().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise ConfigError(f"{what} must hold floating-point values, not {arr.dtype}")
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.float32)


def torch_module() -> Any:
    import torch

    return torch


def numel(x: Any) -> int:
    return int(x.numel()) if is_torch(x) else int(np.size(x))


def ptr(x: Any) -> int:
    return int(x.data_ptr()) if is_torch(x) else int(x.ctypes.data)


def float_input(x: Any, cuda: bool) -> Any:
    """A segment's input as the kernels read it: contiguous float32, without a copy when
    it already is one."""
    if cuda:
        flat = x.detach().reshape(-1)
        return (flat if flat.dtype == torch_module().float32 else flat.float()).contiguous()
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
        return x.reshape(-1)
    return as_float32(x, "the gradient")


def encode_items(xs: Sequence[Any], res: list[Any], caps: list[int], steps: Sequence[int],
                  base: int, feedback: bool, cuda: bool) -> np.ndarray:
    """The rows of a batched encode: each segment's input, residual, size, output slot
    (payloads end to end from address ``base``), capacity, RNG step and flags. The rows
    hold addresses only: ``xs`` must be contiguous float32 already (``float_input``),
    kept alive by the caller until the kernels have run."""
    items = np.zeros(len(xs), ENCODE_ITEM)
    if not len(xs):
        return items
    data = [float_input(x, cuda) for x in xs]
    if any(d is not x and ptr(d) != ptr(x) for d, x in zip(data, xs, strict=True)):
        raise ConfigError("encode_items takes contiguous float32 inputs (float_input): a "
                          "copy made here would be freed before the kernels read it")
    items["g"] = [ptr(x) for x in data]
    items["r"] = [0 if r is None else ptr(check_buffer(r, x.size if not cuda else x.numel(),
                                                         "residual=", cuda))
                  for r, x in zip(res, data, strict=True)]
    items["n"] = [numel(x) for x in data]
    items["out"] = base + np.cumsum([0, *caps[:-1]], dtype=np.uint64)
    items["cap"] = caps
    items["step"] = steps
    items["flags"] = FEEDBACK if feedback else 0
    return items


def byte_buffer(out: Any, size: int, like: Any) -> Any:
    """``out`` as a flat uint8 buffer of at least ``size`` bytes, or a new one."""
    if like is not None:  # CUDA
        if out is not None and out.numel() >= size:
            return out.reshape(-1)
        return torch_module().empty(max(size, 1), dtype=torch_module().uint8, device=like.device)
    if out is not None:
        into = out.numpy() if is_torch(out) else out
        if not isinstance(into, np.ndarray) or into.dtype != np.uint8 \
                or not into.flags.c_contiguous:
            raise ConfigError("out= must be a contiguous uint8 array")
        if into.size >= size:
            return into.reshape(-1)
    return np.empty(max(size, 1), np.uint8)


def check_buffer(x: Any, n: int, what: str, cuda: bool = False) -> Any:
    """``x`` (``out=``, ``residual=``) as a flat contiguous float32 array, or CUDA tensor,
    of ``n`` elements, used in place; anything else is a ConfigError."""
    if cuda:
        if not (is_cuda(x) and x.dtype == torch_module().float32 and x.numel() == n
                and x.is_contiguous()):
            raise ConfigError(f"{what} must be a contiguous float32 CUDA tensor of {n} elements")
        return x
    arr = x.numpy() if is_torch(x) else x
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.size != n \
            or not arr.flags.c_contiguous:
        raise ConfigError(f"{what} must be a contiguous float32 array of {n} elements")
    return arr.reshape(-1)


def as_payload(payload: Any) -> np.ndarray:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return np.frombuffer(payload, dtype=np.uint8)
    if is_torch(payload):
        payload = payload.detach().cpu().numpy()
    arr = np.asarray(payload)
    if arr.dtype != np.uint8:
        raise PayloadError(f"a payload is a uint8 array, not {arr.dtype}")
    return arr.reshape(-1)
