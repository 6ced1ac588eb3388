"""Render lowered CompLL programs into C-family source: one base, thin targets.

``CRenderer`` owns the operator table and statement lowering. Every array is either
*lazy* (a lambda from element index to value, so elementwise chains fuse) or a
*buffer* (the result of a barrier operator). Scalars are ordinary locals. The
targets differ only in class attributes (lambda qualifier, runtime header, template)
and in the runtime each header implements: the same ``hp::`` calls run as OpenMP
loops on the CPU and as kernels on the GPU.

DSL names never reach the output as written: locals are ``v_NAME``, arrays ``a_NAME``,
lambda parameters ``l_NAME`` (names are ``[A-Za-z_][A-Za-z0-9_]*`` by the grammar, so
no prefixed name is a keyword or a runtime symbol), and literals are rendered typed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np

from . import ir
from .checker import ELEMENTWISE
from .diagnostics import BuildError
from .interpreter import cast, eval_constant
from .ir import FLOATS
from .lower import lower
from .payload import algorithm_id
from .typing_rules import ITEMSIZE, arith_elem, promote_one

__all__ = ["CRenderer", "CpuRenderer", "CudaRenderer", "render"]

_TEMPLATES = Path(__file__).parent / "templates"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ARITH = {"+": "add", "-": "sub", "*": "mul"}
MAX_STAGED = 4  # templates/cpu_runtime.h MAX_STAGED


@dataclass
class _Array:
    kind: str  # "lazy" (a lambda a_NAME), "packed" (bytes pk_NAME + count)
    elem: str
    length: str  # a C expression for the element count


class CRenderer:
    """The shared C-style renderer. Subclasses set the class attributes below."""

    target = ""
    template = ""
    #: how a host-side lambda that produces elements is introduced
    lam = "[&]"
    types = {"f32": "float", "f16": "hp_f16", "i32": "int32_t", "u32": "uint32_t",
             "u8": "uint8_t", "bool": "bool"}

    def __init__(self, program: ir.Program) -> None:
        self.program = lower(program)
        self.lines: list[str] = []
        self.arrays: dict[str, _Array] = {}
        self.scalars: dict[str, str] = {}  # DSL name -> C name
        self.lambda_vars: dict[str, str] = {}
        self.index: str | None = None  # the element index inside a map or key lambda
        self.streams: set[int] = set()
        self.uid = 0
        self.decoding = False
        self.deps: dict[str, set[str]] = {}
        self.pass_len: str | None = None
        self.pass_ops: list[str] = []
        self.deferred: list[str] = []
        self.pending: set[str] = set()
        self.deferred_names: set[str] = set()
        self.pass_stage: list[tuple[str, int]] = []  # packed arrays the open pass stages
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
        if not isinstance(e, ir.Var) and self.constant(e):
            # fold with the interpreter, so the value (a NaN's sign too) is the oracle's
            value = eval_constant(e, dict(self.program.param_values))
            src = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
            return self.convert(self.literal(value, src), src, elem)
        if self.index is not None and not isinstance(e, ir.Var) and self.uniform(e):
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

    def uniform(self, e: ir.Expr) -> bool:
        """Whether a scalar expression is the same for every element of a loop."""
        if e.ty is None or e.ty.kind != "scalar":
            return False
        if isinstance(e, ir.Const):
            return True
        if isinstance(e, ir.Var):
            return e.name not in self.lambda_vars and e.name not in self.arrays
        if isinstance(e, ir.Call):
            if e.fn == "size":
                return True
            return (e.fn in self.types or e.fn in ELEMENTWISE) and \
                all(self.uniform(a) for a in e.args)
        return all(self.uniform(c) for c in _operands(e))

    def take_hoisted(self) -> list[str]:
        lines, self.hoisted = self.hoisted, []
        return lines

    def constant(self, e: ir.Expr) -> bool:
        """Whether a scalar expression uses only literals and parameters."""
        if e.ty is None or e.ty.kind != "scalar":
            return False
        if isinstance(e, ir.Const):
            return True
        if isinstance(e, ir.Var):
            return e.name in dict(self.program.param_values) and e.name not in self.scalars \
                and e.name not in self.lambda_vars
        if isinstance(e, ir.Call):
            return (e.fn in self.types or e.fn in ELEMENTWISE) and \
                all(self.constant(a) for a in e.args)
        return all(self.constant(c) for c in _operands(e))

    # -- expressions --------------------------------------------------------------------------
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
        op = e.op
        if op in ("and", "or"):  # both sides are side-effect free: no short-circuit branch
            c = "&" if op == "and" else "|"
            return f"((bool)({self.as_elem(e.left, 'bool')} {c} {self.as_elem(e.right, 'bool')}))"
        if e.ty.elem == "bool" and op in ("&", "|", "^"):
            return f"({self.as_elem(e.left, 'bool')} {op} {self.as_elem(e.right, 'bool')})"
        if op in ("<<", ">>"):
            elem = e.ty.elem
            a, b = self.as_elem(e.left, elem), self.as_elem(e.right, "u32")
            return f"hp_{'shl' if op == '<<' else 'shr'}_{elem}({a}, {b})"
        elem = arith_elem(e.left.ty, e.right.ty)
        a, b = self.as_elem(e.left, elem), self.as_elem(e.right, elem)
        if op in ("/", "%") and elem != "f32":
            return f"hp_{'div' if op == '/' else 'mod'}_{elem}({a}, {b})"
        if elem == "i32" and op in _ARITH:
            return f"hp_{_ARITH[op]}_i32({a}, {b})"
        if elem == "u32" and op in ("+", "-", "*"):
            return f"((uint32_t)({a} {op} {b}))"
        return f"({a} {op} {b})"

    def expr_select(self, e: ir.Select) -> str:
        assert e.ty is not None
        c = self.as_elem(e.cond, "bool")
        a, b = self.as_elem(e.then, e.ty.elem), self.as_elem(e.other, e.ty.elem)
        return f"hp_sel<{self.ctype(e.ty.elem)}>({c}, {a}, {b})"

    def expr_lambda(self, e: ir.Lambda) -> str:
        raise BuildError("a lambda is rendered by the operator that applies it")

    def expr_call(self, e: ir.Call) -> str:
        assert e.ty is not None
        if e.fn in self.types:
            x = e.args[0]
            assert x.ty is not None
            return self.convert(self.expr(x), x.ty.elem, e.fn)
        if e.operand_ty is not None and e.fn != "reduce":
            return self.elementwise(e)
        method = getattr(self, "call_" + e.fn, None)
        if method is None:
            raise BuildError(f"the {self.target} renderer cannot render {e.fn}() here")
        return method(e)

    def elementwise(self, e: ir.Call) -> str:
        assert e.operand_ty is not None and e.ty is not None
        op = e.operand_ty.elem
        args = [self.as_elem(a, op) for a in e.args]
        fn = e.fn
        if fn == "abs":
            out = {"f32": "hp_fabs({})", "i32": "hp_abs_i32({})"}.get(op, "({})").format(*args)
        elif fn == "sign":
            if op == "f32":
                out = f"hp_sign_f32({args[0]})"
            elif op == "u32":
                out = f"((uint32_t)({args[0]} > 0u))"
            else:
                out = f"((int32_t)(({args[0]} > 0) - ({args[0]} < 0)))"
        elif fn in ("floor", "ceil", "sqrt"):
            out = f"{fn}f({args[0]})"
        elif fn == "round":
            out = f"{self.rint}({args[0]})"
        elif fn in ("min", "max"):
            if op == "f32":
                out = f"hp_f{fn}({args[0]}, {args[1]})"
            else:
                cmp = "<" if fn == "min" else ">"
                out = f"({args[0]} {cmp} {args[1]} ? {args[0]} : {args[1]})"
        elif fn in ("isnan", "isfinite"):
            out = f"hp_{fn}({args[0]})"
        elif fn == "exponent":
            out = f"hp_exponent({args[0]})"
        elif fn == "pow2":
            out = f"hp_pow2({args[0]})"
        else:
            raise BuildError(f"the renderer has no builtin {fn!r}")
        result = "f32" if fn in ("pow2",) else ("bool" if fn in ("isnan", "isfinite") else
                                                 ("i32" if fn == "exponent" else op))
        return self.convert(out, result, e.ty.elem)

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
        return f"hp_randint(key_{e.stream}, {self.index}, {self.as_elem(e.args[0], 'u32')})"

    def length(self, e: ir.Expr) -> str:
        """A C expression for the element count of an array-valued expression."""
        if isinstance(e, ir.Var):
            if e.name not in self.arrays:
                raise BuildError(f"{e.name!r} is not an array")
            return self.arrays[e.name].length
        if isinstance(e, ir.Call):
            if e.fn == "iota":
                return f"(uint64_t)std::max<int64_t>(0, (int64_t)({self.expr(e.args[0])}))"
            if e.fn == "gather":
                return self.length(e.args[1])
            if e.fn in ("map", "unpack", "pack") or e.fn in self.types or e.operand_ty is not None:
                for a in e.args:
                    if a.ty is not None and a.ty.kind in ("array", "packed"):
                        return self.length(a)
        if isinstance(e, (ir.Unary, ir.Binary, ir.Select)):
            for a in _operands(e):
                if a.ty is not None and a.ty.kind == "array":
                    return self.length(a)
        raise BuildError(f"cannot tell the length of {type(e).__name__}")

    # -- dependencies and fused passes ---------------------------------------------------------
    def deps_of(self, e: ir.Expr | None) -> set[str]:
        """Names a value depends on, through lazy arrays and lambdas."""
        if e is None:
            return set()
        if isinstance(e, ir.Var):
            return {e.name} | self.deps.get(e.name, set())
        if isinstance(e, ir.Lambda):
            return self.deps_of(e.body) - set(e.params)
        out: set[str] = set()
        children: list[ir.Expr] = _operands(e)
        if isinstance(e, ir.Call):
            children = list(e.args) + [v for _, v in e.kwargs]
        for child in children:
            out |= self.deps_of(child)
        return out

    def blocked(self, deps: set[str]) -> bool:
        return bool(deps & (self.pending | self.deferred_names))

    def place(self, lines: list[str], names: list[str], deps: set[str]) -> None:
        """Emit now, or after the open pass when the lines need its results."""
        lines = self.take_hoisted() + lines
        for name in names:
            self.deps[name] = set(deps)
        if self.blocked(deps):
            self.deferred.extend(lines)
            self.deferred_names.update(names)
        else:
            for line in lines:
                self.emit(line)

    def open_pass(self, length: str, deps: set[str]) -> None:
        """Make sure the open pass runs over ``length`` and needs none of ``deps``."""
        if self.blocked(deps) or (self.pass_len is not None and self.pass_len != length):
            self.flush()
        self.pass_len = length

    def add_op(self, op: str, produces: list[str], deps: set[str]) -> None:
        """Join a loop operation (rendered after ``open_pass``) to the open pass."""
        for line in self.take_hoisted():
            self.emit(line)
        self.pass_ops.append(op)
        self.pending.update(produces)
        for name in produces:
            self.deps[name] = set(deps)

    def flush(self) -> None:
        """Close the open pass: one ``hp::fused`` loop, then what waited for it."""
        if self.pass_ops:
            srcs = ", ".join(s for s, _ in self.pass_stage)
            bits = ", ".join(f"{b}u" for _, b in self.pass_stage)
            stage = f"hp::Unpacks{{{{{srcs}}}, {{{bits}}}, {len(self.pass_stage)}}}"
            ops = ",\n      ".join(self.pass_ops)
            self.emit(f"hp::fused({self.pass_len}, {stage},\n      {ops});")
        for line in self.deferred:
            self.emit(line)
        self.pass_len, self.pass_ops, self.deferred = None, [], []
        self.pass_stage = []
        self.pending, self.deferred_names = set(), set()

    def emit(self, line: str) -> None:
        for pending in self.take_hoisted():
            self.lines.append("  " + pending)
        self.lines.append("  " + line)

    # -- statements ---------------------------------------------------------------------------
    def element_fn(self, e: ir.Expr, elem: str, staged: bool = False) -> str:
        """A lambda over element indices computing ``e`` as ``elem``; ``staged`` lambdas
        belong to a fused pass and also take its ``hp::Stage``."""
        i = self.fresh("i")
        saved, self.stage_index = self.stage_index, (i if staged else None)
        try:
            body = self.at_elem(e, i, elem)
        finally:
            self.stage_index = saved
        return f"{self.lam}({self.signature(i, staged)}) -> {self.ctype(elem)} {{ return {body}; }}"

    @staticmethod
    def signature(i: str, staged: bool) -> str:
        return f"uint64_t {i}, const hp::Stage& st" if staged else f"uint64_t {i}"

    def at_elem(self, e: ir.Expr, index: str, elem: str) -> str:
        saved, self.index = self.index, index
        try:
            return self.as_elem(e, elem)
        finally:
            self.index = saved

    def keyed_fn(self, e: ir.Call, a: ir.Expr, elem: str, staged: bool = False) -> str:
        """The lambda of ``key(a[i])`` (or ``a[i]`` without a key) as ``elem``."""
        key = e.kwarg("key")
        if key is None:
            return self.element_fn(a, elem, staged)
        assert isinstance(key, ir.Lambda) and key.ty is not None
        i = self.fresh("i")
        saved, self.stage_index = self.stage_index, (i if staged else None)
        try:
            value = self.apply(key, [self.at(a, i)], i)
        finally:
            self.stage_index = saved
        body = self.convert(value, key.ty.elem, elem)
        return (f"{self.lam}({self.signature(i, staged)}) -> {self.ctype(elem)} "
                f"{{ return {body}; }}")

    def bind_lazy(self, name: str, e: ir.Expr) -> None:
        assert e.ty is not None
        n = self.safe(name)
        length = self.length(e)
        self.place([f"auto a_{n} = {self.element_fn(e, e.ty.elem)};"], [name], self.deps_of(e))
        self.arrays[name] = _Array("lazy", e.ty.elem, length)

    def bind_buffer(self, name: str, buf: str, elem: str, deps: set[str]) -> None:
        n = self.safe(name)
        t = self.ctype(elem)
        self.place([f"{t}* b_{n} = {buf}.data();",
                    f"auto a_{n} = {self.lam}(uint64_t i) -> {t} {{ return b_{n}[i]; }};",
                    f"const uint64_t a_{n}_len = {buf}.size();"], [name], deps)
        self.arrays[name] = _Array("lazy", elem, f"a_{n}_len")

    def stmt_let(self, s: ir.Let) -> None:
        value = s.value
        assert value.ty is not None
        if isinstance(value, ir.Call) and value.fn in ("reduce", "filter", "sort", "topk",
                                                        "scatter", "pack"):
            getattr(self, "let_" + value.fn)(s, value)
            return
        (name,) = s.names
        if value.ty.kind == "array":
            self.bind_lazy(name, value)
            return
        c = f"v_{self.safe(name)}"
        line = f"const {self.ctype(value.ty.elem)} {c} = {self.as_elem(value, value.ty.elem)};"
        self.scalars[name] = c
        self.place([line], [name], self.deps_of(value))

    def let_reduce(self, s: ir.Let, e: ir.Call) -> None:
        (name,) = s.names
        a, op = e.args
        assert isinstance(op, ir.Var) and e.ty is not None and e.operand_ty is not None
        elem, out = e.operand_ty.elem, e.ty.elem
        c = f"v_{self.safe(name)}"
        is_max = "true" if op.name == "max" else "false"
        deps = self.deps_of(e)
        self.open_pass(self.length(a), deps)
        if elem in FLOATS:
            fn = self.keyed_fn(e, a, "f32", staged=True)
            call = (f"hp::sum_f32({fn}, &{c})" if op.name == "sum"
                    else f"hp::extreme_f32<{is_max}>({fn}, &{c})")
        elif op.name == "sum":
            fn = self.keyed_fn(e, a, elem, staged=True)
            call = f"hp::sum_int<{self.ctype(out)}>({fn}, &{c})"
        else:
            fn = self.keyed_fn(e, a, elem, staged=True)
            call = f"hp::extreme_int<{is_max}, {self.ctype(elem)}>({fn}, &{c})"
        self.emit(f"{self.ctype(out)} {c};")
        self.scalars[name] = c
        self.add_op(call, [name], deps)

    def let_selection(self, s: ir.Let, e: ir.Call, call: str, elem: str) -> None:
        """Emit a barrier operator producing (indices,) values buffers."""
        assert e.ty is not None
        deps = self.deps_of(e)
        if self.blocked(deps):
            self.flush()
        vals, idx = self.fresh("vals"), self.fresh("idx")
        self.emit(f"hp::buffer<{self.ctype(elem)}> {vals};")
        self.emit(f"hp::buffer<uint32_t> {idx};")
        with_index = e.ty.kind == "tuple"
        tail = f"{'&' + idx if with_index else 'nullptr'}, &{vals}"
        self.emit(call.replace("{tail}", tail))
        names = list(s.names)
        if with_index:
            self.bind_buffer(names.pop(0), idx, "u32", deps)
        self.bind_buffer(names[0], vals, elem, deps)

    def let_filter(self, s: ir.Let, e: ir.Call) -> None:
        a, pred = e.args
        assert a.ty is not None
        elem = a.ty.elem
        i = self.fresh("i")
        body = self.apply(pred, [self.at(a, i)], i)
        pred_fn = f"{self.lam}(uint64_t {i}) -> bool {{ return {body}; }}"
        call = (f"hp::filter<{self.ctype(elem)}>({self.length(a)}, "
                f"{self.element_fn(a, elem)}, {pred_fn}, {{tail}});")
        self.let_selection(s, e, call, elem)

    def key_or_value(self, e: ir.Call) -> str:
        a = e.args[0]
        assert a.ty is not None
        key = e.kwarg("key")
        elem = key.ty.elem if key is not None and key.ty is not None else a.ty.elem
        return self.keyed_fn(e, a, promote_one(elem) if elem in FLOATS else elem)

    def let_sort(self, s: ir.Let, e: ir.Call) -> None:
        a = e.args[0]
        assert a.ty is not None
        desc = e.kwarg("descending")
        flag = "true" if isinstance(desc, ir.Const) and desc.value else "false"
        t = self.ctype(a.ty.elem)
        call = (f"hp::sort<{t}>({self.length(a)}, {self.element_fn(a, a.ty.elem)}, "
                f"{self.key_or_value(e)}, {flag}, {{tail}});")
        self.let_selection(s, e, call, a.ty.elem)

    def let_topk(self, s: ir.Let, e: ir.Call) -> None:
        a, k = e.args
        assert a.ty is not None
        t = self.ctype(a.ty.elem)
        call = (f"hp::topk<{t}>({self.length(a)}, (int64_t)({self.expr(k)}), "
                f"{self.element_fn(a, a.ty.elem)}, {self.key_or_value(e)}, {{tail}});")
        self.let_selection(s, e, call, a.ty.elem)

    def scatter_parts(self, e: ir.Call) -> tuple[str, str, str, str, str]:
        idx, vals, size = e.args
        assert vals.ty is not None
        elem = vals.ty.elem
        m = f"(uint64_t)std::max<int64_t>(0, (int64_t)({self.expr(size)}))"
        i = self.fresh("i")
        index_fn = (f"{self.lam}(uint64_t {i}) -> int64_t {{ return "
                    f"(int64_t)({self.at(idx, i)}); }}")
        return elem, m, self.length(idx), index_fn, self.element_fn(vals, elem)

    def let_scatter(self, s: ir.Let, e: ir.Call) -> None:
        (name,) = s.names
        deps = self.deps_of(e)
        if self.blocked(deps):
            self.flush()
        elem, m, count, index_fn, value_fn = self.scatter_parts(e)
        buf = self.fresh("scat")
        self.emit(f"hp::buffer<{self.ctype(elem)}> {buf}({m});")
        if self.decoding:
            self.emit(f"if (!hp::check_indices({count}, {m}, {index_fn}, err, errcap)) return 2;")
        self.emit(f"hp::scatter_add({buf}.data(), {m}, {count}, {index_fn}, {value_fn});")
        self.bind_buffer(name, buf, elem, deps)

    def let_pack(self, s: ir.Let, e: ir.Call) -> None:
        (name,) = s.names
        (a,) = e.args
        assert e.ty is not None and a.ty is not None
        deps = self.deps_of(e)
        if self.blocked(deps):
            self.flush()
        n = self.safe(name)
        self.emit(f"const uint64_t pk_{n}_len = {self.length(a)};")
        self.emit(f"hp::buffer<uint8_t> pkb_{n}((pk_{n}_len * {e.ty.bits} + 7) / 8);")
        self.emit(f"hp::pack_all<{e.ty.bits}>(pkb_{n}.data(), pk_{n}_len, "
                  f"{self.element_fn(a, a.ty.elem)});")
        self.emit(f"const uint8_t* pk_{n} = pkb_{n}.data();")
        self.deps[name] = deps
        self.arrays[name] = _Array("packed", "u8", f"pk_{n}_len")

    # -- encode: the payload ------------------------------------------------------------------
    def section_size(self, x: ir.Expr, section: ir.Section) -> str:
        ty = section.ty
        if ty.kind == "scalar":
            return str(ITEMSIZE[ty.elem])
        if ty.kind == "packed":
            return f"(({self.length(x)}) * {ty.bits} + 7) / 8"
        return f"({self.length(x)}) * {ITEMSIZE[ty.elem]}"

    def section_op(self, x: ir.Expr, section: ir.Section, dst: str) -> str:
        """The loop operation writing an array section (packed or plain)."""
        ty = section.ty
        if ty.kind == "packed":
            assert isinstance(x, ir.Call) and x.fn == "pack"
            (a,) = x.args
            assert a.ty is not None
            return f"hp::pack<{ty.bits}>({dst}, {self.element_fn(a, a.ty.elem, staged=True)})"
        fn = self.element_fn(x, ty.elem, staged=True)
        return f"hp::store<{self.ctype(ty.elem)}>({dst}, {fn})"

    def encode_return(self, ret: ir.Call) -> None:
        layout = self.program.layout
        count = len(layout)
        sizes = [self.section_size(x, sec) for x, sec in zip(ret.args, layout, strict=True)]
        size_deps: set[str] = set()
        for x, sec in zip(ret.args, layout, strict=True):
            if sec.ty.kind != "scalar":
                size_deps |= self.deps_of(x)
        if self.blocked(size_deps):
            self.flush()
        self.emit(f"uint64_t sz[{count}];")
        for k, size in enumerate(sizes):
            self.emit(f"sz[{k}] = {size};")
        self.emit(f"uint64_t total = hp::HEADER + 8 * {count};")
        self.emit(f"for (int k = 0; k < {count}; ++k) total += hp_pad8(sz[k]);")
        self.emit("if (total > cap) return (int64_t)total;")
        self.emit(f"hp::write_header(out, {count}, ALGO_ID, n, seed, step, sz);")
        self.emit(f"uint8_t* sec[{count}];")
        self.emit(f"sec[0] = out + hp::HEADER + 8 * {count};")
        for k in range(1, count):
            self.emit(f"sec[{k}] = sec[{k - 1}] + hp_pad8(sz[{k - 1}]);")
        for k in range(count):
            self.emit(f"hp::zero_bytes(sec[{k}] + sz[{k}], hp_pad8(sz[{k}]) - sz[{k}]);")
        later = []
        for k, (x, sec) in enumerate(zip(ret.args, layout, strict=True)):
            if sec.ty.kind == "scalar":
                later.append((k, x, sec))
            elif sec.ty.kind == "packed" and isinstance(x, ir.Var):
                later.append((k, x, sec))
            else:
                self.open_pass(self.length(x), self.deps_of(x))
                self.add_op(self.section_op(x, sec, f"sec[{k}]"), [], self.deps_of(x))
        self.flush()
        for k, x, sec in later:
            if sec.ty.kind == "scalar":
                tmp = self.fresh("s")
                self.emit(f"const {self.ctype(sec.ty.elem)} {tmp} = "
                          f"{self.as_elem(x, sec.ty.elem)};")
                self.emit(f"hp::put_bytes(sec[{k}], &{tmp}, sz[{k}]);")
            else:
                assert isinstance(x, ir.Var)
                self.emit(f"hp::copy_bytes(sec[{k}], pk_{self.safe(x.name)}, sz[{k}]);")
        self.emit("return (int64_t)total;")

    def encode_body(self) -> list[str]:
        self.reset(decoding=False)
        fn = self.program.encode
        (gname, _), = fn.args
        self.emit(f"auto a_{self.safe(gname)} = {self.lam}(uint64_t i) -> float "
                  "{ return g_ptr[i]; };")
        self.arrays[gname] = _Array("lazy", "f32", "n")
        for stmt in fn.body:
            if isinstance(stmt, ir.Let):
                self.stmt_let(stmt)
            else:
                assert isinstance(stmt.value, ir.Call)
                self.encode_return(stmt.value)
        return self.with_keys(self.lines)

    # -- decode: validate, then evaluate ------------------------------------------------------
    def check_sections(self) -> None:
        layout = self.program.layout
        count = len(layout)
        self.emit(f"uint64_t sz[{count}];")
        self.emit("uint32_t seed = 0, step = 0;")
        self.emit(f"if (!hp::read_header(p, size, ALGO_ID, n, {count}, sz, &seed, &step, "
                  "err, errcap)) return 1;")
        self.emit(f"uint64_t cnt[{count}];")
        for k, section in enumerate(layout):
            ty = section.ty
            length = ty.length
            if ty.kind == "scalar":
                want = ITEMSIZE[ty.elem]
                self.emit(f"cnt[{k}] = 1;")
                self.emit(f"if (sz[{k}] != {want}) return hp::fail(err, errcap, "
                          f"\"a {ty.elem} section must be {want} bytes, not %llu\", sz[{k}]);")
                continue
            assert length is not None
            fixed = "n" if length.kind == "n" else (str(length.value) if length.kind == "const"
                                                   else None)
            if ty.kind == "packed":
                assert fixed is not None
                self.emit(f"cnt[{k}] = {fixed};")
                self.emit(f"if (sz[{k}] != (cnt[{k}] * {ty.bits} + 7) / 8) return "
                          f"hp::fail(err, errcap, \"a u{ty.bits}[%llu] section must be "
                          f"%llu bytes\", cnt[{k}], (cnt[{k}] * {ty.bits} + 7) / 8);")
                continue
            item = ITEMSIZE[ty.elem]
            if fixed is not None:
                self.emit(f"cnt[{k}] = {fixed};")
                self.emit(f"if (sz[{k}] != cnt[{k}] * {item}) return hp::fail(err, errcap, "
                          f"\"a {ty.elem}[%llu] section must be %llu bytes\", cnt[{k}], "
                          f"cnt[{k}] * {item});")
            else:
                self.emit(f"if (sz[{k}] % {item} != 0) return hp::fail(err, errcap, "
                          f"\"a {ty.elem} array section of %llu bytes is not whole elements\", "
                          f"sz[{k}]);")
                self.emit(f"cnt[{k}] = sz[{k}] / {item};")
        groups: dict[str, int] = {}
        for k, section in enumerate(layout):
            if not section.group:
                continue
            if section.group in groups:
                j = groups[section.group]
                self.emit(f"if (cnt[{k}] != cnt[{j}]) return hp::fail(err, errcap, "
                          "\"sections of one group hold %llu and %llu elements\", "
                          f"cnt[{j}], cnt[{k}]);")
            else:
                groups[section.group] = k
        self.emit(f"if (!hp::check_total(size, {count}, sz, err, errcap)) return 1;")

    def bind_sections(self, s: ir.Let) -> None:
        self.emit(f"const uint8_t* sec = p + hp::HEADER + 8 * {len(self.program.layout)};")
        for k, (name, section) in enumerate(zip(s.names, self.program.layout, strict=True)):
            ty = section.ty
            n = self.safe(name)
            self.emit(f"const uint8_t* s_{n} = sec;")
            if ty.kind == "scalar":
                c = f"v_{n}"
                t = self.ctype(ty.elem)
                self.emit(f"const {t} {c} = hp::get<{t}>(s_{n});")
                self.scalars[name] = c
            elif ty.kind == "packed":
                self.emit(f"const uint8_t* pk_{n} = s_{n};")
                self.arrays[name] = _Array("packed", "u8", f"cnt[{k}]")
            else:
                t = self.ctype(ty.elem)
                self.emit(f"auto a_{n} = {self.lam}(uint64_t i) -> {t} "
                          f"{{ return hp::load<{t}>(s_{n}, i); }};")
                self.arrays[name] = _Array("lazy", ty.elem, f"cnt[{k}]")
            self.emit(f"sec += hp_pad8(sz[{k}]);")

    def decode_return(self, value: ir.Expr) -> None:
        deps = self.deps_of(value)
        if isinstance(value, ir.Call) and value.fn == "scatter":
            self.flush()
            _, m, count, index_fn, value_fn = self.scatter_parts(value)
            self.emit(f"if (!hp::check_indices({count}, {m}, {index_fn}, err, errcap)) "
                      "return 2;")
            self.emit(f"hp::scatter_out(out, n, accumulate, {count}, {index_fn}, {value_fn});")
        else:
            self.open_pass("n", deps)
            op = f"hp::write_out(out, accumulate, {self.element_fn(value, 'f32', staged=True)})"
            self.add_op(op, [], deps)
            self.flush()
        self.emit("return 0;")

    def decode_body(self) -> list[str]:
        self.reset(decoding=True)
        fn = self.program.decode
        (_, _), (nname, _) = fn.args
        self.scalars[nname] = "((uint32_t)n)"
        self.check_sections()
        keys_at = len(self.lines)  # seed and step come from the header just read
        for stmt in fn.body:
            if isinstance(stmt, ir.Let):
                if isinstance(stmt.value, ir.Call) and stmt.value.fn == "extract":
                    self.bind_sections(stmt)
                else:
                    self.stmt_let(stmt)
            else:
                self.decode_return(stmt.value)
        return self.lines[:keys_at] + self.with_keys(self.lines[keys_at:])

    def reset(self, decoding: bool) -> None:
        self.lines, self.decoding = [], decoding
        self.arrays, self.scalars, self.deps = {}, {}, {}
        self.pass_len, self.pass_ops, self.deferred = None, [], []
        self.pending, self.deferred_names = set(), set()
        self.pass_stage, self.stage_index = [], None

    def with_keys(self, lines: list[str]) -> list[str]:
        keys = [f"  const uint32_t key_{s} = hp_stream_key(seed, step, {s}u);"
                for s in sorted(self.streams)]
        self.streams = set()
        return keys + lines

    # -- the whole source ---------------------------------------------------------------------
    def params(self) -> list[str]:
        out = []
        types = {p.name: p.ty.elem for p in self.program.params}
        for name, value in self.program.param_values:
            elem = types[name]
            out.append(f"static const {self.ctype(elem)} p_{self.safe(name)} = "
                       f"{self.literal(value, elem)};")
        return out

    def source(self) -> str:
        encode = self.encode_body()
        decode = self.decode_body()
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(_TEMPLATES)), keep_trailing_newline=True,
            undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
            lstrip_blocks=True,
        )
        return env.get_template(self.template).render(
            name=self.program.name, algo_id=algorithm_id(self.program),
            params=self.params(), encode=encode, decode=decode,
        )


def _operands(e: ir.Expr) -> list[ir.Expr]:
    if isinstance(e, ir.Unary):
        return [e.operand]
    if isinstance(e, ir.Binary):
        return [e.left, e.right]
    if isinstance(e, ir.Select):
        return [e.cond, e.then, e.other]
    return []


class CpuRenderer(CRenderer):
    """C++17 with OpenMP. Element lambdas capture by value, so the optimiser keeps
    scalars in registers instead of reloading them after every store."""

    target = "cpu"
    template = "cpu_kernel.cpp.j2"
    lam = "[=]"


class CudaRenderer(CRenderer):
    """CUDA C++17: element lambdas are extended device lambdas that capture by value."""

    target = "cuda"
    template = "cuda_kernel.cu.j2"
    lam = "[=] __device__"
    rint = "rintf"


def render(program: ir.Program, target: str) -> str:
    """Render a checked program for ``target`` (``"cpu"`` or ``"cuda"``)."""
    from .compiler import dump_stage

    renderers: dict[str, type[CRenderer]] = {"cpu": CpuRenderer, "cuda": CudaRenderer}
    if target not in renderers:
        raise BuildError(f"no renderer for target {target!r}")
    renderer = renderers[target](program)
    dump_stage("lower", renderer.program)
    source = renderer.source()
    dump_stage("render", source)
    return source
