"""Render CompLL expressions as C: the expression half of the C-style renderer.

``ExprRenderer`` turns a checked expression into a C expression, either a scalar or
element ``scope.index`` of an array. It owns the operator table: typed literals,
CompLL's conversions, arithmetic with C's wrapping rules, the builtins, and the lazy
array operators (``map``, ``gather``, ``unpack``, ``iota``, ``random``). Expressions
made only of literals and parameters are folded by the interpreter. It decides nothing:
where a loop stages its reads and which values leave the loops are the schedule's
(``compll.loops``); what an expression is rendered inside is a ``Scope`` passed down.
``compll.render`` walks the schedule (``compll.schedule``) with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from . import ir
from .builtins import BUILTINS, OPERATORS, Kind
from .diagnostics import BuildError
from .interpreter import eval_constant
from .ir import TypeKind
from .loops import uniform
from .schedule import ArrayInfo, ArrayKind, Extent, ExtentKind, Kernel, Pass, extent_of
from .semantics import cast
from .typing_rules import promote_one

__all__ = ["ExprRenderer", "Scope"]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Scope:
    """Where an expression is rendered: element ``index`` of a loop (None: once);
    ``staged``, the index of the fused ``loop`` whose element function this is (its
    staged reads apply there only); the C names of the lambda parameters in scope."""

    index: str | None = None
    staged: str | None = None
    loop: Pass | None = None
    lambdas: Mapping[str, str] = field(default_factory=dict)

    def at(self, index: str | None) -> Scope:
        return replace(self, index=index)

    @property
    def on_stage(self) -> bool:
        """At the fused pass's own element index (not inside a lambda or a gather)."""
        return self.staged is not None and self.index == self.staged


ONCE = Scope()


