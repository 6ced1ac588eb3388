"""The reference interpreter: runs any checked program with NumPy.

It is the oracle for every backend, so its arithmetic is exactly C's on IEEE
float32 and two's-complement 32-bit integers (``compll.semantics``; ``docs/compll.md``,
"Semantics"): no fused multiply-add, integer division truncates, out-of-range
float-to-int casts saturate (NaN gives 0), and float sums use the fixed order of 32
lanes, 512-element blocks and 8192-element chunks described in ``semantics._sum_f32``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hipress_base.errors import PayloadError

from . import ir, payload, rng
from .builtins import BUILTINS, OPERATORS, Kind
from .constants import NONFINITE, SUM_BLOCK, SUM_CHUNK, SUM_LANES
from .ir import LengthKind, TypeKind
from .semantics import (
    Packed,
    block_reduce,
    cast,
    elementwise,
    pack,
    reduce,
    sort_order,
    unpack,
)
from .typing_rules import DTYPES, promote_one

__all__ = ["Packed", "encode", "decode", "eval_constant", "SUM_CHUNK", "SUM_LANES", "SUM_BLOCK"]

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
        order = sort_order(self.keyed(e, a), descending)
        return self.indexed(e, order, a[order])

    def op_topk(self, e: ir.Call) -> Any:
        a = self.eval(e.args[0])
        k = int(np.clip(np.asarray(self.eval(e.args[1]), dtype=np.int64), 0, a.size))
        order = sort_order(self.keyed(e, a), descending=True)  # ties by lower index
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
