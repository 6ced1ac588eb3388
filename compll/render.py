"""Render scheduled CompLL kernels into C-family source: one base, thin targets.

``CRenderer`` walks the schedule (``compll.schedule``) that ``lower`` and the scheduling
functions made, one method per item and per loop op, on top of the expression renderer
(``compll.expressions``). Every array is either *lazy* (a lambda from element index to
value, so elementwise chains fuse) or a *buffer* (the result of a barrier operator); a
``Pass`` becomes one ``hp::fused`` loop. The targets differ only in class attributes
(lambda qualifier, rounding builtin, template, the schedule's ``Options``) and in the
runtime each header implements: the same ``hp::`` calls run as OpenMP loops on the CPU
and as kernels on the GPU.

DSL names never reach the output as written: locals are ``v_NAME``, arrays ``a_NAME``,
lambda parameters ``l_NAME`` (names are ``[A-Za-z_][A-Za-z0-9_]*`` by the grammar, so
no prefixed name is a keyword or a runtime symbol), and literals are rendered typed.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from . import ir
from . import schedule as sch
from .constants import SUM_CHUNK
from .diagnostics import BuildError
from .expressions import ExprRenderer
from .ir import FLOATS
from .payload import algorithm_id, size_rule
from .typing_rules import ITEMSIZE, promote_one

__all__ = ["CRenderer", "CpuRenderer", "CudaRenderer", "renderer_for"]

_TEMPLATES = Path(__file__).parent / "templates"


class CRenderer(ExprRenderer):
    """The shared C-style renderer: a walk over a kernel's schedule."""

    options = sch.Options()
    #: the target defers error feedback's residual update into the next encode: the
    #: encoder takes a ``settle`` and the decoder hands its output pass to ``then``
    #: (``hp::finish`` in cpu_runtime.h)
    settles = False

    @property
    def settle(self) -> str:
        return ", settle" if self.settles else ""

    # -- element functions --------------------------------------------------------------------
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

    def keyed_fn(self, a: ir.Expr, key: ir.Lambda | None, elem: str,
                 staged: bool = False) -> str:
        """The lambda of ``key(a[i])`` (or ``a[i]`` without a key) as ``elem``."""
        if key is None:
            return self.element_fn(a, elem, staged)
        assert key.ty is not None
        i = self.fresh("i")
        saved, self.stage_index = self.stage_index, (i if staged else None)
        try:
            value = self.apply(key, [self.at(a, i)], i)
        finally:
            self.stage_index = saved
        body = self.convert(value, key.ty.elem, elem)
        return (f"{self.lam}({self.signature(i, staged)}) -> {self.ctype(elem)} "
                f"{{ return {body}; }}")

    def emit(self, line: str) -> None:
        for pending in self.take_hoisted():
            self.lines.append("  " + pending)
        self.lines.append("  " + line)

    def bind_buffer(self, name: str, buf: str, elem: str) -> None:
        n = self.safe(name)
        t = self.ctype(elem)
        self.emit(f"{t}* b_{n} = {buf}.data();")
        self.emit(f"auto a_{n} = {self.lam}(uint64_t i) -> {t} {{ return b_{n}[i]; }};")
        self.emit(f"const uint64_t a_{n}_len = {buf}.size();")

    # -- statements ---------------------------------------------------------------------------
    def item_encodeinput(self, item: sch.EncodeInput) -> None:
        # With a residual, g is added into it and the sum r is encoded; element reads stay
        # plain loads of r (a lazy r[i] + g[i] stopped GCC vectorising some encoders).
        self.emit("const float* g_in = g_ptr;")
        self.emit("if (r_ptr) g_ptr = r_ptr;")
        self.emit("hp::Flag nonfinite;  // set by the first read of g, written to the header")
        self.emit(f"auto a_{self.safe(item.name)} = {self.lam}(uint64_t i) -> float "
                  "{ return g_ptr[i]; };")

    def item_takeinput(self, item: sch.TakeInput) -> None:
        checks = "true" if item.checks else "false"
        self.emit(f"hp::take_input(r_ptr, g_in, n, nonfinite.ptr(), {checks}{self.settle});")

    def item_scalar(self, item: sch.Scalar) -> None:
        c = self.scalars[item.name]
        self.emit(f"const {self.ctype(item.elem)} {c} = {self.as_elem(item.value, item.elem)};")

    def item_lazy(self, item: sch.Lazy) -> None:
        assert item.value.ty is not None
        elem = item.value.ty.elem
        fn = self.element_fn(item.value, elem)
        extent = self.arrays[item.name].extent
        length = item.value.ty.length
        if length is not None and length.kind == "blocks":  # read per element by expand
            buf = self.fresh("blk")
            if item.in_pass:  # filled by the prologue of a later pass
                self.emit(f"hp::buffer<{self.ctype(elem)}> {buf}({self.extent(extent)});")
                self.prologue_fns[item.name] = fn
            else:
                self.emit(f"auto {buf} = hp::materialize<{self.ctype(elem)}>("
                          f"{self.extent(extent)}, {fn});")
            self.bind_buffer(item.name, buf, elem)
            if elem == "f32":
                self.block_bytes[item.name] = f"(const uint8_t*)b_{self.safe(item.name)}"
            return
        self.emit(f"auto a_{self.safe(item.name)} = {fn};")

    def item_selection(self, item: sch.Selection) -> None:
        e = item.call
        a = e.args[0]
        assert a.ty is not None
        elem = a.ty.elem
        t = self.ctype(elem)
        vals, idx = self.fresh("vals"), self.fresh("idx")
        tail = f"{'&' + idx if item.index else 'nullptr'}, &{vals}"
        watch = ", r_ptr ? nullptr : g_in, nonfinite.ptr()" if item.watch else ""
        if e.fn == "filter":
            i = self.fresh("i")
            body = self.apply(e.args[1], [self.at(a, i)], i)
            pred_fn = f"{self.lam}(uint64_t {i}) -> bool {{ return {body}; }}"
            call = (f"hp::filter<{t}>({self.length(a)}, {self.element_fn(a, elem)}, {pred_fn}, "
                    f"{tail}{watch});")
        elif e.fn == "sort":
            desc = e.kwarg("descending")
            flag = "true" if isinstance(desc, ir.Const) and desc.value else "false"
            call = (f"hp::sort<{t}>({self.length(a)}, {self.element_fn(a, elem)}, "
                    f"{self.key_or_value(e)}, {flag}, {tail});")
        else:
            call = (f"hp::topk<{t}>({self.length(a)}, (int64_t)({self.expr(e.args[1])}), "
                    f"{self.element_fn(a, elem)}, {self.key_or_value(e)}, {tail}{watch});")
        self.emit(f"hp::buffer<{t}> {vals};")
        self.emit(f"hp::buffer<uint32_t> {idx};")
        self.emit(call)
        names = list(item.names)
        if item.index:
            self.bind_buffer(names.pop(0), idx, "u32")
        self.bind_buffer(names[0], vals, elem)

    def key_or_value(self, e: ir.Call) -> str:
        a = e.args[0]
        assert a.ty is not None
        key = e.kwarg("key")
        assert key is None or isinstance(key, ir.Lambda)
        elem = key.ty.elem if key is not None and key.ty is not None else a.ty.elem
        return self.keyed_fn(a, key, promote_one(elem) if elem in FLOATS else elem)

    def scatter_parts(self, e: ir.Call) -> tuple[str, str, str, str, str]:
        idx, vals, size = e.args
        assert vals.ty is not None
        elem = vals.ty.elem
        m = f"(uint64_t)std::max<int64_t>(0, (int64_t)({self.expr(size)}))"
        i = self.fresh("i")
        index_fn = (f"{self.lam}(uint64_t {i}) -> int64_t {{ return "
                    f"(int64_t)({self.at(idx, i)}); }}")
        return elem, m, self.length(idx), index_fn, self.element_fn(vals, elem)

    def item_scatter(self, item: sch.Scatter) -> None:
        elem, m, count, index_fn, value_fn = self.scatter_parts(item.call)
        buf = self.fresh("scat")
        self.emit(f"hp::buffer<{self.ctype(elem)}> {buf}({m});")
        if item.checked:
            self.emit(f"if (!hp::check_indices({count}, {m}, {index_fn}, err, errcap)) return 2;")
        self.emit(f"hp::scatter_add({buf}.data(), {m}, {count}, {index_fn}, {value_fn});")
        self.bind_buffer(item.name, buf, elem)

    def item_packlet(self, item: sch.PackLet) -> None:
        (a,) = item.call.args
        assert item.call.ty is not None and a.ty is not None
        bits = item.call.ty.bits
        n = self.safe(item.name)
        self.emit(f"const uint64_t pk_{n}_len = {self.length(a)};")
        self.emit(f"hp::buffer<uint8_t> pkb_{n}((pk_{n}_len * {bits} + 7) / 8);")
        self.emit(f"hp::pack_all<{bits}>(pkb_{n}.data(), pk_{n}_len, "
                  f"{self.element_fn(a, a.ty.elem)});")
        self.emit(f"const uint8_t* pk_{n} = pkb_{n}.data();")

    def item_blockreduce(self, item: sch.BlockReduce) -> None:
        n = self.safe(item.name)
        t = self.ctype(item.elem)
        count = self.extent(self.arrays[item.name].extent)
        float_op = item.operand in FLOATS
        fn = self.keyed_fn(item.array, item.key, "f32" if float_op else item.operand)
        is_max = "true" if item.op == "max" else "false"
        direct = "true" if item.direct else "false"
        buf = self.fresh("blk")
        self.emit(f"hp::buffer<{t}> {buf}({count});")
        # In a later pass's prologue the same call covers blocks [k0, k1) of each chunk.
        # (by the bound pointers: a by-value capture's buffers are const there).
        rng, at = ("_range", "k0, k1, ") if item.in_pass else ("", "")
        data = (lambda b, name: f"b_{self.safe(name)}") if item.in_pass \
            else (lambda b, name: f"{b}.data()")
        args = f"{self.length(item.array)}, {item.block}u, {at}{fn}, {data(buf, item.name)}"
        if item.other:
            other = self.fresh("blk")
            self.emit(f"hp::buffer<{t}> {other}({count});")
            lo, hi = ((buf, item.name), (other, item.other)) if item.op == "min" \
                else ((other, item.other), (buf, item.name))
            args = (f"{self.length(item.array)}, {item.block}u, {at}{fn}, {data(*lo)}, "
                    f"{data(*hi)}")
            call = f"hp::block_minmax_f32{rng}<{direct}>({args});"
            self.bind_buffer(item.other, other, item.elem)
            if item.elem == "f32":
                self.block_bytes[item.other] = f"(const uint8_t*)b_{self.safe(item.other)}"
        elif item.op == "sum" and float_op:
            call = f"hp::block_sum_f32{rng}<{direct}>({args});"
        elif item.op == "sum":
            call = f"hp::block_sum_int{rng}<{t}>({args});"
        elif float_op:
            call = f"hp::block_extreme_f32{rng}<{is_max}, {direct}>({args});"
        else:
            call = f"hp::block_extreme_int{rng}<{is_max}, {self.ctype(item.operand)}>({args});"
        if item.in_pass:
            self.prologue_calls[item.name] = call
        else:
            self.emit(call)
        self.bind_buffer(n, buf, item.elem)
        if item.elem == "f32":
            self.block_bytes[item.name] = f"(const uint8_t*)b_{n}"

    # -- passes -------------------------------------------------------------------------------
    def item_pass(self, item: sch.Pass) -> None:
        self.pass_stage, self.pass_expand = [], []
        ops = []
        for op in item.ops:
            for name, elem in _results(op):
                self.emit(f"{self.ctype(elem)} {self.scalars[name]};")
            ops.append(getattr(self, "op_" + type(op).__name__.lower())(op))
        srcs = ", ".join(s for s, _ in self.pass_stage)
        bits = ", ".join(f"{b}u" for _, b in self.pass_stage)
        fields = f"{{{srcs}}}, {{{bits}}}, {len(self.pass_stage)}"
        if self.pass_expand:
            xs = ", ".join(s for s, _ in self.pass_expand)
            blocks = ", ".join(f"{b}u" for _, b in self.pass_expand)
            fields += f", {{{xs}}}, {{{blocks}}}, {len(self.pass_expand)}"
        body = ",\n      ".join(ops)
        # Block by block (hp::BlockStage) where the runtime allows it: see fused_pro.
        sizes = {b for _, b in self.pass_expand}
        by_block = "<true>" if (self.stage_expands and len(sizes) == 1 and all(
            b > 0 and b % 8 == 0 and SUM_CHUNK % b == 0 for b in sizes) and all(
            isinstance(op, _SPLIT) for op in item.ops)) else ""
        if item.prologue:
            pro = self.fresh("pro")
            steps = [self.prologue_calls[p.name] if isinstance(p, sch.BlockReduce)
                     else f"hp::fill_range(b_{self.safe(p.name)}, k0, k1, "
                          f"{self.prologue_fns[p.name]});" for p in item.prologue]
            self.emit(f"auto {pro} = {self.lam}(uint64_t lo, uint64_t hi) {{")
            self.emit(f"  const uint64_t k0 = lo / {item.block}u, "
                      f"k1 = hp::blocks(hi, {item.block}u);")
            for step in steps:
                self.emit("  " + step)
            self.emit("};")
            self.emit(f"hp::fused_pro{by_block or '<false>'}({self.extent(item.extent)}, {pro}, "
                      f"hp::Unpacks{{{fields}}},\n      {body});")
        elif self.settles and [type(op) for op in item.ops] == [sch.WriteOut]:
            self.emit(f"hp::finish{by_block}(then, {self.extent(item.extent)}, "
                      f"hp::Unpacks{{{fields}}},\n      {body});")
        else:
            self.emit(f"hp::fused{by_block}({self.extent(item.extent)}, "
                      f"hp::Unpacks{{{fields}}},\n      {body});")
        self.pass_stage, self.pass_expand = [], []

    @staticmethod
    def watching(op: sch.Sum | sch.Extreme | sch.MinMax | sch.Store | sch.PackStore) -> str:
        """The extra arguments of a reduction that also flags g (without a residual)."""
        return ", r_ptr ? nullptr : g_in, nonfinite.ptr()" if op.watch else ""

    def op_sum(self, op: sch.Sum) -> str:
        c = self.scalars[op.out]
        if op.operand in FLOATS:
            fn = self.keyed_fn(op.array, op.key, "f32", staged=True)
            return (f"hp::sum_f32{'<true>' if op.direct else ''}({fn}, &{c}"
                    f"{self.watching(op)})")
        fn = self.keyed_fn(op.array, op.key, op.operand, staged=True)
        return f"hp::sum_int<{self.ctype(op.elem)}>({fn}, &{c})"

    def op_extreme(self, op: sch.Extreme) -> str:
        c = self.scalars[op.out]
        is_max = "true" if op.kind == "max" else "false"
        if op.operand in FLOATS:
            fn = self.keyed_fn(op.array, op.key, "f32", staged=True)
            return (f"hp::extreme_f32<{is_max}{', true' if op.direct else ''}>({fn}, &{c}"
                    f"{self.watching(op)})")
        fn = self.keyed_fn(op.array, op.key, op.operand, staged=True)
        return f"hp::extreme_int<{is_max}, {self.ctype(op.operand)}>({fn}, &{c})"

    def op_minmax(self, op: sch.MinMax) -> str:
        fn = self.keyed_fn(op.array, op.key, "f32", staged=True)
        lo, hi = self.scalars[op.lo], self.scalars[op.hi]
        return (f"hp::minmax_f32{'<true>' if op.direct else ''}({fn}, &{lo}, &{hi}"
                    f"{self.watching(op)})")

    def op_store(self, op: sch.Store) -> str:
        fn = self.element_fn(op.value, op.elem, staged=True)
        return f"hp::store<{self.ctype(op.elem)}>(sec[{op.section}], {fn}{self.watching(op)})"

    def op_packstore(self, op: sch.PackStore) -> str:
        fn = self.element_fn(op.value, op.elem, staged=True)
        return f"hp::pack<{op.bits}>(sec[{op.section}], {fn}{self.watching(op)})"

    def op_takeinputop(self, op: sch.TakeInputOp) -> str:
        return f"hp::take_input_op(r_ptr, g_in, nonfinite.ptr(){self.settle})"

    def op_checkinputop(self, op: sch.CheckInputOp) -> str:
        return "hp::check_input_op(r_ptr, g_in, nonfinite.ptr())"

    def op_writeout(self, op: sch.WriteOut) -> str:
        fn = self.element_fn(op.value, "f32", staged=True)
        return f"hp::write_out(out, accumulate, scale, feedback, {fn})"

    # -- encode: the payload ------------------------------------------------------------------
    def section_size(self, x: ir.Expr, section: ir.Section) -> str:
        rule = size_rule(section.ty)
        if section.ty.kind == "scalar":
            return str(rule.bytes(1))
        return rule.c(self.length(x))

    def item_payloadsizes(self, item: sch.PayloadSizes) -> None:
        count = len(item.sections)
        self.emit(f"uint64_t sz[{count}];")
        for k, (x, sec) in enumerate(item.sections):
            self.emit(f"sz[{k}] = {self.section_size(x, sec)};")
        self.emit(f"uint64_t total = hp::HEADER + 8 * {count};")
        self.emit(f"for (int k = 0; k < {count}; ++k) total += hp_pad8(sz[k]);")
        if item.residual_on_retry:  # the caller retries on r alone: it must hold r + g
            self.emit("if (total > cap) {")
            self.emit(f"  if (r_ptr) hp::add_into(r_ptr, g_in, n{self.settle});")
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

    def item_scalarsection(self, item: sch.ScalarSection) -> None:
        tmp = self.fresh("s")
        self.emit(f"const {self.ctype(item.elem)} {tmp} = {self.as_elem(item.value, item.elem)};")
        self.emit(f"hp::put_bytes(sec[{item.section}], &{tmp}, sz[{item.section}]);")

    def item_packedsection(self, item: sch.PackedSection) -> None:
        self.emit(f"hp::copy_bytes(sec[{item.section}], pk_{self.safe(item.name)}, "
                  f"sz[{item.section}]);")

    def item_return(self, item: sch.Return) -> None:
        if self.kernel_fn == "encode":
            self.emit("hp::mark_nonfinite(out, nonfinite);")
            self.emit("return (int64_t)total;")
        else:
            self.emit("return 0;")

    # -- decode: validate, then evaluate ------------------------------------------------------
    def item_checksections(self, item: sch.CheckSections) -> None:
        layout = self.program.layout
        count = len(layout)
        self.emit(f"uint64_t sz[{count}];")
        self.emit("uint32_t seed = 0, step = 0, flags = 0;")
        self.emit(f"if (!hp::read_header(p, size, ALGO_ID, n, {count}, sz, &seed, &step, "
                  "&flags, err, errcap)) return 1;")
        self.emit(f"uint64_t cnt[{count}];")
        for k, section in enumerate(layout):
            ty = section.ty
            rule = size_rule(ty)
            if ty.kind == "scalar":
                want = rule.bytes(1)
                self.emit(f"cnt[{k}] = 1;")
                self.emit(f"if (sz[{k}] != {want}) return hp::fail(err, errcap, "
                          f"\"a {ty.elem} section must be {want} bytes, not %llu\", sz[{k}]);")
                continue
            assert ty.length is not None
            fixed = self.fixed_count(ty.length)
            what = f"u{ty.bits}" if ty.kind == "packed" else ty.elem
            if fixed is not None:
                self.emit(f"cnt[{k}] = {fixed};")
                self.emit(f"if (sz[{k}] != {rule.c(f'cnt[{k}]')}) return hp::fail(err, errcap, "
                          f"\"a {what}[%llu] section must be %llu bytes\", cnt[{k}], "
                          f"{rule.c(f'cnt[{k}]')});")
            else:
                item_bytes = ITEMSIZE[ty.elem]
                self.emit(f"if (sz[{k}] % {item_bytes} != 0) return hp::fail(err, errcap, "
                          f"\"a {ty.elem} array section of %llu bytes is not whole elements\", "
                          f"sz[{k}]);")
                self.emit(f"cnt[{k}] = sz[{k}] / {item_bytes};")
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
        # A payload of non-finite values decodes to NaN whatever its sections hold.
        self.emit("if (flags & hp::NONFINITE) return hp::poison(out, n, feedback);")
        self.keys_at = len(self.lines)  # seed and step come from the header just read

    def fixed_count(self, length: ir.Length) -> str | None:
        """A C expression for a section's element count known from n, or None."""
        if length.kind == "n":
            return "n"
        if length.kind == "const":
            return str(length.value)
        if length.kind == "blocks":
            assert length.base is not None
            base = self.fixed_count(length.base)
            return None if base is None else f"hp::blocks({base}, {length.value})"
        return None

    def item_bindsections(self, item: sch.BindSections) -> None:
        self.emit(f"const uint8_t* sec = p + hp::HEADER + 8 * {len(self.program.layout)};")
        for k, (name, section) in enumerate(zip(item.names, self.program.layout, strict=True)):
            ty = section.ty
            n = self.safe(name)
            self.emit(f"const uint8_t* s_{n} = sec;")
            if ty.kind == "scalar":
                t = self.ctype(ty.elem)
                self.emit(f"const {t} {self.scalars[name]} = hp::get<{t}>(s_{n});")
            elif ty.kind == "packed":
                self.emit(f"const uint8_t* pk_{n} = s_{n};")
            else:
                t = self.ctype(ty.elem)
                self.emit(f"auto a_{n} = {self.lam}(uint64_t i) -> {t} "
                          f"{{ return hp::load<{t}>(s_{n}, i); }};")
                if ty.elem == "f32" and ty.length is not None and ty.length.kind == "blocks":
                    self.block_bytes[name] = f"s_{n}"
            self.emit(f"sec += hp_pad8(sz[{k}]);")

    def item_scatterout(self, item: sch.ScatterOut) -> None:
        _, m, count, index_fn, value_fn = self.scatter_parts(item.call)
        self.emit(f"if (!hp::check_indices({count}, {m}, {index_fn}, err, errcap)) return 2;")
        call = "finish_scatter(then, " if self.settles else "scatter_out("
        self.emit(f"hp::{call}out, n, accumulate, scale, feedback, {count}, "
                  f"{index_fn}, {value_fn});")

    # -- kernels and the whole source ---------------------------------------------------------
    def body(self, kernel: sch.Kernel) -> list[str]:
        self.lines, self.kernel_fn, self.keys_at = [], kernel.fn, 0
        self.arrays = kernel.arrays
        self.scalars = {name: ("((uint32_t)n)" if name == kernel.size_arg
                               else f"v_{self.safe(name)}") for name in kernel.scalars}
        self.streams = set()
        for item in kernel.items:
            getattr(self, "item_" + type(item).__name__.lower())(item)
        keys = [f"  const uint32_t key_{s} = hp_stream_key(seed, step, {s}u);"
                for s in sorted(self.streams)]
        return self.lines[:self.keys_at] + keys + self.lines[self.keys_at:]

    def params(self) -> list[str]:
        out = []
        types = {p.name: p.ty.elem for p in self.program.params}
        for name, value in self.program.param_values:
            elem = types[name]
            out.append(f"static const {self.ctype(elem)} p_{self.safe(name)} = "
                       f"{self.literal(value, elem)};")
        return out

    def source(self, encode: sch.Kernel, decode: sch.Kernel) -> str:
        """The program's source from its two scheduled kernels."""
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(_TEMPLATES)), keep_trailing_newline=True,
            undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
            lstrip_blocks=True,
        )
        return env.get_template(self.template).render(
            name=self.program.name, algo_id=algorithm_id(self.program),
            params=self.params(), encode=self.body(encode), decode=self.body(decode),
        )


