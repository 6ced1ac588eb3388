"""The DSL's arithmetic in NumPy, exactly C's on IEEE float32 and two's-complement
32-bit integers (``docs/compll.md``, "Semantics"): casts, element-wise builtins, the
fixed-order float sums and block reductions, bit packing. The reference interpreter
(``compll.interpreter``) evaluates programs with these; the kernels must match them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .builtins import BUILTINS, Kind
from .constants import SUM_BLOCK, SUM_CHUNK, SUM_LANES
from .typing_rules import DTYPES

__all__ = ["Packed", "cast", "elementwise", "reduce", "block_reduce", "pack", "unpack",
           "sort_order", "CANONICAL_NAN"]

_INT_RANGE = {"i32": (-(2**31), 2**31 - 1), "u32": (0, 2**32 - 1), "u8": (0, 255)}


@dataclass
class Packed:
    """A bit-packed array: ``count`` values of ``bits`` bits, LSB-first in ``data``."""

    data: np.ndarray
    bits: int
    count: int


# -- scalar semantics ------------------------------------------------------------------------

def cast(value: Any, to: str) -> np.ndarray:
    """Convert with C semantics: saturating float-to-int, NaN to 0, wrapping int-to-int."""
    x = np.asarray(value)
    dtype = DTYPES[to]
    if to == "bool":
        return x != 0
    if x.dtype.kind == "f" and to in _INT_RANGE:
        lo, hi = _INT_RANGE[to]
        wide = np.trunc(x.astype(np.float64))
        wide = np.where(np.isnan(wide), 0.0, np.clip(wide, lo, hi))
        return wide.astype(np.int64).astype(dtype)
    if x.dtype == np.bool_:
        return x.astype(dtype)
    if x.dtype.kind in "iu" and to in _INT_RANGE:
        return x.astype(np.int64).astype(dtype)  # wraps modulo 2**bits
    if to == "f16":
        return _to_f16(x)
    if x.dtype == np.float16:
        return _from_f16(x, dtype)
    return x.astype(dtype)


def _to_f16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even; NaN becomes the quiet NaN of its sign (0x7E00)."""
    h = x.astype(np.float16)
    if np.isnan(h).any():
        sign = (np.asarray(x, np.float32).view(np.uint32) >> np.uint32(16)) & np.uint32(0x8000)
        bits = np.where(np.isnan(x), (sign | np.uint32(0x7E00)).astype(np.uint16),
                        h.view(np.uint16))
        h = bits.astype(np.uint16).view(np.float16)
    return h


def _from_f16(x: np.ndarray, dtype: type) -> np.ndarray:
    """Exact widening; a NaN keeps its payload and gets its quiet bit."""
    out = x.astype(np.float32)
    if np.isnan(out).any():
        bits = out.view(np.uint32) | np.where(np.isnan(out), np.uint32(0x400000), np.uint32(0))
        out = bits.astype(np.uint32).view(np.float32)
    return out.astype(dtype)


def elementwise(fn: str, args: list[np.ndarray], operand: str) -> np.ndarray:
    """Apply a scalar builtin (``abs``, ``sign``, ``exponent``...) elementwise."""
    spec = BUILTINS[fn]
    assert spec.kind is Kind.ELEMENTWISE and spec.numpy is not None
    return spec.numpy(operand, *(cast(a, operand) for a in args))


# -- reductions ------------------------------------------------------------------------------

