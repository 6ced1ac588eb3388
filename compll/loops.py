"""The scheduling passes that decide how loops read their values, so the renderer
only prints: values the same for every element move out of the loops
(``hoist_invariants``), fused passes stage packed and per-block arrays in L1
(``stage_passes``), and the random streams' keys, buffers and the decoder's output pass
are marked (``mark_outputs``). Each takes a kernel's items and returns new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from . import ir
from .builtins import BUILTINS, Kind
from .constants import MAX_STAGED, SUM_CHUNK
from .ir import LengthKind, TypeKind
from .schedule import (
    ArrayInfo,
    ArrayKind,
    BindSections,
    BlockReduce,
    CheckInputOp,
    CheckSections,
    Extreme,
    Item,
    Lazy,
    LoopOp,
    MinMax,
    PackLet,
    PackStore,
    Pass,
    Scalar,
    Scatter,
    ScatterOut,
    Selection,
    Store,
    StreamKeys,
    Sum,
    TakeInputOp,
    WriteOut,
)
from .typing_rules import promote_one

__all__ = ["uniform", "expands", "hoist_invariants", "stage_passes", "mark_outputs",
           "block_arrays"]

_SCALAR_FNS = (Kind.CAST, Kind.ELEMENTWISE)

#: loop ops that need no more than their own elements: they may run block by block
_SPLIT = (Store, PackStore, WriteOut, TakeInputOp, CheckInputOp)


def uniform(e: ir.Expr, bound: frozenset[str] | Mapping[str, str],
            arrays: Mapping[str, ArrayInfo], scalars: Mapping[str, object],
            params: Mapping[str, object], locals_ok: bool) -> bool:
    """Whether a scalar expression is the same for every element of a loop.

    With ``locals_ok`` false it must also use only literals and parameters (so the
    interpreter can fold it); otherwise scalar locals and ``size`` count as well.
    ``bound``: the lambda parameters in scope (never uniform).
    """
    if e.ty is None or e.ty.kind is not TypeKind.SCALAR:
        return False
    if isinstance(e, ir.Const):
        return True
    if isinstance(e, ir.Var):
        if e.name in bound or e.name in arrays:
            return False
        return locals_ok or (e.name in params and e.name not in scalars)
    if isinstance(e, ir.Call):
        if e.fn == "size":
            return locals_ok
        return BUILTINS[e.fn].kind in _SCALAR_FNS and \
            all(uniform(a, bound, arrays, scalars, params, locals_ok) for a in e.args)
    return all(uniform(c, bound, arrays, scalars, params, locals_ok) for c in ir.operands(e))


# -- hoisting -----------------------------------------------------------------------------------

class _Hoister:
    """Replaces the uniform subexpressions of loop bodies by scalars computed before."""

    def __init__(self, arrays: dict[str, ArrayInfo], scalars: dict[str, str],
                 params: Mapping[str, object]) -> None:
        self.arrays, self.scalars, self.params = arrays, scalars, params
        self.lets: list[Scalar] = []  # the temporaries the current item needs first
        self.made = 0  # temporaries named so far

    def temp(self, e: ir.Expr) -> ir.Var:
        assert e.ty is not None
        elem = promote_one(e.ty.elem) if e.ty.literal else e.ty.elem
        self.made += 1
        name = f"%{self.made}"
        self.scalars[name] = elem
        self.lets.append(Scalar(name, e, elem))
        return ir.Var(name, e.pos, ir.Type.scalar(elem))

    def expr(self, e: ir.Expr, bound: frozenset[str] = frozenset()) -> ir.Expr:
        if isinstance(e, (ir.Var, ir.Const)):
            return e
        if not isinstance(e, ir.Lambda):
            if uniform(e, bound, self.arrays, self.scalars, self.params, locals_ok=False):
                return e  # the renderer folds it to a literal
            if uniform(e, bound, self.arrays, self.scalars, self.params, locals_ok=True):
                return self.temp(e)
        if isinstance(e, ir.Lambda):
            return dataclasses.replace(e, body=self.expr(e.body, bound | set(e.params)))
        if isinstance(e, ir.Unary):
            return dataclasses.replace(e, operand=self.expr(e.operand, bound))
        if isinstance(e, ir.Binary):
            return dataclasses.replace(e, left=self.expr(e.left, bound),
                                       right=self.expr(e.right, bound))
        if isinstance(e, ir.Select):
            return dataclasses.replace(e, cond=self.expr(e.cond, bound),
                                       then=self.expr(e.then, bound),
                                       other=self.expr(e.other, bound))
        assert isinstance(e, ir.Call)
        if e.fn == "iota":  # its count is an extent's, compared by shape: left as written
            return e
        return self.call(e, range(len(e.args)), bound)

    def call(self, e: ir.Call, loop_args: range | tuple[int, ...],
             bound: frozenset[str] = frozenset()) -> ir.Call:
        """``e`` with the arguments at ``loop_args`` (those read per element) and its
        keyword lambdas rewritten."""
        args = tuple(self.expr(a, bound) if k in loop_args else a for k, a in enumerate(e.args))
        kwargs = tuple((k, self.expr(v, bound) if isinstance(v, ir.Lambda) else v)
                       for k, v in e.kwargs)
        return dataclasses.replace(e, args=args, kwargs=kwargs)

    def key(self, key: ir.Lambda | None) -> ir.Lambda | None:
        if key is None:
            return None
        out = self.expr(key)
        assert isinstance(out, ir.Lambda)
        return out

    def op(self, op: LoopOp) -> LoopOp:
        if isinstance(op, (Sum, Extreme, MinMax)):
            return dataclasses.replace(op, array=self.expr(op.array), key=self.key(op.key))
        if isinstance(op, (Store, PackStore, WriteOut)):
            return dataclasses.replace(op, value=self.expr(op.value))
        return op

    def item(self, item: Item) -> Item:
        if isinstance(item, Lazy):
            out = dataclasses.replace(item, value=self.expr(item.value))
            self.arrays[item.name] = dataclasses.replace(self.arrays[item.name], value=out.value)
            return out
        if isinstance(item, BlockReduce):
            return dataclasses.replace(item, array=self.expr(item.array), key=self.key(item.key))
        if isinstance(item, Selection):  # topk's k is read once, before the scan
            return dataclasses.replace(item, call=self.call(item.call, (0, 1)
                                                            if item.call.fn == "filter" else (0,)))
        if isinstance(item, (Scatter, ScatterOut)):  # the size is read once
            return dataclasses.replace(item, call=self.call(item.call, (0, 1)))
        if isinstance(item, PackLet):
            return dataclasses.replace(item, call=self.call(item.call, (0,)))
        if isinstance(item, Pass):
            return dataclasses.replace(item, ops=tuple(self.op(op) for op in item.ops))
        return item


def hoist_invariants(items: list[Item], arrays: dict[str, ArrayInfo], scalars: dict[str, str],
                     params: Mapping[str, object]) -> list[Item]:
    """Compute each value that is the same for every element of a loop once, before
    the loop: a ``Scalar`` named ``%k`` (a name no program can use) replaces it.

    ``arrays`` and ``scalars`` are updated with the rewritten lazy arrays and the
    temporaries. A pass's prologue holds the rewritten copies of its per-block items,
    whose temporaries come before those items.
    """
    h = _Hoister(arrays, scalars, params)
    out: list[Item] = []
    moved: dict[str, BlockReduce | Lazy] = {}  # in_pass items, rewritten where they stand
    for item in items:
        if isinstance(item, Pass) and item.prologue:
            item = dataclasses.replace(item, prologue=tuple(moved[p.name] for p in item.prologue))
        new = h.item(item)
        if isinstance(new, (BlockReduce, Lazy)) and new.in_pass:
            moved[new.name] = new
        out += h.lets
        out.append(new)
        h.lets = []
    return out


# -- staging ------------------------------------------------------------------------------------

def block_arrays(items: list[Item], arrays: Mapping[str, ArrayInfo],
                 layout: tuple[ir.Section, ...]) -> frozenset[str]:
    """The f32 arrays of one value per block that the kernel holds in memory: block
    reductions' outputs, per-block arrays (materialised) and decode's sections."""
    out: set[str] = set()
    for item in items:
        if isinstance(item, BlockReduce) and item.elem == "f32":
            out |= {item.name, item.other} - {""}
        elif isinstance(item, Lazy) and item.materialize and arrays[item.name].elem == "f32":
            out.add(item.name)
        elif isinstance(item, BindSections):
            for name, section in zip(item.names, layout, strict=True):
                length = section.ty.length
                if section.ty.elem == "f32" and length is not None \
                        and length.kind is LengthKind.BLOCKS:
                    out.add(name)
    return frozenset(out)


def expands(e: ir.Expr, arrays: Mapping[str, ArrayInfo], blocks: frozenset[str]) -> bool:
    """Whether elements of ``e`` read ``expand`` of an array in memory, directly or
    through lazy arrays."""
    if isinstance(e, ir.Call):
        if e.fn == "expand":
            r = e.args[0]
            return isinstance(r, ir.Var) and r.name in blocks
        return any(expands(a, arrays, blocks) for a in e.args)
    if isinstance(e, ir.Lambda):
        return expands(e.body, arrays, blocks)
    if isinstance(e, ir.Var):
        arr = arrays.get(e.name)
        return (arr is not None and arr.value is not None and not arr.buffer
                and e.name not in blocks and expands(arr.value, arrays, blocks))
    return any(expands(x, arrays, blocks) for x in ir.operands(e))


class _Reads:
    """What a staged element function reads, in the order the renderer meets it:
    ``("unpack", name, bits)``, ``("expand", name, block)`` and ``("inline", name, 0)``.
    ``staged``: at the element index of the pass itself (not inside a lambda or gather)."""

    def __init__(self, arrays: Mapping[str, ArrayInfo], blocks: frozenset[str],
                 expanding: bool) -> None:
        self.arrays, self.blocks, self.expanding = arrays, blocks, expanding

    def walk(self, e: ir.Expr, staged: bool, bound: frozenset[str]
             ) -> Iterator[tuple[str, str, int]]:
        if isinstance(e, ir.Var):
            arr = self.arrays.get(e.name)
            if e.name in bound or arr is None or arr.kind is ArrayKind.PACKED:
                return
            if self.expanding and expands(e, self.arrays, self.blocks):
                assert arr.value is not None
                yield "inline", e.name, 0
                yield from self.walk(arr.value, staged, bound)
            return
        if isinstance(e, ir.Call):
            yield from self.call(e, staged, bound)
            return
        for x in ir.operands(e):
            yield from self.walk(x, staged, bound)

    def call(self, e: ir.Call, staged: bool, bound: frozenset[str]
             ) -> Iterator[tuple[str, str, int]]:
        if e.fn == "map":
            for a in e.args[:-1]:
                yield from self.walk(a, staged, bound)
            lam = e.args[-1]
            assert isinstance(lam, ir.Lambda)
            yield from self.walk(lam.body, False, bound | set(lam.params))
        elif e.fn == "expand":
            (r,) = e.args
            if staged and self.expanding and isinstance(r, ir.Var) and r.name in self.blocks:
                assert r.ty is not None and r.ty.length is not None
                yield "expand", r.name, r.ty.length.value
            else:
                yield from self.walk(r, False, bound)
        elif e.fn == "unpack":
            (p,) = e.args
            if staged:
                assert isinstance(p, ir.Var) and p.ty is not None
                yield "unpack", p.name, p.ty.bits
        elif e.fn == "gather":
            yield from self.walk(e.args[0], False, bound)
            yield from self.walk(e.args[1], staged, bound)
        elif e.fn in ("randint",) or BUILTINS[e.fn].kind in _SCALAR_FNS:
            for a in e.args:
                yield from self.walk(a, staged, bound)

    def op(self, op: LoopOp) -> Iterator[tuple[str, str, int]]:
        if isinstance(op, (Sum, Extreme, MinMax)):
            yield from self.walk(op.array, True, frozenset())
            if op.key is not None:
                yield from self.walk(op.key.body, False, frozenset(op.key.params))
        elif isinstance(op, (Store, PackStore, WriteOut)):
            yield from self.walk(op.value, True, frozenset())


def _staged(item: Pass, reads: _Reads) -> Pass:
    stage: list[tuple[str, int]] = []
    expand: list[tuple[str, int]] = []
    inline: set[str] = set()
    for op in item.ops:
        for what, name, n in reads.op(op):
            if what == "inline":
                inline.add(name)
                continue
            slots = stage if what == "unpack" else expand
            if (name, n) not in slots and len(slots) < MAX_STAGED:
                slots.append((name, n))
    sizes = {b for _, b in expand}
    by_block = (len(sizes) == 1 and all(b > 0 and b % 8 == 0 and SUM_CHUNK % b == 0
                                        for b in sizes)
                and all(isinstance(op, _SPLIT) for op in item.ops))
    return dataclasses.replace(item, stage=tuple(stage), expand=tuple(expand),
                               inline=frozenset(inline), by_block=by_block)


def stage_passes(items: list[Item], arrays: Mapping[str, ArrayInfo], blocks: frozenset[str],
                 expanding: bool) -> list[Item]:
    """Choose, per fused pass, the packed arrays whose ``unpack`` it stages in L1 chunk by
    chunk and (``expanding``: where the runtime stages them) the per-block arrays whose
    ``expand`` it does, up to ``MAX_STAGED`` each, in the order its ops read them; the
    rest are read in place. A pass that stages one block size dividing ``SUM_CHUNK`` and
    whose ops need no more than their own elements runs block by block."""
    reads = _Reads(arrays, blocks, expanding)
    return [_staged(item, reads) if isinstance(item, Pass) else item for item in items]


# -- outputs ------------------------------------------------------------------------------------

def _streams(items: list[Item]) -> tuple[int, ...]:
    found: set[int] = set()

    def visit(node: object) -> None:
        if isinstance(node, ir.Call) and node.fn in ("random", "randint"):
            found.add(node.stream)
        if isinstance(node, (list, tuple)):
            for x in node:
                visit(x)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                visit(getattr(node, f.name))

    visit(items)
    return tuple(sorted(found))


def mark_outputs(items: list[Item], fn: str, settles: bool) -> list[Item]:
    """Materialise per-block lazy arrays (``expand`` reads them per element); put the
    random streams' keys first (decode: after the payload's check); and where the target
    ``settles``, hand decode's output pass to the caller."""
    out: list[Item] = []
    for item in items:
        if isinstance(item, Lazy):
            length = item.value.ty.length if item.value.ty is not None else None
            item = dataclasses.replace(item, materialize=length is not None
                                       and length.kind is LengthKind.BLOCKS)
        if settles and isinstance(item, Pass) and [type(op) for op in item.ops] == [WriteOut]:
            item = dataclasses.replace(item, settle=True)
        out.append(item)
    streams = _streams(items)
    if streams:
        at = 0 if fn == "encode" else 1 + next(k for k, x in enumerate(out)
                                               if isinstance(x, CheckSections))
        out.insert(at, StreamKeys(streams))
    return out
