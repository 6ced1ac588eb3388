"""The reference interpreter: runs any checked program with NumPy.

It is the oracle for every backend, so its arithmetic is exactly C's on IEEE
float32 and two's-complement 32-bit integers (see ``docs/compll.md``, "Semantics"):
no fused multiply-add, integer division truncates, out-of-range float-to-int casts
saturate (NaN gives 0), and float sums use the fixed order of 32 lanes, 512-element
blocks and 8192-element chunks described in ``_sum_f32``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hipress_base.errors import PayloadError

from . import ir, payload, rng
from .builtins import BUILTINS, OPERATORS, Kind
from .constants import NONFINITE, SUM_BLOCK, SUM_CHUNK, SUM_LANES
from .ir import LengthKind, TypeKind
from .typing_rules import DTYPES, promote_one

__all__ = ["Packed", "encode", "decode", "eval_constant", "SUM_CHUNK", "SUM_LANES", "SUM_BLOCK"]

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


def _sort_order(key: np.ndarray, descending: bool) -> np.ndarray:
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


# -- the evaluator ---------------------------------------------------------------------------

class _Frame:
    def __init__(self, params: dict[str, Any], seed: int = 0, step: int = 0,
                 decoding: bool = False, sections: tuple = ()) -> None:
        self.params = params
        self.env: dict[str, Any] = {}
        self.sections = sections  # what extract returns, in decode
        self.seed = seed
        self.step = step
        self.decoding = decoding
        self.index: np.ndarray | None = None  # element indices inside a map lambda
        self.n = 0  # the tensor's length
        self.counts: dict[ir.Length, int] = {}  # lengths cut into blocks, as evaluated

    def eval(self, e: ir.Expr) -> Any:
        method: Callable[[Any], Any] = getattr(self, "eval_" + type(e).__name__.lower())
        return method(e)

    def as_elem(self, e: ir.Expr, elem: str) -> np.ndarray:
        return cast(self.eval(e), elem)

    def eval_const(self, e: ir.Const) -> np.ndarray:
        assert e.ty is not None
        if e.ty.literal and isinstance(e.value, int):
            return np.asarray(e.value, dtype=np.int64)  # adapts to the other operand
        return np.asarray(e.value, dtype=DTYPES[e.ty.elem])

    def eval_var(self, e: ir.Var) -> Any:
        if e.name in self.env:
            return self.env[e.name]
        assert e.ty is not None
        return np.asarray(self.params[e.name], dtype=DTYPES[e.ty.elem])

    def eval_unary(self, e: ir.Unary) -> np.ndarray:
        assert e.ty is not None
        if e.op == "not":
            return ~self.as_elem(e.operand, "bool")
        return -self.as_elem(e.operand, e.ty.elem)

    def eval_binary(self, e: ir.Binary) -> np.ndarray:
        assert e.ty is not None and e.left.ty is not None and e.right.ty is not None
        op = OPERATORS[e.op]
        left, right = op.operand_types(e.ty.elem, e.left.ty, e.right.ty)
        return np.asarray(op.numpy(self.as_elem(e.left, left), self.as_elem(e.right, right),
                                   left))

    def eval_select(self, e: ir.Select) -> np.ndarray:
        assert e.ty is not None
        cond = self.as_elem(e.cond, "bool")
        return np.where(cond, self.as_elem(e.then, e.ty.elem), self.as_elem(e.other, e.ty.elem))

    def apply(self, lam: ir.Expr, arrays: list[np.ndarray], index: np.ndarray) -> np.ndarray:
        assert isinstance(lam, ir.Lambda) and lam.ty is not None
        saved = {p: self.env.get(p) for p in lam.params}
        saved_index = self.index
        for p, a, t in zip(lam.params, arrays, lam.param_types, strict=True):
            self.env[p] = a.astype(DTYPES[t.elem], copy=False)
        self.index = index
        try:
            out = self.as_elem(lam.body, lam.ty.elem)
        finally:
            self.index = saved_index
            for p, v in saved.items():
                if v is None:
                    self.env.pop(p, None)
                else:
                    self.env[p] = v
        return np.broadcast_to(out, index.shape).copy()

    def keyed(self, e: ir.Call, x: np.ndarray) -> np.ndarray:
        key = e.kwarg("key")
        return x if key is None else self.apply(key, [x], np.arange(x.size, dtype=np.uint64))

    def eval_call(self, e: ir.Call) -> Any:
        assert e.ty is not None
        fn = e.fn
        kind = BUILTINS[fn].kind
        if kind is Kind.CAST:
            return cast(self.eval(e.args[0]), fn)
        if kind is Kind.ELEMENTWISE:
            assert e.operand_ty is not None
            args = [self.eval(a) for a in e.args]
            return cast(elementwise(fn, args, e.operand_ty.elem), e.ty.elem)
        method: Callable[[ir.Call], Any] = getattr(self, "op_" + fn)
        return method(e)

    def op_size(self, e: ir.Call) -> np.ndarray:
        a = self.eval(e.args[0])
        return np.asarray(a.count if isinstance(a, Packed) else a.size, dtype=np.uint32)

    def op_iota(self, e: ir.Call) -> np.ndarray:
        k = int(self.eval(e.args[0]))
        return np.arange(max(k, 0), dtype=np.uint32)

    def op_map(self, e: ir.Call) -> np.ndarray:
        arrays = [self.eval(a) for a in e.args[:-1]]
        return self.apply(e.args[-1], arrays, np.arange(arrays[0].size, dtype=np.uint64))

    def op_reduce(self, e: ir.Call) -> np.ndarray:
        assert e.ty is not None and isinstance(e.args[1], ir.Var)
        x = self.keyed(e, self.eval(e.args[0]))
        if e.ty.kind is TypeKind.ARRAY:
            length = e.ty.length
            assert length is not None and length.base is not None
            self.counts[length.base] = x.size
            return block_reduce(e.args[1].name, x, length.value, e.ty.elem)
        return reduce(e.args[1].name, x, e.ty.elem)

    def op_expand(self, e: ir.Call) -> np.ndarray:
        (r,) = e.args
        assert r.ty is not None and r.ty.length is not None and e.ty is not None
        values = self.eval(r)
        n = self.length(e)
        block = r.ty.length.value
        if not block:
            return np.repeat(values, n)
        return np.repeat(values, block)[:n]

    def length(self, e: ir.Expr) -> int:
        """The element count of expand's result: that of the array its blocks cut."""
        assert isinstance(e, ir.Call) and e.fn == "expand"
        (r,) = e.args
        assert r.ty is not None and r.ty.length is not None
        return self.count_of(r.ty.length.base)

    def count_of(self, length: ir.Length | None) -> int:
        assert length is not None
        if length.kind is LengthKind.N:
            return self.n
        if length.kind is LengthKind.CONST:
            return length.value
        return self.counts[length]  # a run-time length some reduce cut into blocks

    def indexed(self, e: ir.Call, idx: np.ndarray, values: np.ndarray) -> Any:
        idx = idx.astype(np.uint32)
        assert e.ty is not None
        return (idx, values) if e.ty.kind is TypeKind.TUPLE else values

    def op_filter(self, e: ir.Call) -> Any:
        a = self.eval(e.args[0])
        keep = self.apply(e.args[1], [a], np.arange(a.size, dtype=np.uint64)).astype(bool)
        idx = np.flatnonzero(keep)
        return self.indexed(e, idx, a[idx])

    def op_sort(self, e: ir.Call) -> Any:
        a = self.eval(e.args[0])
        desc = e.kwarg("descending")
        descending = isinstance(desc, ir.Const) and bool(desc.value)
        order = _sort_order(self.keyed(e, a), descending)
        return self.indexed(e, order, a[order])

    def op_topk(self, e: ir.Call) -> Any:
        a = self.eval(e.args[0])
        k = int(np.clip(np.asarray(self.eval(e.args[1]), dtype=np.int64), 0, a.size))
        order = _sort_order(self.keyed(e, a), descending=True)  # ties by lower index
        idx = np.sort(order[:k])
        return self.indexed(e, idx, a[idx])

    def random_key(self, e: ir.Call) -> int:
        return rng.stream_key(self.seed, self.step, e.stream)

    def op_random(self, e: ir.Call) -> np.ndarray:
        assert self.index is not None
        return rng.uniform(self.random_key(e), self.index)

    def op_randint(self, e: ir.Call) -> np.ndarray:
        assert self.index is not None
        hi = self.as_elem(e.args[0], "u32")
        return rng.randint(self.random_key(e), self.index, hi)

    def op_gather(self, e: ir.Call) -> np.ndarray:
        a, idx = self.eval(e.args[0]), self.eval(e.args[1]).astype(np.int64)
        ok = (idx >= 0) & (idx < a.size)
        out = np.zeros(idx.size, dtype=a.dtype)
        out[ok] = a[idx[ok]]
        return out

    def op_scatter(self, e: ir.Call) -> np.ndarray:
        idx = self.eval(e.args[0]).astype(np.int64)
        vals = self.eval(e.args[1])
        size = int(self.eval(e.args[2]))
        ok = (idx >= 0) & (idx < size)
        if self.decoding and not ok.all():
            bad = int(idx[~ok][0])
            raise PayloadError(f"payload index {bad} is outside the tensor of {size} elements")
        out = np.zeros(size, dtype=vals.dtype)
        np.add.at(out, idx[ok], vals[ok])  # in index order, so duplicates add deterministically
        return out

    def op_pack(self, e: ir.Call) -> Packed:
        assert e.ty is not None
        return pack(self.eval(e.args[0]), e.ty.bits)

    def op_unpack(self, e: ir.Call) -> np.ndarray:
        return unpack(self.eval(e.args[0]))

    def op_extract(self, e: ir.Call) -> tuple:
        return self.sections


