"""Scheduling: from a lowered program to the loop IR of ``compll.schedule``.

The steps, each a function over the IR: ``_Builder`` writes every loop op as a pass of
its own in program order; ``fuse`` joins independent loop ops over one extent into one
pass (a statement that needs a pass's results waits after it); ``merge_extremes`` turns
a float min and max of the same elements into one ``MinMax`` (``merge_block_extremes``
does the same for block reductions); ``fuse_blockwise`` runs a block reduction in the
prologue of the pass over its elements; and ``place_input`` puts the encoder's first read
of ``g`` (error feedback's ``r += g`` and the payload's non-finite flag) before any
other, as the first op of a pass over ``n`` where it can. Then ``compll.loops`` decides
how the loops read: ``mark_outputs`` (buffers, the random streams' keys, decode's output
pass), ``hoist_invariants`` (values the same for every element leave the loops) and
``stage_passes`` (what a fused pass stages in L1, and whether it runs block by block).
The passes after ``fuse`` live in ``compll.passes`` and ``compll.loops``. Each step
returns new (frozen) items and leaves its input as it was; the renderer only prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from . import ir
from .builtins import BUILTINS, Kind
from .ir import FLOATS, TypeKind, calls
from .loops import block_arrays, hoist_invariants, mark_outputs, stage_passes
from .passes import fuse_blockwise, merge_block_extremes, merge_extremes, place_input
from .schedule import (
    ArrayInfo,
    ArrayKind,
    BindSections,
    BlockReduce,
    CheckSections,
    EncodeInput,
    Extent,
    ExtentKind,
    Extreme,
    Item,
    Kernel,
    Lazy,
    LoopOp,
    N,
    Options,
    PackedSection,
    PackLet,
    PackStore,
    Pass,
    PayloadSizes,
    Return,
    Scalar,
    ScalarSection,
    Scatter,
    ScatterOut,
    Selection,
    Store,
    Sum,
    WriteOut,
    extent_of,
)

__all__ = ["schedule", "fuse", "merge_extremes", "merge_block_extremes", "fuse_blockwise",
           "place_input"]


# -- program order ------------------------------------------------------------------------------

class _How(StrEnum):
    """How ``fuse`` may place an item."""

    LOOP = "loop"  # a loop op: joins the open pass over its extent
    FREE = "free"  # may run early, before the open pass, if it needs none of its results
    BARRIER = "barrier"  # closes the open pass if it needs its results
    AFTER = "after"  # after every pass


@dataclass
class _Placed:
    """An unfused item with what it reads and writes, for ``fuse``."""

    item: Item
    reads: set[str]
    writes: set[str]
    how: _How


class _Builder:
    """Program order, one loop op per pass: the input of ``fuse``."""

    def __init__(self, program: ir.Program, fn: ir.Function, options: Options) -> None:
        self.program = program
        self.options = options
        self.fn = fn
        self.params = dict(program.param_values)
        self.arrays: dict[str, ArrayInfo] = {}
        self.scalars: dict[str, str] = {}
        self.deps: dict[str, set[str]] = {}
        self.out: list[_Placed] = []

    def deps_of(self, e: ir.Expr | None) -> set[str]:
        """Names a value depends on, through lazy arrays and lambdas."""
        if e is None:
            return set()
        if isinstance(e, ir.Var):
            return {e.name} | self.deps.get(e.name, set())
        if isinstance(e, ir.Lambda):
            return self.deps_of(e.body) - set(e.params)
        children: list[ir.Expr] = ir.operands(e)
        if isinstance(e, ir.Call):
            children = list(e.args) + [v for _, v in e.kwargs]
        out: set[str] = set()
        for child in children:
            out |= self.deps_of(child)
        return out

    def put(self, item: Item, how: _How, reads: set[str], writes: tuple[str, ...] = ()) -> None:
        for name in writes:
            self.deps[name] = set(reads)
        self.out.append(_Placed(item, reads, set(writes), how))

    def extent(self, e: ir.Expr) -> Extent:
        return extent_of(e, self.arrays)

    def cheap(self, e: ir.Expr, bound: frozenset[str] = frozenset()) -> bool:
        """Whether ``e``'s elements are float loads joined by +, -, *, comparisons, abs
        and selects: a reduction can evaluate those straight into vector registers."""
        if isinstance(e, ir.Const):
            return True
        if isinstance(e, ir.Lambda):
            return self.cheap(e.body, bound | set(e.params))
        if e.ty is None or e.ty.elem not in ("f32", "bool"):
            return False
        if isinstance(e, ir.Var):
            if e.name in bound or e.name in self.scalars or e.name in self.params:
                return True
            arr = self.arrays.get(e.name)
            return (arr is not None and arr.kind is ArrayKind.LAZY
                    and (arr.value is None or self.cheap(arr.value)))
        if isinstance(e, (ir.Unary, ir.Binary)):
            return e.op in _CHEAP_OPS and all(self.cheap(x, bound) for x in ir.operands(e))
        if isinstance(e, ir.Select):
            return all(self.cheap(x, bound) for x in ir.operands(e))
        if isinstance(e, ir.Call):
            return (e.fn in ("abs", "map") and not e.kwargs
                    and all(self.cheap(x, bound) for x in e.args))
        return False

    def buffer(self, name: str, elem: str) -> None:
        self.arrays[name] = ArrayInfo(ArrayKind.LAZY, elem, Extent(ExtentKind.BUFFER, name),
                                      buffer=True)

    # -- statements ---------------------------------------------------------------------------
    def let(self, s: ir.Let) -> None:
        value = s.value
        assert value.ty is not None
        if isinstance(value, ir.Call) and BUILTINS[value.fn].kind in (Kind.BARRIER, Kind.PACK):
            getattr(self, "let_" + value.fn)(s, value)
            return
        (name,) = s.names
        if value.ty.kind is TypeKind.ARRAY:
            self.arrays[name] = ArrayInfo(ArrayKind.LAZY, value.ty.elem, self.extent(value), value)
            self.put(Lazy(name, value), _How.FREE, self.deps_of(value), (name,))
            return
        self.scalars[name] = value.ty.elem
        self.put(Scalar(name, value, value.ty.elem), _How.FREE, self.deps_of(value), (name,))

    def let_reduce(self, s: ir.Let, e: ir.Call) -> None:
        (name,) = s.names
        a, op = e.args
        assert isinstance(op, ir.Var) and e.ty is not None and e.operand_ty is not None
        key = e.kwarg("key")
        assert key is None or isinstance(key, ir.Lambda)
        operand = e.operand_ty.elem
        deps = self.deps_of(e)
        direct = (operand in FLOATS and self.options.direct_reductions and self.cheap(a)
                  and (key is None or self.cheap(key)))
        if e.ty.kind is TypeKind.ARRAY:  # blockwise
            self.buffer(name, e.ty.elem)
            blocks = Extent(ExtentKind.BLOCKS, base=self.extent(a), block=_block(e))
            self.arrays[name] = dataclasses.replace(self.arrays[name], extent=blocks)
            self.put(BlockReduce(name, op.name, a, key, operand, e.ty.elem, _block(e), direct),
                     _How.BARRIER, deps, (name,))
            return
        out = e.ty.elem
        self.scalars[name] = out
        loop: LoopOp
        if op.name == "sum":
            loop = Sum(name, a, key, operand, out, direct)
        else:
            loop = Extreme(name, op.name, a, key, operand, out, direct)
        self.put(Pass(self.extent(a), (loop,)), _How.LOOP, deps, (name,))

    def let_selection(self, s: ir.Let, e: ir.Call) -> None:
        assert e.ty is not None and e.args[0].ty is not None
        with_index = e.ty.kind is TypeKind.TUPLE
        names = list(s.names)
        self.buffer(names[-1], e.args[0].ty.elem)
        if with_index:  # as long as the values: loops over both are one pass
            self.arrays[names[0]] = ArrayInfo(ArrayKind.LAZY, "u32",
                                              Extent(ExtentKind.BUFFER, names[-1]), buffer=True)
        self.put(Selection(s.names, e, with_index), _How.BARRIER, self.deps_of(e), s.names)

    let_filter = let_sort = let_topk = let_selection

    def let_scatter(self, s: ir.Let, e: ir.Call) -> None:
        (name,) = s.names
        assert e.ty is not None
        self.buffer(name, e.ty.elem)
        self.put(Scatter(name, e, self.fn.name == "decode"), _How.BARRIER, self.deps_of(e),
                 (name,))

    def let_pack(self, s: ir.Let, e: ir.Call) -> None:
        (name,) = s.names
        self.arrays[name] = ArrayInfo(ArrayKind.PACKED, "u8", Extent(ExtentKind.PACKED, name))
        self.put(PackLet(name, e), _How.BARRIER, self.deps_of(e), (name,))

    # -- encode -------------------------------------------------------------------------------
    def encode(self) -> None:
        (gname, _), = self.fn.args
        self.arrays[gname] = ArrayInfo(ArrayKind.LAZY, "f32", N)
        self.put(EncodeInput(gname), _How.FREE, set(), (gname,))
        for stmt in self.fn.body:
            if isinstance(stmt, ir.Let):
                self.let(stmt)
            else:
                assert isinstance(stmt.value, ir.Call)
                self.encode_return(stmt.value)

    def encode_return(self, ret: ir.Call) -> None:
        sections = list(zip(ret.args, self.program.layout, strict=True))
        size_deps: set[str] = set()
        for x, sec in sections:
            if sec.ty.kind is not TypeKind.SCALAR:
                size_deps |= self.deps_of(x)
        self.put(PayloadSizes(tuple(sections)), _How.BARRIER, size_deps)
        later: list[Item] = []
        for k, (x, sec) in enumerate(sections):
            ty = sec.ty
            if ty.kind is TypeKind.SCALAR:
                later.append(ScalarSection(k, x, ty.elem))
            elif ty.kind is TypeKind.PACKED and isinstance(x, ir.Var):
                later.append(PackedSection(k, x.name))
            elif ty.kind is TypeKind.PACKED:
                assert isinstance(x, ir.Call) and x.fn == "pack"
                (a,) = x.args
                assert a.ty is not None
                op: LoopOp = PackStore(k, a, a.ty.elem, ty.bits)
                self.put(Pass(self.extent(x), (op,)), _How.LOOP, self.deps_of(x))
            else:
                self.put(Pass(self.extent(x), (Store(k, x, ty.elem),)), _How.LOOP, self.deps_of(x))
        for item in later:
            self.put(item, _How.AFTER, set())
        self.put(Return(), _How.AFTER, set())

    # -- decode -------------------------------------------------------------------------------
    def decode(self) -> None:
        (_, _), (nname, _) = self.fn.args
        self.scalars[nname] = "u32"
        self.put(CheckSections(), _How.FREE, set())
        for stmt in self.fn.body:
            if isinstance(stmt, ir.Let):
                value = stmt.value
                if isinstance(value, ir.Call) and value.fn == "extract":
                    self.bind_sections(stmt)
                else:
                    self.let(stmt)
            else:
                self.decode_return(stmt.value)

    def bind_sections(self, s: ir.Let) -> None:
        for k, (name, section) in enumerate(zip(s.names, self.program.layout, strict=True)):
            ty = section.ty
            if ty.kind is TypeKind.SCALAR:
                self.scalars[name] = ty.elem
            elif ty.kind is TypeKind.PACKED:
                self.arrays[name] = ArrayInfo(ArrayKind.PACKED, "u8",
                                              Extent(ExtentKind.SECTION, index=k))
            else:
                self.arrays[name] = ArrayInfo(ArrayKind.LAZY, ty.elem,
                                              Extent(ExtentKind.SECTION, index=k))
        self.put(BindSections(s.names), _How.FREE, set(), s.names)

    def decode_return(self, value: ir.Expr) -> None:
        if isinstance(value, ir.Call) and value.fn == "scatter":
            self.put(ScatterOut(value), _How.AFTER, self.deps_of(value))
        else:
            self.put(Pass(N, (WriteOut(value),)), _How.LOOP, self.deps_of(value))
        self.put(Return(), _How.AFTER, set())


_CHEAP_OPS = frozenset({"+", "-", "*", "<", "<=", ">", ">=", "==", "!=", "and", "or", "not"})


def _block(e: ir.Call) -> int:
    b = e.kwarg("block")
    assert isinstance(b, ir.Const) and isinstance(b.value, int)
    return b.value


def fuse(placed: list[_Placed]) -> list[Item]:
    """Join loop ops over one extent into one pass while none needs another's result.

    A statement that needs the open pass's results waits until after it; one that does
    not runs before it. A barrier that needs them closes the pass; ``after`` items close
    it always.
    """
    out: list[Item] = []
    extent: Extent | None = None  # the open pass's, and its ops so far
    ops: list[LoopOp] = []
    pending: set[str] = set()
    deferred: list[Item] = []
    deferred_names: set[str] = set()

    def flush() -> None:
        nonlocal extent
        if extent is not None and ops:
            out.append(Pass(extent, tuple(ops)))
        out.extend(deferred)
        extent = None
        ops.clear()
        pending.clear()
        deferred.clear()
        deferred_names.clear()

    for p in placed:
        blocked = bool(p.reads & (pending | deferred_names))
        if p.how is _How.LOOP:
            assert isinstance(p.item, Pass)
            if blocked or (extent is not None and extent != p.item.extent):
                flush()
            if extent is None:
                extent = p.item.extent
            ops.extend(p.item.ops)
            pending.update(p.writes)
        elif p.how is _How.FREE:
            if blocked:
                deferred.append(p.item)
                deferred_names.update(p.writes)
            else:
                out.append(p.item)
        elif p.how is _How.BARRIER:
            if blocked:
                flush()
            out.append(p.item)
        else:
            flush()
            out.append(p.item)
    flush()
    return out


def schedule(lowered: ir.Program, options: Options) -> tuple[Kernel, Kernel]:
    """encode's and decode's schedules for a checked program after ``lower``."""
    kernels = []
    for fn in (lowered.encode, lowered.decode):
        b = _Builder(lowered, fn, options)
        b.encode() if fn.name == "encode" else b.decode()
        items = merge_block_extremes(fuse(b.out))
        if options.merged_extremes:
            items = merge_extremes(items)
        if options.fused_blocks:
            items = fuse_blockwise(items, b.arrays)
        size_arg = ""
        if fn.name == "encode":
            items = place_input(items, early=calls(fn.body, "gather"),
                                cpu=options.watch_in_loops)
        else:
            size_arg = fn.args[1][0]
        items = mark_outputs(items, fn.name, options.settles)
        items = hoist_invariants(items, b.arrays, b.scalars, b.params)
        blocks = block_arrays(items, b.arrays, lowered.layout)
        items = stage_passes(items, b.arrays, blocks, options.staged_expands)
        kernels.append(Kernel(fn.name, tuple(items), b.arrays, b.scalars, size_arg, blocks))
    return kernels[0], kernels[1]


