"""Render lowered CompLL programs into C-family source: one base, thin targets.

``CRenderer`` extends the expression renderer (``compll.expressions``) with statement
lowering. Every array is either *lazy* (a lambda from element index to value, so
elementwise chains fuse) or a *buffer* (the result of a barrier operator). Independent
loop operations over one length are grouped into fused passes (``hp::fused``). The
targets differ only in class attributes (lambda qualifier, rounding builtin, template)
and in the runtime each header implements: the same ``hp::`` calls run as OpenMP loops
on the CPU and as kernels on the GPU.

DSL names never reach the output as written: locals are ``v_NAME``, arrays ``a_NAME``,
lambda parameters ``l_NAME`` (names are ``[A-Za-z_][A-Za-z0-9_]*`` by the grammar, so
no prefixed name is a keyword or a runtime symbol), and literals are rendered typed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jinja2

from . import ir
from .compiler import dump_stage
from .diagnostics import BuildError
from .expressions import ExprRenderer, _Array, operands
from .ir import FLOATS
from .payload import algorithm_id
from .typing_rules import ITEMSIZE, promote_one

__all__ = ["CRenderer", "CpuRenderer", "CudaRenderer", "render"]

_TEMPLATES = Path(__file__).parent / "templates"
#: error feedback's r += g as a pass of its own (an encoder's ``g_in`` is the input)
_ADD_RESIDUAL = "if (r_ptr) hp::add_into(r_ptr, g_in, n);"
#: operators of a ``CRenderer.cheap`` element function
_CHEAP_OPS = frozenset({"+", "-", "*", "<", "<=", ">", ">=", "==", "!=", "and", "or", "not"})


class CRenderer(ExprRenderer):
    """The shared C-style renderer: statements and fused passes on top of expressions."""

    #: an encoder's error-feedback add (r += g) is not emitted yet
    residual_pending: bool = False
    #: float reductions of ``cheap`` element functions skip the staging buffer (the CPU
    #: runtime's SumF32 and ExtremeF32 take a DIRECT flag)
    direct_reductions: bool = False
    #: a min and a max of the same elements in one pass become one ``hp::minmax_f32``
    merged_extremes: bool = False
    #: the open pass's float min/max ops, by (operand, key) shape: (index in pass_ops,
    #: "min" or "max", result variable, element function, direct)
    pass_extremes: dict[tuple[object, object], tuple[int, str, str, str, bool]]

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
        children: list[ir.Expr] = operands(e)
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

    def add_op(self, op: str | None, produces: list[str], deps: set[str]) -> None:
        """Join a loop operation (rendered after ``open_pass``) to the open pass; ``None``:
        an op already in the pass now also produces ``produces``."""
        for line in self.take_hoisted():
            self.emit(line)
        if op is not None:
            self.pass_ops.append(op)
        self.pending.update(produces)
        for name in produces:
            self.deps[name] = set(deps)

    def flush(self) -> None:
        """Close the open pass: one ``hp::fused`` loop, then what waited for it."""
        if self.pass_ops:
            if self.residual_pending and self.pass_len == "n":
                self.pass_ops.insert(0, "hp::add_residual(r_ptr, g_in)")
                self.residual_pending = False
            self.settle_residual()
            srcs = ", ".join(s for s, _ in self.pass_stage)
            bits = ", ".join(f"{b}u" for _, b in self.pass_stage)
            stage = f"hp::Unpacks{{{{{srcs}}}, {{{bits}}}, {len(self.pass_stage)}}}"
            ops = ",\n      ".join(self.pass_ops)
            self.emit(f"hp::fused({self.pass_len}, {stage},\n      {ops});")
        for line in self.deferred:
            self.emit(line)
        self.pass_len, self.pass_ops, self.deferred = None, [], []
        self.pass_stage, self.pass_extremes = [], {}
        self.pending, self.deferred_names = set(), set()

    def settle_residual(self) -> None:
        """Error feedback's ``r += g`` as a pass of its own, before anything else reads g
        (``flush`` fuses it into the first pass over g where it can)."""
        if self.residual_pending:
            self.residual_pending = False
            self.emit(_ADD_RESIDUAL)

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
        self.arrays[name] = _Array("lazy", e.ty.elem, length, e)

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
            key = e.kwarg("key")
            direct = self.direct_reductions and self.cheap(a) and (key is None or self.cheap(key))
            call: str | None
            if op.name == "sum":
                call = f"hp::sum_f32{'<true>' if direct else ''}({fn}, &{c})"
            elif self.merge_extreme((_shape(a), _shape(key)), op.name, c, fn, direct):
                call = None  # the open pass's opposite extreme now computes this one too
            else:
                call = f"hp::extreme_f32<{is_max}{', true' if direct else ''}>({fn}, &{c})"
        elif op.name == "sum":
            fn = self.keyed_fn(e, a, elem, staged=True)
            call = f"hp::sum_int<{self.ctype(out)}>({fn}, &{c})"
        else:
            fn = self.keyed_fn(e, a, elem, staged=True)
            call = f"hp::extreme_int<{is_max}, {self.ctype(elem)}>({fn}, &{c})"
        self.emit(f"{self.ctype(out)} {c};")
        self.scalars[name] = c
        self.add_op(call, [name], deps)

    def merge_extreme(self, shape: tuple[object, object], kind: str, var: str, fn: str,
                      direct: bool) -> bool:
        """Join a float min (max) of the elements ``shape`` (operand, key) to the open
        pass's max (min) of the same, as one ``hp::minmax_f32`` that evaluates them once.
        False where there is none; the caller then adds its own op, remembered here."""
        found = self.pass_extremes.get(shape) if self.merged_extremes else None
        if found is None or found[1] == kind or found[4] != direct:
            self.pass_extremes[shape] = (len(self.pass_ops), kind, var, fn, direct)
            return False
        index, _, other, first_fn, _ = self.pass_extremes.pop(shape)
        lo, hi = (var, other) if kind == "min" else (other, var)
        self.pass_ops[index] = (f"hp::minmax_f32{'<true>' if direct else ''}"
                                f"({first_fn}, &{lo}, &{hi})")
        return True

    def cheap(self, e: ir.Expr, bound: frozenset[str] = frozenset()) -> bool:
        """Whether ``e``'s elements are float loads joined by +, -, *, comparisons, abs
        and selects: a reduction can evaluate those straight into vector registers
        (``direct_reductions``); others are staged through a buffer in L1."""
        if isinstance(e, ir.Const):
            return True
        if isinstance(e, ir.Lambda):
            return self.cheap(e.body, bound | set(e.params))
        if e.ty is None or e.ty.elem not in ("f32", "bool"):
            return False
        if isinstance(e, ir.Var):
            if e.name in bound or e.name in self.scalars \
                    or e.name in dict(self.program.param_values):
                return True
            arr = self.arrays.get(e.name)
            return (arr is not None and arr.kind == "lazy"
                    and (arr.value is None or self.cheap(arr.value)))
        if isinstance(e, (ir.Unary, ir.Binary)):
            return e.op in _CHEAP_OPS and all(self.cheap(x, bound) for x in operands(e))
        if isinstance(e, ir.Select):
            return all(self.cheap(x, bound) for x in operands(e))
        if isinstance(e, ir.Call):
            return (e.fn in ("abs", "map") and not e.kwargs
                    and all(self.cheap(x, bound) for x in e.args))
        return False

    def let_selection(self, s: ir.Let, e: ir.Call, call: str, elem: str) -> None:
        """Emit a barrier operator producing (indices,) values buffers."""
        assert e.ty is not None
        deps = self.deps_of(e)
        if self.blocked(deps):
            self.flush()
        self.settle_residual()
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
        self.settle_residual()
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
        self.settle_residual()
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
        if self.residual_pending:  # the caller retries on r alone: it must hold r + g
            self.emit("if (total > cap) {")
            self.emit("  " + _ADD_RESIDUAL)
            self.emit("  return (int64_t)total;")
            self.emit("}")
        else:
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
        self.settle_residual()  # an encoder that never read g still updates r
        self.emit("return (int64_t)total;")

    def encode_body(self) -> list[str]:
        self.reset(decoding=False)
        fn = self.program.encode
        (gname, _), = fn.args
        # With a residual, g is added into it and the sum r is encoded. Element reads stay
        # plain loads of r (a lazy r[i] + g[i] stopped GCC vectorising some encoders and
        # slowed topk's scalar compaction 3x); the add itself is the first op of the first
        # pass over g where there is one (``flush``), else a pass of its own before
        # anything reads g (``settle_residual``). A gather may read any index, so an
        # encoder with one adds first.
        self.emit("const float* g_in = g_ptr;")
        self.emit("if (r_ptr) g_ptr = r_ptr;")
        self.residual_pending = True
        if _calls(fn.body, "gather"):
            self.settle_residual()
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
            self.emit(f"hp::scatter_out(out, n, accumulate, scale, feedback, {count}, "
                      f"{index_fn}, {value_fn});")
        else:
            self.open_pass("n", deps)
            value_fn = self.element_fn(value, "f32", staged=True)
            op = f"hp::write_out(out, accumulate, scale, feedback, {value_fn})"
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
        self.pass_stage, self.stage_index, self.pass_extremes = [], None, {}
        self.residual_pending = False

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


class CpuRenderer(CRenderer):
    """C++17 with OpenMP. Element lambdas capture by value, so the optimiser keeps
    scalars in registers instead of reloading them after every store."""

    target = "cpu"
    template = "cpu_kernel.cpp.j2"
    lam = "[=]"
    direct_reductions = True
    merged_extremes = True


class CudaRenderer(CRenderer):
    """CUDA C++17: element lambdas are extended device lambdas that capture by value."""

    target = "cuda"
    template = "cuda_kernel.cu.j2"
    lam = "[=] __device__"
    rint = "rintf"


def _shape(node: object) -> object:
    """An IR node's structure without source positions and types: two reductions over
    the same elements have the same shape."""
    if isinstance(node, (list, tuple)):
        return tuple(_shape(x) for x in node)
    if dataclasses.is_dataclass(node):
        return (type(node).__name__, *(_shape(getattr(node, f.name))
                                       for f in dataclasses.fields(node)
                                       if f.name not in ("pos", "ty", "operand_ty",
                                                         "param_types", "annotation_pos")))
    return node


def _calls(node: object, fn: str) -> bool:
    """Whether any call of ``fn`` appears in an IR node (or a list of nodes)."""
    if isinstance(node, ir.Call) and node.fn == fn:
        return True
    if isinstance(node, (list, tuple)):
        return any(_calls(x, fn) for x in node)
    if dataclasses.is_dataclass(node):
        return any(_calls(getattr(node, f.name), fn) for f in dataclasses.fields(node))
    return False


def render(program: ir.Program, target: str) -> str:
    """Render a checked program for ``target`` (``"cpu"`` or ``"cuda"``)."""
    renderers: dict[str, type[CRenderer]] = {"cpu": CpuRenderer, "cuda": CudaRenderer}
    if target not in renderers:
        raise BuildError(f"no renderer for target {target!r}")
    renderer = renderers[target](program)
    dump_stage("lower", renderer.program)
    source = renderer.source()
    dump_stage("render", source)
    return source