def _sum_f32(x: np.ndarray) -> np.float32:
    """The defined order of a float sum.

    The array is split into chunks of SUM_CHUNK elements and each chunk into blocks of
    SUM_BLOCK. Lane l (0..31) owns elements l, l+32, l+64, ... In each block, a lane adds
    its 16 elements in f32, in order, starting from 0; the block's partial is widened to
    f64 and added to the lane's f64 total. Then adjacent lanes add pairwise, (l0+l1),
    (l2+l3), ..., up the tree to one value per chunk; chunk results add in order,
    starting from 0, and the total rounds once to f32. On the CPU the 32 lanes are four
    vectors: f32 adds run at load speed and one widening per 16 elements is cheap.
    """
    n = x.size
    if n == 0:
        return np.float32(0.0)
    chunks = -(-n // SUM_CHUNK)
    padded = np.zeros(chunks * SUM_CHUNK, dtype=np.float32)  # +0 pads change no partial
    padded[:n] = x
    return np.float32(np.cumsum(_lane_trees(padded.reshape(chunks, SUM_CHUNK)))[-1])


def _lane_trees(rows: np.ndarray) -> np.ndarray:
    """The f64 total of each row (a chunk, whole SUM_BLOCKs long) in the defined order:
    lanes add each block's elements in f32, widen into f64 totals, then pair up a tree."""
    count, width = rows.shape
    steps = SUM_BLOCK // SUM_LANES
    groups = rows.reshape(count, width // SUM_BLOCK, steps, SUM_LANES)
    partial = np.zeros((count, width // SUM_BLOCK, SUM_LANES), dtype=np.float32)
    for j in range(steps):
        partial += groups[:, :, j, :]
    acc = np.zeros((count, SUM_LANES), dtype=np.float64)
    for b in range(width // SUM_BLOCK):
        acc += partial[:, b, :].astype(np.float64)
    while acc.shape[1] > 1:
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


#: The NaN every reduction returns (backends differ in the NaN bits arithmetic makes).
CANONICAL_NAN = np.uint32(0x7FC00000).view(np.float32)


def _canonical(r: np.float32) -> np.ndarray:
    return np.asarray(CANONICAL_NAN if np.isnan(r) else r, dtype=np.float32)


def reduce(op: str, x: np.ndarray, out: str) -> np.ndarray:
    """Reduce an array with sum, max or min (see the language reference)."""
    if op == "sum":
        if x.dtype.kind == "f":
            return _canonical(_sum_f32(x.astype(np.float32)))
        return cast(np.asarray(int(x.astype(np.int64).sum())) % (1 << 32), out)
    if x.dtype.kind == "f":
        x = x.astype(np.float32)
        if x.size == 0:
            return np.asarray(np.float32(-np.inf if op == "max" else np.inf))
        r = np.fmax.reduce(x) if op == "max" else np.fmin.reduce(x)
        return _canonical(np.float32(0.0) if r == 0 else np.float32(r))  # ties at 0 give +0
    if x.size == 0:
        info = np.iinfo(x.dtype)
        return np.asarray(info.min if op == "max" else info.max, dtype=x.dtype)
    return np.asarray(x.max() if op == "max" else x.min())


def _block_sum_f32(x: np.ndarray, block: int) -> np.ndarray:
    """``_sum_f32`` of every block of ``block`` elements, vectorised over blocks.

    A block of at most SUM_CHUNK elements is one chunk; it is padded with zeros to whole
    SUM_BLOCKs only, since the zero blocks a chunk's padding would add contribute +0 to
    lanes that are never -0."""
    count = -(-x.size // block)
    if block > SUM_CHUNK:
        return np.array([_sum_f32(x[k * block:(k + 1) * block]) for k in range(count)],
                        dtype=np.float32)
    width = -(-block // SUM_BLOCK) * SUM_BLOCK
    padded = np.zeros((count, width), dtype=np.float32)
    flat = np.zeros(count * block, dtype=np.float32)
    flat[:x.size] = x
    padded[:, :block] = flat.reshape(count, block)
    return (0.0 + _lane_trees(padded)).astype(np.float32)


def block_reduce(op: str, x: np.ndarray, block: int, out: str) -> np.ndarray:
    """``reduce`` of every block of ``block`` elements (0: one block of all); the last
    block may be short. Each block reduces as an array of its own."""
    if block == 0 or x.size == 0:
        one = reduce(op, x, out)
        return np.atleast_1d(one).astype(one.dtype) if block == 0 else \
            np.zeros(0, dtype=one.dtype)
    count = -(-x.size // block)
    if op == "sum" and x.dtype.kind == "f":
        r = _block_sum_f32(x.astype(np.float32), block)
        return np.where(np.isnan(r), CANONICAL_NAN, r).astype(np.float32)
    if op == "sum":
        flat = np.zeros(count * block, dtype=np.int64)
        flat[:x.size] = x.astype(np.int64)
        return cast(flat.reshape(count, block).sum(axis=1) % (1 << 32), out)
    if x.dtype.kind == "f":
        flat = np.full(count * block, np.nan, dtype=np.float32)  # NaN never wins
        flat[:x.size] = x
        rows = flat.reshape(count, block)
        with np.errstate(invalid="ignore"):
            r = np.fmax.reduce(rows, axis=1) if op == "max" else np.fmin.reduce(rows, axis=1)
        r = np.where(r == 0, np.float32(0.0), r)  # ties at 0 give +0
        return np.where(np.isnan(r), CANONICAL_NAN, r).astype(np.float32)
    info = np.iinfo(x.dtype)
    flat = np.full(count * block, info.min if op == "max" else info.max, dtype=x.dtype)
    flat[:x.size] = x
    rows = flat.reshape(count, block)
    return rows.max(axis=1) if op == "max" else rows.min(axis=1)


def sort_order(key: np.ndarray, descending: bool) -> np.ndarray:
    """Stable order of keys (widened to f64, exact for every CompLL type); NaN goes last."""
    wide = key.astype(np.float64)
    return np.argsort(-wide if descending else wide, kind="stable")


# -- pack / unpack ---------------------------------------------------------------------------

def pack(values: np.ndarray, bits: int) -> Packed:
    """Keep the low ``bits`` of each value; element i starts at bit i*bits, LSB first."""
    v = (values.astype(np.uint64) & np.uint64((1 << bits) - 1)).astype(np.uint8)
    count = v.size
    per_byte = 8 // bits
    padded = np.zeros(-(-count // per_byte) * per_byte, dtype=np.uint8)
    padded[:count] = v
    groups = padded.reshape(-1, per_byte).astype(np.uint16)
    shifts = (np.arange(per_byte, dtype=np.uint16) * bits)
    data = (groups << shifts).sum(axis=1, dtype=np.uint16).astype(np.uint8)
    return Packed(data, bits, count)


def unpack(p: Packed) -> np.ndarray:
    per_byte = 8 // p.bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * p.bits)
    vals = (p.data[:, None] >> shifts) & np.uint8((1 << p.bits) - 1)
    return vals.reshape(-1)[: p.count].astype(np.uint8)