def eval_constant(e: ir.Expr, params: dict[str, Any]) -> Any:
    """Evaluate a checked scalar expression over parameters (KeyError for other names)."""
    with np.errstate(all="ignore"):
        value = _Frame(params).eval(e)
    assert e.ty is not None
    return cast(value, promote_one(e.ty.elem) if e.ty.literal else e.ty.elem).item()


def _run(frame: _Frame, fn: ir.Function) -> Any:
    with np.errstate(all="ignore"):
        for stmt in fn.body:
            if isinstance(stmt, ir.Return):
                return stmt.value
            value = frame.eval(stmt.value)
            assert stmt.value.ty is not None
            if stmt.value.ty.kind is TypeKind.TUPLE:
                frame.env.update(zip(stmt.names, value, strict=True))
            else:
                frame.env[stmt.names[0]] = value
    raise AssertionError("checked functions end with return")  # pragma: no cover


def encode(program: ir.Program, x: np.ndarray, seed: int = 0, step: int = 0) -> np.ndarray:
    """Run ``encode`` on a 1-D float32 array; return the payload as uint8."""
    frame = _Frame(dict(program.param_values), seed & 0xFFFFFFFF, step & 0xFFFFFFFF)
    (gname, _), = program.encode.args
    frame.env[gname] = g = np.ascontiguousarray(x, dtype=np.float32)
    frame.n = x.size
    ret = _run(frame, program.encode)
    sections = []
    with np.errstate(all="ignore"):
        for item, section in zip(ret.args, program.layout, strict=True):
            value = frame.eval(item)
            if isinstance(value, Packed):
                sections.append(value.data)
            else:
                dtype = np.dtype(DTYPES[section.ty.elem]).newbyteorder("<")
                sections.append(np.atleast_1d(cast(value, section.ty.elem)).astype(dtype))
    flags = 0 if np.isfinite(g).all() else NONFINITE
    return payload.build(program, x.size, frame.seed, frame.step, sections, flags)