#: loop ops that need no more than their own elements: they may run block by block
_SPLIT = (sch.Store, sch.PackStore, sch.WriteOut, sch.TakeInputOp, sch.CheckInputOp)


def _results(op: sch.LoopOp) -> list[tuple[str, str]]:
    """The scalars a loop op computes, with their element types."""
    if isinstance(op, (sch.Sum, sch.Extreme)):
        return [(op.out, op.elem)]
    if isinstance(op, sch.MinMax):
        return [(op.lo, "f32"), (op.hi, "f32")]
    return []


class CpuRenderer(CRenderer):
    """C++17 with OpenMP. Element lambdas capture by value, so the optimiser keeps
    scalars in registers instead of reloading them after every store."""

    target = "cpu"
    template = "cpu_kernel.cpp.j2"
    lam = "[=]"
    options = sch.Options(direct_reductions=True, merged_extremes=True, fused_blocks=True,
                          watch_in_loops=True)
    stage_expands = True
    settles = True

    @staticmethod
    def signature(i: str, staged: bool) -> str:
        # Generic over the stage: a chunk's (hp::Stage) or one block's (hp::BlockStage).
        return f"uint64_t {i}, const auto& st" if staged else f"uint64_t {i}"


class CudaRenderer(CRenderer):
    """CUDA C++17: element lambdas are extended device lambdas that capture by value."""

    target = "cuda"
    template = "cuda_kernel.cu.j2"
    lam = "[=] __device__"
    rint = "rintf"


def renderer_for(target: str) -> type[CRenderer]:
    """The renderer class of ``target`` (``"cpu"`` or ``"cuda"``)."""
    renderers: dict[str, type[CRenderer]] = {"cpu": CpuRenderer, "cuda": CudaRenderer}
    if target not in renderers:
        raise BuildError(f"no renderer for target {target!r}")
    return renderers[target]
