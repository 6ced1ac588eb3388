"""The payload's statements of the C-style renderer: encode's section sizes, header and
section writes; decode's validation of the header and every section, and the binding of
the sections to names. ``compll.render.CRenderer`` extends it with the loops."""

from __future__ import annotations

from . import ir
from . import schedule as sch
from .expressions import ONCE, ExprRenderer
from .ir import LengthKind, TypeKind
from .payload import size_rule
from .typing_rules import ITEMSIZE

__all__ = ["SectionRenderer"]


class SectionRenderer(ExprRenderer):
    """Prints the payload's items of a kernel's schedule."""

    #: what the target's runtime offers the schedule (``compll.schedule.Options``)
    options = sch.Options()

    @property
    def settle(self) -> str:
        return ", settle" if self.options.settles else ""

    # -- encode: the payload ------------------------------------------------------------------
    def section_size(self, x: ir.Expr, section: ir.Section) -> str:
        rule = size_rule(section.ty)
        if section.ty.kind is TypeKind.SCALAR:
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
        self.emit(f"const {self.ctype(item.elem)} {tmp} = "
                  f"{self.as_elem(item.value, item.elem, ONCE)};")
        self.emit(f"hp::put_bytes(sec[{item.section}], &{tmp}, sz[{item.section}]);")

    def item_packedsection(self, item: sch.PackedSection) -> None:
        self.emit(f"hp::copy_bytes(sec[{item.section}], pk_{self.safe(item.name)}, "
                  f"sz[{item.section}]);")

    def item_return(self, item: sch.Return) -> None:
        if self.kernel.fn == "encode":
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
            if ty.kind is TypeKind.SCALAR:
                want = rule.bytes(1)
                self.emit(f"cnt[{k}] = 1;")
                self.emit(f"if (sz[{k}] != {want}) return hp::fail(err, errcap, "
                          f"\"a {ty.elem} section must be {want} bytes, not %llu\", sz[{k}]);")
                continue
            assert ty.length is not None
            fixed = self.fixed_count(ty.length)
            what = f"u{ty.bits}" if ty.kind is TypeKind.PACKED else ty.elem
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

    def fixed_count(self, length: ir.Length) -> str | None:
        """A C expression for a section's element count known from n, or None."""
        if length.kind is LengthKind.N:
            return "n"
        if length.kind is LengthKind.CONST:
            return str(length.value)
        if length.kind is LengthKind.BLOCKS:
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
            if ty.kind is TypeKind.SCALAR:
                t = self.ctype(ty.elem)
                self.emit(f"const {t} {self.scalars[name]} = hp::get<{t}>(s_{n});")
            elif ty.kind is TypeKind.PACKED:
                self.emit(f"const uint8_t* pk_{n} = s_{n};")
            else:
                t = self.ctype(ty.elem)
                self.emit(f"auto a_{n} = {self.lam}(uint64_t i) -> {t} "
                          f"{{ return hp::load<{t}>(s_{n}, i); }};")
            self.emit(f"sec += hp_pad8(sz[{k}]);")