def decode(program: ir.Program, data: np.ndarray, n: int) -> np.ndarray:
    """Validate a payload and run ``decode``; return ``n`` float32 values."""
    header, raw, counts = payload.parse(program, data, n)
    if header.nonfinite:
        return np.full(n, np.nan, dtype=np.float32)
    values: list[Any] = []
    for section, buf, count in zip(program.layout, raw, counts, strict=True):
        ty = section.ty
        if ty.kind is TypeKind.PACKED:
            values.append(Packed(buf.copy(), ty.bits, count))
            continue
        dtype = np.dtype(DTYPES[ty.elem]).newbyteorder("<")
        arr: np.ndarray = np.frombuffer(buf.tobytes(), dtype=dtype).astype(DTYPES[ty.elem])
        values.append(np.asarray(arr[0]) if ty.kind is TypeKind.SCALAR else arr)
    frame = _Frame(dict(program.param_values), header.seed, header.step, decoding=True,
                   sections=tuple(values))
    (_, _), (nname, _) = program.decode.args
    frame.env[nname] = np.asarray(n, dtype=np.uint32)
    frame.n = n
    ret = _run(frame, program.decode)
    with np.errstate(all="ignore"):
        out = cast(frame.eval(ret), "f32")
    return np.ascontiguousarray(np.broadcast_to(out, (n,)), dtype=np.float32)
