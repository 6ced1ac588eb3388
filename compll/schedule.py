"""The scheduled loop IR: a kernel as the statements and fused passes it runs.

A ``Kernel`` (encode's or decode's) is a tuple of ``Item``s: scalar and lazy-array lets,
``Pass``es (one loop over an ``Extent`` running several ``LoopOp``s: sums, extremes,
stores, packs, the residual add, the output write), barrier operators (filter, sort,
topk, scatter, pack, block reductions) and the payload's section writes and reads.
``compll.scheduling`` builds it from a lowered program, the renderer (``compll.render``)
walks it, and the targets only choose ``Options``. ``HIPRESS_DUMP=schedule`` prints it.
Every node is a frozen dataclass, as the IR's are: a scheduling step returns new nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from . import ir
from .builtins import BUILTINS, Kind
from .ir import TypeKind, shape, show

__all__ = ["Options", "ExtentKind", "ArrayKind", "Extent", "ArrayInfo", "Kernel", "Item",
           "LoopOp", "Pass", "Scalar", "Lazy", "Selection", "Scatter", "PackLet", "BlockReduce",
           "TakeInput", "EncodeInput", "PayloadSizes", "ScalarSection", "PackedSection",
           "CheckSections", "BindSections", "ScatterOut", "StreamKeys", "Return", "Sum",
           "Extreme", "MinMax", "Store", "PackStore", "TakeInputOp", "CheckInputOp", "WriteOut",
           "N", "extent_of"]


@dataclass(frozen=True)
class Options:
    """What a target's runtime offers the schedule."""

    #: float reductions of ``cheap`` element functions evaluate straight into registers
    direct_reductions: bool = False
    #: a min and a max of the same elements in one pass may run as one ``MinMax``
    merged_extremes: bool = False
    #: a blockwise reduction may run inside the next pass over its elements, per chunk
    #: (``Pass.prologue``)
    fused_blocks: bool = False
    #: the non-finite flag of g may ride the loop of another op of its pass (``watch``)
    watch_in_loops: bool = False
    #: a fused pass may stage ``expand``'s per-block values in L1 (``Pass.expand``) and
    #: then run block by block (``Pass.by_block``)
    staged_expands: bool = False
    #: error feedback's residual update is deferred into the next encode: decode hands its
    #: output pass to the caller (``Pass.settle``, ``hp::finish`` in cpu_runtime.h)
    settles: bool = False


# -- extents and arrays -------------------------------------------------------------------------

class ExtentKind(StrEnum):
    """Whose element count an ``Extent`` is."""

    N = "n"  # the tensor's
    BUFFER = "buffer"  # a barrier's output buffer (``name``)
    PACKED = "packed"  # a packed let's (``name``)
    SECTION = "section"  # payload section ``index``'s
    IOTA = "iota"  # ``max(0, count)``
    BLOCKS = "blocks"  # ``ceil(base / block)``


class ArrayKind(StrEnum):
    """How an array is read: ``lazy`` per element, ``packed`` through ``unpack``."""

    LAZY = "lazy"
    PACKED = "packed"


@dataclass(frozen=True)
class Extent:
    """An element count (``ExtentKind``)."""

    kind: ExtentKind
    name: str = ""
    index: int = 0
    count: ir.Expr | None = field(default=None, compare=False)
    key: object = None  # the count's shape: two iotas of one count have one extent
    base: Extent | None = None
    block: int = 0

    def __str__(self) -> str:
        if self.kind is ExtentKind.N:
            return "n"
        if self.kind is ExtentKind.IOTA:
            assert self.count is not None
            return f"iota({show(self.count)})"
        if self.kind is ExtentKind.SECTION:
            return f"section{self.index}"
        if self.kind is ExtentKind.BLOCKS:
            return f"blocks({self.base}, {self.block})"
        return f"len({self.name})"


N = Extent(ExtentKind.N)


@dataclass(frozen=True)
class ArrayInfo:
    """An array name: ``lazy`` (evaluated per element) or ``packed`` (bits in a buffer)."""

    kind: ArrayKind
    elem: str
    extent: Extent
    value: ir.Expr | None = None  # what a lazy array computes; None: a plain load
    buffer: bool = False  # a barrier's output, read from memory


