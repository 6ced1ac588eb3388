"""Render scheduled CompLL kernels into C-family source: one base, thin targets.

``CRenderer`` walks the schedule (``compll.schedule``) that ``lower`` and the scheduling
functions made, one method per item and per loop op, on top of the expression renderer
(``compll.expressions``). Every array is either *lazy* (a lambda from element index to
value, so elementwise chains fuse) or a *buffer* (the result of a barrier operator); a
``Pass`` becomes one ``hp::fused`` loop. The targets differ only in class attributes
(lambda qualifier, rounding builtin, template, the schedule's ``Options``) and in the
runtime each header implements: the same ``hp::`` calls run as loops on a thread pool on
the CPU and as kernels on the GPU.

DSL names never reach the output as written: locals are ``v_NAME``, arrays ``a_NAME``,
lambda parameters ``l_NAME`` (names are ``[A-Za-z_][A-Za-z0-9_]*`` by the grammar, so
no prefixed name is a keyword or a runtime symbol), and literals are rendered typed.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from . import ir
from . import schedule as sch
from .diagnostics import BuildError
from .expressions import ONCE, Scope
from .ir import FLOATS
from .payload import algorithm_id
from .sections import SectionRenderer
from .typing_rules import promote_one

__all__ = ["CRenderer", "CpuRenderer", "CudaRenderer", "render", "renderer_for"]

_TEMPLATES = Path(__file__).parent / "templates"


class CRenderer(SectionRenderer):
    """The shared C-style renderer: a walk over a kernel's schedule that prints it."""

    # -- element functions --------------------------------------------------------------------
    def element_fn(self, e: ir.Expr, elem: str, loop: sch.Pass | None = None) -> str:
        """A lambda over element indices computing ``e`` as ``elem``; the element
        functions of a fused ``loop`` also take its ``hp::Stage``."""
        i = self.fresh("i")
        body = self.as_elem(e, elem, Scope(index=i, staged=i if loop else None, loop=loop))
        return f"{self.lam}({self.signature(i, loop is not None)}) -> {self.ctype(elem)} " \
               f"{{ return {body}; }}"

    @staticmethod
    def signature(i: str, staged: bool) -> str:
        return f"uint64_t {i}, const hp::Stage& st" if staged else f"uint64_t {i}"

    def keyed_fn(self, a: ir.Expr, key: ir.Lambda | None, elem: str,
                 loop: sch.Pass | None = None) -> str:
        """The lambda of ``key(a[i])`` (or ``a[i]`` without a key) as ``elem``."""
        if key is None:
            return self.element_fn(a, elem, loop)
        assert key.ty is not None
        i = self.fresh("i")
        sc = Scope(index=i, staged=i if loop else None, loop=loop)
        value = self.apply(key, [self.expr(a, sc)], i, sc)
        body = self.convert(value, key.ty.elem, elem)
        return (f"{self.lam}({self.signature(i, loop is not None)}) -> {self.ctype(elem)} "
                f"{{ return {body}; }}")

    def bind_buffer(self, name: str, buf: str, elem: str) -> None:
        n = self.safe(name)
        t = self.ctype(elem)
        self.emit(f"{t}* b_{n} = {buf}.data();")
        self.emit(f"auto a_{n} = {self.lam}(uint64_t i) -> {t} {{ return b_{n}[i]; }};")
        self.emit(f"const uint64_t a_{n}_len = {buf}.size();")

    def block_bytes(self, name: str) -> str:
        """The bytes of a one-value-per-block f32 array in memory (a pass stages them)."""
        arr = self.arrays[name]
        if arr.value is None and not arr.buffer:  # a payload section, read in place
            return f"s_{self.safe(name)}"
        return f"(const uint8_t*)b_{self.safe(name)}"

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

    def item_streamkeys(self, item: sch.StreamKeys) -> None:
        for s in item.streams:
            self.emit(f"const uint32_t key_{s} = hp_stream_key(seed, step, {s}u);")

    def item_scalar(self, item: sch.Scalar) -> None:
        c = self.scalars[item.name]
        self.emit(f"const {self.ctype(item.elem)} {c} = "
                  f"{self.as_elem(item.value, item.elem, ONCE)};")

    def item_lazy(self, item: sch.Lazy) -> None:
        assert item.value.ty is not None
        elem = item.value.ty.elem
        if not item.materialize:
            self.emit(f"auto a_{self.safe(item.name)} = {self.element_fn(item.value, elem)};")
            return
        buf = self.fresh("blk")  # read per element by expand: evaluated into a buffer
        extent = self.extent(self.arrays[item.name].extent)
        if item.in_pass:  # filled by the prologue of a later pass
            self.emit(f"hp::buffer<{self.ctype(elem)}> {buf}({extent});")
        else:
            self.emit(f"auto {buf} = hp::materialize<{self.ctype(elem)}>({extent}, "
                      f"{self.element_fn(item.value, elem)});")
        self.bind_buffer(item.name, buf, elem)

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
            sc = Scope(index=i)
            body = self.apply(e.args[1], [self.expr(a, sc)], i, sc)
            pred_fn = f"{self.lam}(uint64_t {i}) -> bool {{ return {body}; }}"
            call = (f"hp::filter<{t}>({self.length(a)}, {self.element_fn(a, elem)}, {pred_fn}, "
                    f"{tail}{watch});")
        elif e.fn == "sort":
            desc = e.kwarg("descending")
            flag = "true" if isinstance(desc, ir.Const) and desc.value else "false"
            call = (f"hp::sort<{t}>({self.length(a)}, {self.element_fn(a, elem)}, "
                    f"{self.key_or_value(e)}, {flag}, {tail});")
        else:
            call = (f"hp::topk<{t}>({self.length(a)}, (int64_t)({self.expr(e.args[1], ONCE)}), "
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
        m = f"(uint64_t)std::max<int64_t>(0, (int64_t)({self.expr(size, ONCE)}))"
        i = self.fresh("i")
        index_fn = (f"{self.lam}(uint64_t {i}) -> int64_t {{ return "
                    f"(int64_t)({self.at(idx, i, ONCE)}); }}")
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
        t = self.ctype(item.elem)
        count = self.extent(self.arrays[item.name].extent)
        bufs = {}
        for name in (item.name, item.other):
            if name:
                bufs[name] = self.fresh("blk")
                self.emit(f"hp::buffer<{t}> {bufs[name]}({count});")
        if item.other:
            self.bind_buffer(item.other, bufs[item.other], item.elem)
        if not item.in_pass:  # else a later pass's prologue fills the buffers
            self.emit(self.block_reduce(item, {n: f"{b}.data()" for n, b in bufs.items()}))
        self.bind_buffer(item.name, bufs[item.name], item.elem)

    def block_reduce(self, item: sch.BlockReduce, data: dict[str, str], rng: str = "") -> str:
        """The call reducing ``item``'s blocks into ``data`` (the buffers by name); with
        ``rng``, only blocks [k0, k1) (a pass's prologue, chunk by chunk)."""
        t = self.ctype(item.elem)
        fn = self.keyed_fn(item.array, item.key, "f32" if item.operand in FLOATS
                           else item.operand)
        direct = "true" if item.direct else "false"
        at = "k0, k1, " if rng else ""
        if item.other:
            lo, hi = (item.name, item.other) if item.op == "min" else (item.other, item.name)
            args = (f"{self.length(item.array)}, {item.block}u, {at}{fn}, {data[lo]}, "
                    f"{data[hi]}")
            return f"hp::block_minmax_f32{rng}<{direct}>({args});"
        args = f"{self.length(item.array)}, {item.block}u, {at}{fn}, {data[item.name]}"
        if item.op == "sum" and item.operand in FLOATS:
            return f"hp::block_sum_f32{rng}<{direct}>({args});"
        if item.op == "sum":
            return f"hp::block_sum_int{rng}<{t}>({args});"
        is_max = "true" if item.op == "max" else "false"
        if item.operand in FLOATS:
            return f"hp::block_extreme_f32{rng}<{is_max}, {direct}>({args});"
        return f"hp::block_extreme_int{rng}<{is_max}, {self.ctype(item.operand)}>({args});"

    # -- passes -------------------------------------------------------------------------------
    def item_pass(self, item: sch.Pass) -> None:
        ops = []
        for op in item.ops:
            for name, elem in _results(op):
                self.emit(f"{self.ctype(elem)} {self.scalars[name]};")
            ops.append(getattr(self, "op_" + type(op).__name__.lower())(op, item))
        fields = (f"{{{', '.join(f'pk_{self.safe(n)}' for n, _ in item.stage)}}}, "
                  f"{{{', '.join(f'{b}u' for _, b in item.stage)}}}, {len(item.stage)}")
        if item.expand:
            xs = ", ".join(self.block_bytes(n) for n, _ in item.expand)
            blocks = ", ".join(f"{b}u" for _, b in item.expand)
            fields += f", {{{xs}}}, {{{blocks}}}, {len(item.expand)}"
        body = ",\n      ".join(ops)
        by_block = "<true>" if item.by_block else ""
        extent = self.extent(item.extent)
        if item.prologue:
            pro = self.prologue(item)
            self.emit(f"hp::fused_pro{by_block or '<false>'}({extent}, {pro}, "
                      f"hp::Unpacks{{{fields}}},\n      {body});")
        elif item.settle:
            self.emit(f"hp::finish{by_block}(then, {extent}, hp::Unpacks{{{fields}}},\n"
                      f"      {body});")
        else:
            self.emit(f"hp::fused{by_block}({extent}, hp::Unpacks{{{fields}}},\n      {body});")

    def prologue(self, item: sch.Pass) -> str:
        """Declare the lambda that computes a chunk's blocks of ``item.prologue``
        (``fuse_blockwise``), before the pass's ops run on the chunk; return its name."""
        steps = []
        for p in item.prologue:
            if isinstance(p, sch.BlockReduce):
                data = {n: f"b_{self.safe(n)}" for n in (p.name, p.other) if n}
                steps.append(self.block_reduce(p, data, "_range"))
            else:
                assert p.value.ty is not None
                steps.append(f"hp::fill_range(b_{self.safe(p.name)}, k0, k1, "
                             f"{self.element_fn(p.value, p.value.ty.elem)});")
        pro = self.fresh("pro")
        self.emit(f"auto {pro} = {self.lam}(uint64_t lo, uint64_t hi) {{")
        self.emit(f"  const uint64_t k0 = lo / {item.block}u, "
                  f"k1 = hp::blocks(hi, {item.block}u);")
        for step in steps:
            self.emit("  " + step)
        self.emit("};")
        return pro

    @staticmethod
    def watching(op: sch.Sum | sch.Extreme | sch.MinMax | sch.Store | sch.PackStore) -> str:
        """The extra arguments of a reduction that also flags g (without a residual)."""
        return ", r_ptr ? nullptr : g_in, nonfinite.ptr()" if op.watch else ""

    def op_sum(self, op: sch.Sum, loop: sch.Pass) -> str:
        c = self.scalars[op.out]
        if op.operand in FLOATS:
            fn = self.keyed_fn(op.array, op.key, "f32", loop)
            return (f"hp::sum_f32{'<true>' if op.direct else ''}({fn}, &{c}"
                    f"{self.watching(op)})")
        fn = self.keyed_fn(op.array, op.key, op.operand, loop)
        return f"hp::sum_int<{self.ctype(op.elem)}>({fn}, &{c})"

    def op_extreme(self, op: sch.Extreme, loop: sch.Pass) -> str:
        c = self.scalars[op.out]
        is_max = "true" if op.op == "max" else "false"
        if op.operand in FLOATS:
            fn = self.keyed_fn(op.array, op.key, "f32", loop)
            return (f"hp::extreme_f32<{is_max}{', true' if op.direct else ''}>({fn}, &{c}"
                    f"{self.watching(op)})")
        fn = self.keyed_fn(op.array, op.key, op.operand, loop)
        return f"hp::extreme_int<{is_max}, {self.ctype(op.operand)}>({fn}, &{c})"

    def op_minmax(self, op: sch.MinMax, loop: sch.Pass) -> str:
        fn = self.keyed_fn(op.array, op.key, "f32", loop)
        lo, hi = self.scalars[op.lo], self.scalars[op.hi]
        return (f"hp::minmax_f32{'<true>' if op.direct else ''}({fn}, &{lo}, &{hi}"
                f"{self.watching(op)})")

    def op_store(self, op: sch.Store, loop: sch.Pass) -> str:
        fn = self.element_fn(op.value, op.elem, loop)
        return f"hp::store<{self.ctype(op.elem)}>(sec[{op.section}], {fn}{self.watching(op)})"

    def op_packstore(self, op: sch.PackStore, loop: sch.Pass) -> str:
        fn = self.element_fn(op.value, op.elem, loop)
        return f"hp::pack<{op.bits}>(sec[{op.section}], {fn}{self.watching(op)})"

    def op_takeinputop(self, op: sch.TakeInputOp, loop: sch.Pass) -> str:
        return f"hp::take_input_op(r_ptr, g_in, nonfinite.ptr(){self.settle})"

    def op_checkinputop(self, op: sch.CheckInputOp, loop: sch.Pass) -> str:
        return "hp::check_input_op(r_ptr, g_in, nonfinite.ptr())"

    def op_writeout(self, op: sch.WriteOut, loop: sch.Pass) -> str:
        fn = self.element_fn(op.value, "f32", loop)
        return f"hp::write_out(out, accumulate, scale, feedback, {fn})"

    def item_scatterout(self, item: sch.ScatterOut) -> None:
        _, m, count, index_fn, value_fn = self.scatter_parts(item.call)
        self.emit(f"if (!hp::check_indices({count}, {m}, {index_fn}, err, errcap)) return 2;")
        call = "finish_scatter(then, " if self.options.settles else "scatter_out("
        self.emit(f"hp::{call}out, n, accumulate, scale, feedback, {count}, "
                  f"{index_fn}, {value_fn});")

    # -- the kernel -----------------------------------------------------------------------------
    def body(self) -> list[str]:
        """The kernel's statements, one method per schedule item."""
        for item in self.kernel.items:
            getattr(self, "item_" + type(item).__name__.lower())(item)
        return self.lines

    def param_lines(self) -> list[str]:
        out = []
        types = {p.name: p.ty.elem for p in self.program.params}
        for name, value in self.program.param_values:
            elem = types[name]
            out.append(f"static const {self.ctype(elem)} p_{self.safe(name)} = "
                       f"{self.literal(value, elem)};")
        return out


def _results(op: sch.LoopOp) -> list[tuple[str, str]]:
    """The scalars a loop op computes, with their element types."""
    if isinstance(op, (sch.Sum, sch.Extreme)):
        return [(op.out, op.elem)]
    if isinstance(op, sch.MinMax):
        return [(op.lo, "f32"), (op.hi, "f32")]
    return []


class CpuRenderer(CRenderer):
    """C++17 on the runtime's thread pool. Element lambdas capture by value, so the optimiser keeps
    scalars in registers instead of reloading them after every store."""

    target = "cpu"
    template = "cpu_kernel.cpp.j2"
    lam = "[=]"
    options = sch.Options(direct_reductions=True, merged_extremes=True, fused_blocks=True,
                          watch_in_loops=True, staged_expands=True, settles=True)

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


def render(program: ir.Program, encode: sch.Kernel, decode: sch.Kernel, target: str) -> str:
    """The program's source for ``target`` from its two scheduled kernels."""
    cls = renderer_for(target)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_TEMPLATES)), keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined, autoescape=False, trim_blocks=True,
        lstrip_blocks=True,
    )
    first = cls(program, encode)
    return env.get_template(cls.template).render(
        name=program.name, algo_id=algorithm_id(program), params=first.param_lines(),
        encode=first.body(), decode=cls(program, decode).body(),
    )


def renderer_for(target: str) -> type[CRenderer]:
    """The renderer class of ``target`` (``"cpu"`` or ``"cuda"``)."""
    renderers: dict[str, type[CRenderer]] = {"cpu": CpuRenderer, "cuda": CudaRenderer}
    if target not in renderers:
        raise BuildError(f"no renderer for target {target!r}")
    return renderers[target]
