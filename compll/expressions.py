"""Render CompLL expressions as C: the expression half of the C-style renderer.

``ExprRenderer`` turns a checked expression into a C expression, either a scalar or
element ``self.index`` of an array. It owns the operator table: typed literals,
CompLL's conversions, arithmetic with C's wrapping rules, the builtins, and the lazy
array operators (``map``, ``gather``, ``unpack``, ``iota``, ``random``). Expressions
made only of literals and parameters are folded by the interpreter; subexpressions that
are the same for every element are hoisted out of loops. ``compll.render`` walks the
schedule (``compll.schedule``) with it: statements, fused passes and the targets.
"""

from __future__ import annotations

import math
import re

import numpy as np

from . import ir
from .builtins import BUILTINS, OPERATORS, Kind
from .constants import MAX_STAGED
from .diagnostics import BuildError
from .interpreter import cast, eval_constant
from .schedule import ArrayInfo, Extent, extent_of
from .typing_rules import promote_one

__all__ = ["ExprRenderer", "MAX_STAGED"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SCALAR_FNS = (Kind.CAST, Kind.ELEMENTWISE)


class ExprRenderer:
    """Expressions of the C-style renderer; ``compll.render.CRenderer`` extends it."""

    target = ""
    template = ""
    #: whether a fused pass fills expand's per-element values into L1 chunk by chunk
    stage_expands = False
    #: how a host-side lambda that produces elements is introduced
    lam = "[&]"
    types = {"f32": "float", "f16": "hp_f16", "i32": "int32_t", "u32": "uint32_t",
             "u8": "uint8_t", "bool": "bool"}

    def __init__(self, program: ir.Program) -> None:
        self.program = program
        self.lines: list[str] = []
        self.arrays: dict[str, ArrayInfo] = {}  # the kernel's arrays
        self.scalars: dict[str, str] = {}  # DSL name -> C name
        self.lambda_vars: dict[str, str] = {}
        self.index: str | None = None  # the element index inside a map or key lambda
        self.streams: set[int] = set()
        self.uid = 0
        self.pass_stage: list[tuple[str, int]] = []  # packed arrays the open pass stages
        self.pass_expand: list[tuple[str, int]] = []  # (f32 array bytes, block) it expands
        self.block_bytes: dict[str, str] = {}  # one-value-per-block f32 arrays in memory
        # what a pass's prologue computes per chunk (compll.passes.fuse_blockwise)
        self.prologue_calls: dict[str, str] = {}  # block reductions' range calls
        self.prologue_fns: dict[str, str] = {}  # per-block lazy arrays' element functions
        self.stage_index: str | None = None  # the index of a staged element lambda
        self.hoisted: list[str] = []  # uniform values the next statement computes first

    # -- names and literals -----------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.uid += 1
        return f"{stem}{self.uid}"

    @staticmethod
    def safe(name: str) -> str:
        if not _NAME.match(name):  # the grammar guarantees this; never emit anything else
            raise BuildError(f"refusing to render the identifier {name!r}")
        return name

    def ctype(self, elem: str) -> str:
        return self.types[elem]

    def literal(self, value: int | float | bool, elem: str) -> str:
        """A typed C literal with exactly the value the interpreter computes."""
        v = cast(np.asarray(value), elem).item()
        if elem == "bool":
            return "true" if v else "false"
        if elem == "f32":
            if math.isnan(v):  # keep the exact bits (the sign of a NaN differs by origin)
                return f"hp_u2f(0x{int(np.float32(v).view(np.uint32)):08X}u)"
            if math.isinf(v):
                return "HP_INF" if v > 0 else "(-HP_INF)"
            return f"{float(v).hex()}f"
        if elem == "f16":
            return f"hp_f32_to_f16({self.literal(v, 'f32')})"
        if elem == "i32":
            return f"(int32_t){v}" if v >= 0 else f"(int32_t)(-{-v - 1} - 1)"
        return f"({self.ctype(elem)}){v}u"

    def zero(self, elem: str) -> str:
        return "hp_f16{0}" if elem == "f16" else f"({self.ctype(elem)})0"

    # -- conversions --------------------------------------------------------------------------
    def convert(self, code: str, src: str, dst: str) -> str:
        """Convert a C value of element type ``src`` to ``dst`` with CompLL semantics."""
        if src == dst:
            return code
        if dst == "bool":
            if src == "f16":
                code, src = f"hp_f16_to_f32({code})", "f32"
            return f"(({code}) != {self.zero(src)})"
        if src == "f16":
            return self.convert(f"hp_f16_to_f32({code})", "f32", dst)
        if dst == "f16":
            return f"hp_f32_to_f16({self.convert(code, src, 'f32')})"
        if src == "f32" and dst in ("i32", "u32", "u8"):
            return f"hp_f2{dst}({code})"
        return f"(({self.ctype(dst)})({code}))"

    def as_elem(self, e: ir.Expr, elem: str) -> str:
        assert e.ty is not None
        if isinstance(e, ir.Const) and e.ty.kind == "scalar":
            return self.literal(e.value, elem)
        if not isinstance(e, ir.Var) and self.invariant(e, locals_ok=False):
            # fold with the interpreter, so the value (a NaN's sign too) is the oracle's
            value = eval_constant(e, dict(self.program.param_values))
            src = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
            return self.convert(self.literal(value, src), src, elem)
        in_loop = self.index is not None
        if in_loop and not isinstance(e, ir.Var) and self.invariant(e, locals_ok=True):
            # the same for every element: compute it once, outside the loop
            src = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
            saved, self.index = self.index, None
            try:
                value = self.as_elem(e, src)
            finally:
                self.index = saved
            name = self.fresh("u")
            self.hoisted.append(f"const {self.ctype(src)} {name} = {value};")
            return self.convert(name, src, elem)
        return self.convert(self.expr(e), e.ty.elem, elem)

    def take_hoisted(self) -> list[str]:
        lines, self.hoisted = self.hoisted, []
        return lines

    def invariant(self, e: ir.Expr, locals_ok: bool) -> bool:
        """Whether a scalar expression is the same for every element of a loop.

        With ``locals_ok`` false it must also use only literals and parameters (so the
        interpreter can fold it); otherwise scalar locals and ``size`` count as well.
        """
        if e.ty is None or e.ty.kind != "scalar":
            return False
        if isinstance(e, ir.Const):
            return True
        if isinstance(e, ir.Var):
            if e.name in self.lambda_vars or e.name in self.arrays:
                return False
            return locals_ok or (e.name in dict(self.program.param_values)
                                 and e.name not in self.scalars)
        if isinstance(e, ir.Call):
            if e.fn == "size":
                return locals_ok
            return BUILTINS[e.fn].kind in _SCALAR_FNS and \
                all(self.invariant(a, locals_ok) for a in e.args)
        return all(self.invariant(c, locals_ok) for c in ir.operands(e))

    def expr(self, e: ir.Expr) -> str:
        """Render a scalar, or element ``self.index`` of an array."""
        method = getattr(self, "expr_" + type(e).__name__.lower())
        return method(e)

    def at(self, e: ir.Expr, index: str) -> str:
        """Render element ``index`` of an array-valued (or scalar, broadcast) expression."""
        saved, self.index = self.index, index
        try:
            return self.expr(e)
        finally:
            self.index = saved

    def expr_const(self, e: ir.Const) -> str:
        assert e.ty is not None
        elem = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
        return self.literal(e.value, elem)

    def expr_var(self, e: ir.Var) -> str:
        if e.name in self.lambda_vars:
            return self.lambda_vars[e.name]
        if e.name in self.arrays:
            arr = self.arrays[e.name]
            if arr.kind == "packed":
                raise BuildError(f"packed array {e.name!r} is only readable through unpack")
            if self.stage_expands and self.stage_index is not None and self.expands(e):
                assert arr.value is not None
                return self.expr(arr.value)  # inline, so its expand reads the pass's staging
            return f"a_{self.safe(e.name)}({self.index})"
        if e.name in self.scalars:
            return self.scalars[e.name]
        if e.name in dict(self.program.param_values):
            return f"p_{self.safe(e.name)}"
        raise BuildError(f"the renderer has no value for {e.name!r}")

    def expr_unary(self, e: ir.Unary) -> str:
        assert e.ty is not None
        if e.op == "not":
            return f"(!{self.as_elem(e.operand, 'bool')})"
        elem = e.ty.elem
        x = self.as_elem(e.operand, elem)
        if elem == "i32":
            return f"hp_neg_i32({x})"
        if elem == "u32":
            return f"(0u - {x})"
        return f"(-{x})"

    def expr_binary(self, e: ir.Binary) -> str:
        assert e.ty is not None and e.left.ty is not None and e.right.ty is not None
        op = OPERATORS[e.op]
        left, right = op.operand_types(e.ty.elem, e.left.ty, e.right.ty)
        return op.render_c(left, self.as_elem(e.left, left), self.as_elem(e.right, right))

    def expr_select(self, e: ir.Select) -> str:
        assert e.ty is not None
        c = self.as_elem(e.cond, "bool")
        a, b = self.as_elem(e.then, e.ty.elem), self.as_elem(e.other, e.ty.elem)
        return f"hp_sel<{self.ctype(e.ty.elem)}>({c}, {a}, {b})"

    def expr_lambda(self, e: ir.Lambda) -> str:
        raise BuildError("a lambda is rendered by the operator that applies it")

    def expr_call(self, e: ir.Call) -> str:
        assert e.ty is not None
        kind = BUILTINS[e.fn].kind
        if kind is Kind.CAST:
            x = e.args[0]
            assert x.ty is not None
            return self.convert(self.expr(x), x.ty.elem, e.fn)
        if kind is Kind.ELEMENTWISE:
            return self.elementwise(e)
        method = getattr(self, "call_" + e.fn, None)
        if method is None:
            raise BuildError(f"the {self.target} renderer cannot render {e.fn}() here")
        return method(e)

    def elementwise(self, e: ir.Call) -> str:
        assert e.operand_ty is not None and e.ty is not None
        spec = BUILTINS[e.fn]
        op = e.operand_ty.elem
        try:
            out = spec.render_c(op, [self.as_elem(a, op) for a in e.args], self.rint)
        except KeyError:
            raise BuildError(f"the renderer has no builtin {e.fn!r} for {op}") from None
        return self.convert(out, spec.result_of(op), e.ty.elem)

    rint = "nearbyintf"

    # element-producing operators, rendered at self.index
    def apply(self, lam: ir.Expr, values: list[str], index: str) -> str:
        """Render a lambda applied to element values, as an immediately invoked lambda."""
        assert isinstance(lam, ir.Lambda) and lam.ty is not None
        ix = self.fresh("ix")
        saved_vars, saved_index = dict(self.lambda_vars), self.index
        decls = []
        for name, value, ty in zip(lam.params, values, lam.param_types, strict=True):
            local = f"l_{self.safe(name)}{self.uid}"
            decls.append(f"const {self.ctype(ty.elem)} {local} = {value};")
            self.lambda_vars[name] = local
        self.index = ix
        try:
            body = self.as_elem(lam.body, lam.ty.elem)
        finally:
            self.lambda_vars, self.index = saved_vars, saved_index
        ret = self.ctype(lam.ty.elem)
        inner = " ".join(decls)
        return f"([&](uint64_t {ix}) -> {ret} {{ {inner} return {body}; }}({index}))"

    def call_map(self, e: ir.Call) -> str:
        assert self.index is not None
        values = [self.expr(a) for a in e.args[:-1]]
        return self.apply(e.args[-1], values, self.index)

    def expands(self, e: ir.Expr) -> bool:
        """Whether elements of ``e`` read ``expand`` of an array in memory, directly or
        through lazy arrays."""
        if isinstance(e, ir.Call):
            if e.fn == "expand":
                r = e.args[0]
                return isinstance(r, ir.Var) and r.name in self.block_bytes
            return any(self.expands(a) for a in e.args)
        if isinstance(e, ir.Lambda):
            return self.expands(e.body)
        if isinstance(e, ir.Var):
            arr = self.arrays.get(e.name)
            return (arr is not None and arr.value is not None and not arr.buffer
                    and e.name not in self.block_bytes and self.expands(arr.value))
        return any(self.expands(x) for x in ir.operands(e))

    def call_expand(self, e: ir.Call) -> str:
        (r,) = e.args
        assert r.ty is not None and r.ty.length is not None and self.index is not None
        block = r.ty.length.value
        if (self.stage_expands and self.stage_index is not None and self.index == self.stage_index
                and isinstance(r, ir.Var) and r.name in self.block_bytes):
            key = (self.block_bytes[r.name], block)
            if key in self.pass_expand or len(self.pass_expand) < MAX_STAGED:
                if key not in self.pass_expand:
                    self.pass_expand.append(key)
                return f"st.ex({self.pass_expand.index(key)}, {self.index})"
        # a gather: contiguous runs of one value that the compiler may not vectorise
        return self.at(r, f"((uint64_t)({self.index}) / {block}u)" if block else "(uint64_t)0")

    def call_iota(self, e: ir.Call) -> str:
        return f"((uint32_t)({self.index}))"

    def call_unpack(self, e: ir.Call) -> str:
        (p,) = e.args
        assert isinstance(p, ir.Var) and p.ty is not None
        src = f"pk_{self.safe(p.name)}"
        if self.stage_index is not None and self.index == self.stage_index:
            slot = self.stage_slot(src, p.ty.bits)
            if slot is not None:  # unpacked into L1 by the pass, chunk by chunk
                return f"st.get({slot}, {self.index})"
        return f"hp_unpack({src}, {self.index}, {p.ty.bits}u)"

    def stage_slot(self, src: str, bits: int) -> int | None:
        if (src, bits) not in self.pass_stage:
            if len(self.pass_stage) == MAX_STAGED:
                return None
            self.pass_stage.append((src, bits))
        return self.pass_stage.index((src, bits))

    def call_gather(self, e: ir.Call) -> str:
        a, idx = e.args
        assert e.ty is not None and idx.ty is not None
        j = self.fresh("j")
        elem = e.ty.elem
        inner = self.at(a, f"(uint64_t){j}")
        return (f"([&](int64_t {j}) -> {self.ctype(elem)} {{ return ({j} >= 0 && {j} < "
                f"(int64_t)({self.length(a)})) ? {inner} : {self.zero(elem)}; }}"
                f"((int64_t)({self.expr(idx)})))")

    def call_size(self, e: ir.Call) -> str:
        return f"((uint32_t)({self.length(e.args[0])}))"

    def call_random(self, e: ir.Call) -> str:
        self.streams.add(e.stream)
        return f"hp_uniform(key_{e.stream}, {self.index})"

    def call_randint(self, e: ir.Call) -> str:
        self.streams.add(e.stream)
        hi = e.args[0]
        if isinstance(hi, ir.Const) and type(hi.value) is int and 0 < hi.value < 2**32 \
                and hi.value & (hi.value - 1) == 0:
            # (h * 2^k) >> 32 is h >> (32 - k): a shift, not a 64-bit product per element
            k = hi.value.bit_length() - 1
            return f"(hp_hash(key_{e.stream}, {self.index}) >> {32 - k}u)" if k else "0u"
        return f"hp_randint(key_{e.stream}, {self.index}, {self.as_elem(e.args[0], 'u32')})"

    def length(self, e: ir.Expr) -> str:
        """A C expression for the element count of an array-valued expression."""
        try:
            return self.extent(extent_of(e, self.arrays))
        except KeyError as exc:
            raise BuildError(str(exc.args[0])) from None

    def extent(self, x: Extent) -> str:
        if x.kind == "n":
            return "n"
        if x.kind == "buffer":
            return f"a_{self.safe(x.name)}_len"
        if x.kind == "packed":
            return f"pk_{self.safe(x.name)}_len"
        if x.kind == "section":
            return f"cnt[{x.index}]"
        if x.kind == "blocks":
            assert x.base is not None
            return f"hp::blocks({self.extent(x.base)}, {x.block})"
        assert x.kind == "iota" and x.count is not None
        return f"(uint64_t)std::max<int64_t>(0, (int64_t)({self.expr(x.count)}))"