def extent_of(e: ir.Expr, arrays: Mapping[str, ArrayInfo]) -> Extent:
    """The element count of an array-valued expression."""
    if isinstance(e, ir.Var):
        if e.name not in arrays:
            raise KeyError(f"{e.name!r} is not an array")
        return arrays[e.name].extent
    if isinstance(e, ir.Call):
        if e.fn == "iota":
            return Extent(ExtentKind.IOTA, count=e.args[0], key=shape(e.args[0]))
        if e.fn == "gather":
            return extent_of(e.args[1], arrays)
        if e.fn == "expand":
            inner = extent_of(e.args[0], arrays)
            assert inner.kind is ExtentKind.BLOCKS and inner.base is not None
            return inner.base
        spec = BUILTINS[e.fn]
        if e.fn in ("map", "unpack", "pack") or spec.kind in (Kind.CAST, Kind.ELEMENTWISE):
            for a in e.args:
                if a.ty is not None and a.ty.kind in (TypeKind.ARRAY, TypeKind.PACKED):
                    return extent_of(a, arrays)
    if isinstance(e, (ir.Unary, ir.Binary, ir.Select)):
        for a in ir.operands(e):
            if a.ty is not None and a.ty.kind is TypeKind.ARRAY:
                return extent_of(a, arrays)
    raise KeyError(f"cannot tell the length of {type(e).__name__}")


# -- loop ops -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sum:
    """``out = sum(key(array[i]))`` (``operand``: the element type summed)."""

    out: str
    array: ir.Expr
    key: ir.Lambda | None
    operand: str
    elem: str  # the result's type
    direct: bool = False
    #: also the non-finite flag of g, without a residual, in the same loop (``CheckInputOp``'s
    #: work where a direct reduction reads every element anyway)
    watch: bool = False


@dataclass(frozen=True)
class Extreme:
    """``out = max`` (or ``min``) of ``key(array[i])``."""

    out: str
    op: str  # "max" or "min"
    array: ir.Expr
    key: ir.Lambda | None
    operand: str
    elem: str
    direct: bool = False
    watch: bool = False  # as ``Sum.watch``


@dataclass(frozen=True)
class MinMax:
    """A float min and max of the same elements, evaluated once."""

    lo: str
    hi: str
    array: ir.Expr
    key: ir.Lambda | None
    direct: bool = False
    watch: bool = False  # as ``Sum.watch``


@dataclass(frozen=True)
class Store:
    """Payload section ``section`` gets ``value[i]`` as ``elem``."""

    section: int
    value: ir.Expr
    elem: str
    watch: bool = False  # as ``Sum.watch``


@dataclass(frozen=True)
class PackStore:
    """Payload section ``section`` gets ``value[i]`` packed in ``bits`` bits."""

    section: int
    value: ir.Expr
    elem: str
    bits: int
    watch: bool = False  # as ``Sum.watch``


@dataclass(frozen=True)
class TakeInputOp:
    """The encoder's first read of g: error feedback's ``r[i] += g[i]`` before the pass's
    other ops read element i, and the payload's non-finite flag from the value read."""


@dataclass(frozen=True)
class CheckInputOp:
    """The non-finite flag from g when there is no residual (``TakeInputOp`` flags the sum
    when there is): the pass's last op, so it reads a chunk the ops before it brought into
    cache, instead of the first, which would wait on memory with nothing to overlap."""


@dataclass(frozen=True)
class WriteOut:
    """decode's output: ``out[i] = value[i]`` (or adds, scales, feeds back)."""

    value: ir.Expr


LoopOp = Sum | Extreme | MinMax | Store | PackStore | TakeInputOp | CheckInputOp | WriteOut


# -- items --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pass:
    """One loop over ``extent`` running ``ops`` element by element.

    ``prologue``: block reductions and lazy per-block arrays (materialised) that each
    chunk of the pass computes for its own blocks of ``block`` elements before the ops
    run on it (``compll.passes.fuse_blockwise``).
    """

    extent: Extent
    ops: tuple[LoopOp, ...]
    prologue: tuple[BlockReduce | Lazy, ...] = ()
    block: int = 0
    #: packed arrays (name, bits) whose ``unpack`` the pass stages in L1, in slot order
    stage: tuple[tuple[str, int], ...] = ()
    #: one-value-per-block f32 arrays (name, block) whose ``expand`` it stages
    expand: tuple[tuple[str, int], ...] = ()
    #: lazy arrays that read staged expands: inlined where the pass's ops read them
    inline: frozenset[str] = frozenset()
    #: the pass runs block by block (its ops need no more than their own elements)
    by_block: bool = False
    #: decode's output pass, handed to the caller to run (``Options.settles``)
    settle: bool = False