class ExprRenderer:
    """Expressions of the C-style renderer; ``compll.render.CRenderer`` extends it.

    One instance renders one kernel: its fields are the kernel's names (read only) and
    the output, ``lines``, with ``uid`` numbering the C locals it introduces.
    """

    target = ""
    template = ""
    #: how a host-side lambda that produces elements is introduced
    lam = "[&]"
    types = {"f32": "float", "f16": "hp_f16", "i32": "int32_t", "u32": "uint32_t",
             "u8": "uint8_t", "bool": "bool"}

    def __init__(self, program: ir.Program, kernel: Kernel) -> None:
        self.program = program
        self.kernel = kernel
        self.arrays: Mapping[str, ArrayInfo] = kernel.arrays
        self.params = dict(program.param_values)
        self.scalars = {name: self.scalar_name(name, kernel) for name in kernel.scalars}
        self.lines: list[str] = []
        self.uid = 0

    # -- names and literals -----------------------------------------------------------------
    def fresh(self, stem: str) -> str:
        self.uid += 1
        return f"{stem}{self.uid}"

    @staticmethod
    def safe(name: str) -> str:
        if not _NAME.match(name):  # the grammar guarantees this; never emit anything else
            raise BuildError(f"refusing to render the identifier {name!r}")
        return name

    @classmethod
    def scalar_name(cls, name: str, kernel: Kernel) -> str:
        """A scalar's C name: decode's n, a hoisted temporary ``%k`` (``h_k``) or a DSL
        local (``v_NAME``)."""
        if name == kernel.size_arg:
            return "((uint32_t)n)"
        if name.startswith("%") and name[1:].isdigit():
            return f"h_{name[1:]}"
        return f"v_{cls.safe(name)}"

    def ctype(self, elem: str) -> str:
        return self.types[elem]

    def emit(self, line: str) -> None:
        self.lines.append("  " + line)

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

    def as_elem(self, e: ir.Expr, elem: str, sc: Scope) -> str:
        assert e.ty is not None
        if isinstance(e, ir.Const) and e.ty.kind is TypeKind.SCALAR:
            return self.literal(e.value, elem)
        if not isinstance(e, ir.Var) and uniform(e, sc.lambdas, self.arrays, self.scalars,
                                                  self.params, locals_ok=False):
            # fold with the interpreter, so the value (a NaN's sign too) is the oracle's
            value = eval_constant(e, self.params)
            src = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
            return self.convert(self.literal(value, src), src, elem)
        return self.convert(self.expr(e, sc), e.ty.elem, elem)

    def expr(self, e: ir.Expr, sc: Scope) -> str:
        """Render a scalar, or element ``sc.index`` of an array."""
        method = getattr(self, "expr_" + type(e).__name__.lower())
        return method(e, sc)

    def at(self, e: ir.Expr, index: str, sc: Scope) -> str:
        """Render element ``index`` of an array-valued (or scalar, broadcast) expression."""
        return self.expr(e, sc.at(index))

    def expr_const(self, e: ir.Const, sc: Scope) -> str:
        assert e.ty is not None
        elem = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
        return self.literal(e.value, elem)

    def expr_var(self, e: ir.Var, sc: Scope) -> str:
        if e.name in sc.lambdas:
            return sc.lambdas[e.name]
        if e.name in self.arrays:
            arr = self.arrays[e.name]
            if arr.kind is ArrayKind.PACKED:
                raise BuildError(f"packed array {e.name!r} is only readable through unpack")
            if sc.loop is not None and e.name in sc.loop.inline:
                assert arr.value is not None
                return self.expr(arr.value, sc)  # inline, so its expand reads the staging
            return f"a_{self.safe(e.name)}({sc.index})"
        if e.name in self.scalars:
            return self.scalars[e.name]
        if e.name in self.params:
            return f"p_{self.safe(e.name)}"
        raise BuildError(f"the renderer has no value for {e.name!r}")

    def expr_unary(self, e: ir.Unary, sc: Scope) -> str:
        assert e.ty is not None
        if e.op == "not":
            return f"(!{self.as_elem(e.operand, 'bool', sc)})"
        elem = e.ty.elem
        x = self.as_elem(e.operand, elem, sc)
        if elem == "i32":
            return f"hp_neg_i32({x})"
        if elem == "u32":
            return f"(0u - {x})"
        return f"(-{x})"

    def expr_binary(self, e: ir.Binary, sc: Scope) -> str:
        assert e.ty is not None and e.left.ty is not None and e.right.ty is not None
        op = OPERATORS[e.op]
        left, right = op.operand_types(e.ty.elem, e.left.ty, e.right.ty)
        return op.render_c(left, self.as_elem(e.left, left, sc),
                           self.as_elem(e.right, right, sc))

    def expr_select(self, e: ir.Select, sc: Scope) -> str:
        assert e.ty is not None
        c = self.as_elem(e.cond, "bool", sc)
        a, b = self.as_elem(e.then, e.ty.elem, sc), self.as_elem(e.other, e.ty.elem, sc)
        return f"hp_sel<{self.ctype(e.ty.elem)}>({c}, {a}, {b})"

    def expr_lambda(self, e: ir.Lambda, sc: Scope) -> str:
        raise BuildError("a lambda is rendered by the operator that applies it")

    def expr_call(self, e: ir.Call, sc: Scope) -> str:
        assert e.ty is not None
        kind = BUILTINS[e.fn].kind
        if kind is Kind.CAST:
            x = e.args[0]
            assert x.ty is not None
            return self.convert(self.expr(x, sc), x.ty.elem, e.fn)
        if kind is Kind.ELEMENTWISE:
            return self.elementwise(e, sc)
        method = getattr(self, "call_" + e.fn, None)
        if method is None:
            raise BuildError(f"the {self.target} renderer cannot render {e.fn}() here")
        return method(e, sc)

    def elementwise(self, e: ir.Call, sc: Scope) -> str:
        assert e.operand_ty is not None and e.ty is not None
        spec = BUILTINS[e.fn]
        op = e.operand_ty.elem
        try:
            out = spec.render_c(op, [self.as_elem(a, op, sc) for a in e.args], self.rint)
        except KeyError:
            raise BuildError(f"the renderer has no builtin {e.fn!r} for {op}") from None
        return self.convert(out, spec.result_of(op), e.ty.elem)

    rint = "nearbyintf"

    # element-producing operators, rendered at sc.index
    def apply(self, lam: ir.Expr, values: list[str], index: str, sc: Scope) -> str:
        """Render a lambda applied to element values, as an immediately invoked lambda."""
        assert isinstance(lam, ir.Lambda) and lam.ty is not None
        ix = self.fresh("ix")
        lambdas = dict(sc.lambdas)
        decls = []
        for name, value, ty in zip(lam.params, values, lam.param_types, strict=True):
            local = f"l_{self.safe(name)}{self.uid}"
            decls.append(f"const {self.ctype(ty.elem)} {local} = {value};")
            lambdas[name] = local
        body = self.as_elem(lam.body, lam.ty.elem, replace(sc, index=ix, lambdas=lambdas))
        ret = self.ctype(lam.ty.elem)
        inner = " ".join(decls)
        return f"([&](uint64_t {ix}) -> {ret} {{ {inner} return {body}; }}({index}))"

    def call_map(self, e: ir.Call, sc: Scope) -> str:
        assert sc.index is not None
        values = [self.expr(a, sc) for a in e.args[:-1]]
        return self.apply(e.args[-1], values, sc.index, sc)

    def call_expand(self, e: ir.Call, sc: Scope) -> str:
        (r,) = e.args
        assert r.ty is not None and r.ty.length is not None and sc.index is not None
        block = r.ty.length.value
        if sc.on_stage and sc.loop is not None and isinstance(r, ir.Var) \
                and (r.name, block) in sc.loop.expand:
            return f"st.ex({sc.loop.expand.index((r.name, block))}, {sc.index})"
        # a gather: contiguous runs of one value that the compiler may not vectorise
        return self.at(r, f"((uint64_t)({sc.index}) / {block}u)" if block else "(uint64_t)0",
                       sc)

    def call_iota(self, e: ir.Call, sc: Scope) -> str:
        return f"((uint32_t)({sc.index}))"

    def call_unpack(self, e: ir.Call, sc: Scope) -> str:
        (p,) = e.args
        assert isinstance(p, ir.Var) and p.ty is not None
        src = f"pk_{self.safe(p.name)}"
        if sc.on_stage and sc.loop is not None and (p.name, p.ty.bits) in sc.loop.stage:
            # unpacked into L1 by the pass, chunk by chunk
            return f"st.get({sc.loop.stage.index((p.name, p.ty.bits))}, {sc.index})"
        return f"hp_unpack({src}, {sc.index}, {p.ty.bits}u)"

    def call_gather(self, e: ir.Call, sc: Scope) -> str:
        a, idx = e.args
        assert e.ty is not None and idx.ty is not None
        j = self.fresh("j")
        elem = e.ty.elem
        inner = self.at(a, f"(uint64_t){j}", sc)
        return (f"([&](int64_t {j}) -> {self.ctype(elem)} {{ return ({j} >= 0 && {j} < "
                f"(int64_t)({self.length(a, sc)})) ? {inner} : {self.zero(elem)}; }}"
                f"((int64_t)({self.expr(idx, sc)})))")

    def call_size(self, e: ir.Call, sc: Scope) -> str:
        return f"((uint32_t)({self.length(e.args[0], sc)}))"

    def call_random(self, e: ir.Call, sc: Scope) -> str:
        return f"hp_uniform(key_{e.stream}, {sc.index})"

    def call_randint(self, e: ir.Call, sc: Scope) -> str:
        hi = e.args[0]
        if isinstance(hi, ir.Const) and type(hi.value) is int and 0 < hi.value < 2**32 \
                and hi.value & (hi.value - 1) == 0:
            # (h * 2^k) >> 32 is h >> (32 - k): a shift, not a 64-bit product per element
            k = hi.value.bit_length() - 1
            return f"(hp_hash(key_{e.stream}, {sc.index}) >> {32 - k}u)" if k else "0u"
        return (f"hp_randint(key_{e.stream}, {sc.index}, "
                f"{self.as_elem(e.args[0], 'u32', sc)})")

    def length(self, e: ir.Expr, sc: Scope = ONCE) -> str:
        """A C expression for the element count of an array-valued expression."""
        try:
            return self.extent(extent_of(e, self.arrays), sc)
        except KeyError as exc:
            raise BuildError(str(exc.args[0])) from None

    def extent(self, x: Extent, sc: Scope = ONCE) -> str:
        if x.kind is ExtentKind.N:
            return "n"
        if x.kind is ExtentKind.BUFFER:
            return f"a_{self.safe(x.name)}_len"
        if x.kind is ExtentKind.PACKED:
            return f"pk_{self.safe(x.name)}_len"
        if x.kind is ExtentKind.SECTION:
            return f"cnt[{x.index}]"
        if x.kind is ExtentKind.BLOCKS:
            assert x.base is not None
            return f"hp::blocks({self.extent(x.base, sc)}, {x.block})"
        assert x.kind is ExtentKind.IOTA and x.count is not None
        return f"(uint64_t)std::max<int64_t>(0, (int64_t)({self.expr(x.count, sc)}))"