@dataclass(frozen=True)
class Scalar:
    name: str
    value: ir.Expr
    elem: str


@dataclass(frozen=True)
class Lazy:
    """An array evaluated per element where it is read (elementwise chains fuse)."""

    name: str
    value: ir.Expr
    #: a per-block array filled by a later pass's prologue; here only allocated
    in_pass: bool = False
    #: evaluated into a buffer here (a per-block array, read per element by ``expand``)
    materialize: bool = False


@dataclass(frozen=True)
class Selection:
    """filter, sort or topk: index (when ``index``) and value buffers."""

    names: tuple[str, ...]
    call: ir.Call
    index: bool
    #: also the non-finite flag of g (the encoder's input, which it scans whole), for
    #: encodes without a residual (a filter's or topk's scan; ``Sum.watch``)
    watch: bool = False


@dataclass(frozen=True)
class Scatter:
    """``name = scatter(...)`` into a zeroed buffer; indices checked when decoding."""

    name: str
    call: ir.Call
    checked: bool


@dataclass(frozen=True)
class PackLet:
    """``name = pack(...)``: the bits of a whole array in a buffer."""

    name: str
    call: ir.Call


@dataclass(frozen=True)
class BlockReduce:
    """``name = reduce(array, op, key=, block=B)``: one value per block of ``block``
    elements; ``other`` names the opposite extreme of the same blocks where a min and a
    max run together."""

    name: str
    op: str
    array: ir.Expr
    key: ir.Lambda | None
    operand: str
    elem: str
    block: int
    direct: bool = False
    other: str = ""
    #: computed chunk by chunk by a later pass's prologue; here only allocated
    in_pass: bool = False


@dataclass(frozen=True)
class TakeInput:
    """``TakeInputOp`` as a loop of its own; ``checks``: without a residual it also flags
    g (no later pass over n does)."""

    checks: bool = True


@dataclass(frozen=True)
class EncodeInput:
    """encode's argument: the gradient, or with a residual the sum r + g."""

    name: str


@dataclass(frozen=True)
class PayloadSizes:
    """The sections' sizes, the capacity check and the header; ``residual_on_retry``: the
    caller retries on r alone when the payload does not fit, so r must hold r + g."""

    sections: tuple[tuple[ir.Expr, ir.Section], ...]
    residual_on_retry: bool = False


@dataclass(frozen=True)
class ScalarSection:
    section: int
    value: ir.Expr
    elem: str


@dataclass(frozen=True)
class PackedSection:
    """A packed let copied into its section."""

    section: int
    name: str


@dataclass(frozen=True)
class CheckSections:
    """decode's validation of the header and every section's size."""


@dataclass(frozen=True)
class BindSections:
    names: tuple[str, ...]


@dataclass(frozen=True)
class ScatterOut:
    """decode's output as a scatter straight into ``out``."""

    call: ir.Call


@dataclass(frozen=True)
class StreamKeys:
    """The keys of the random streams the kernel draws from (from the header's seed and
    step: decode's come after the payload is checked)."""

    streams: tuple[int, ...]


@dataclass(frozen=True)
class Return:
    pass


Item = (Pass | Scalar | Lazy | Selection | Scatter | PackLet | BlockReduce | TakeInput
        | EncodeInput | PayloadSizes | ScalarSection | PackedSection | CheckSections
        | BindSections | ScatterOut | StreamKeys | Return)


@dataclass(frozen=True)
class Kernel:
    """One function's schedule and the names it defines."""

    fn: str  # "encode" or "decode"
    items: tuple[Item, ...]
    arrays: dict[str, ArrayInfo]
    scalars: dict[str, str]  # name -> element type (hoisted temporaries: ``%k``)
    size_arg: str = ""  # decode's n
    #: f32 arrays of one value per block held in memory (``expand`` can stage them)
    block_arrays: frozenset[str] = frozenset()

    def __str__(self) -> str:
        from .schedule_text import format_kernel  # the text of the nodes defined here

        return format_kernel(self)
