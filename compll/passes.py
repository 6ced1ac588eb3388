"""The scheduling passes after fusion: each takes a kernel's items and returns new
ones (the items are frozen), leaving its input as it was. ``merge_extremes`` and
``merge_block_extremes`` run a float min and max of the same elements once;
``fuse_blockwise`` moves a block reduction into the prologue of the pass over its
elements; ``place_input`` puts the encoder's first read of g before any other.
``compll.scheduling`` runs them in order."""

from __future__ import annotations

import dataclasses

from . import ir
from .constants import SUM_CHUNK
from .ir import FLOATS, shape
from .schedule import (
    ArrayInfo,
    BlockReduce,
    CheckInputOp,
    EncodeInput,
    Extreme,
    Item,
    Lazy,
    LoopOp,
    MinMax,
    N,
    PackLet,
    PackStore,
    Pass,
    PayloadSizes,
    Return,
    Scalar,
    Scatter,
    Selection,
    Store,
    Sum,
    TakeInput,
    TakeInputOp,
    extent_of,
)

__all__ = ["merge_extremes", "merge_block_extremes", "fuse_blockwise", "place_input"]


def merge_extremes(items: list[Item]) -> list[Item]:
    """A float min and a max of the same elements (operand and key) in one pass become
    one ``MinMax``, which evaluates them once."""
    return [_merged_extremes(item) if isinstance(item, Pass) else item for item in items]


def _merged_extremes(item: Pass) -> Pass:
    ops: list[LoopOp] = []
    seen: dict[object, int] = {}
    for op in item.ops:
        if isinstance(op, Extreme) and op.operand in FLOATS:
            where = (shape(op.array), shape(op.key))
            j = seen.get(where)
            first = ops[j] if j is not None else None
            if isinstance(first, Extreme) and first.op != op.op \
                    and first.direct == op.direct:
                lo, hi = (op.out, first.out) if op.op == "min" else (first.out, op.out)
                assert j is not None
                ops[j] = MinMax(lo, hi, first.array, first.key, first.direct)
                del seen[where]
                continue
            seen[where] = len(ops)
        ops.append(op)
    return dataclasses.replace(item, ops=tuple(ops))


def merge_block_extremes(items: list[Item]) -> list[Item]:
    """A block min and a block max of the same elements and blocks, one after the other,
    run as one barrier."""
    out: list[Item] = []
    for item in items:
        prev = out[-1] if out else None
        if (isinstance(item, BlockReduce) and isinstance(prev, BlockReduce)
                and not prev.other and {item.op, prev.op} == {"min", "max"}
                and item.operand in FLOATS and prev.operand in FLOATS
                and item.block == prev.block and item.direct == prev.direct
                and (shape(item.array), shape(item.key)) == (shape(prev.array), shape(prev.key))):
            out[-1] = dataclasses.replace(prev, other=item.name)
            continue
        out.append(item)
    return out


def _names(node: object) -> set[str]:
    """Every variable an IR node or item mentions (lambda parameters too: conservative)."""
    if isinstance(node, ir.Var):
        return {node.name}
    if isinstance(node, (list, tuple)):
        return set().union(*(_names(x) for x in node)) if node else set()
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return set().union(*(_names(getattr(node, f.name)) for f in dataclasses.fields(node)
                             if f.name not in ("pos", "ty")))
    return set()


def _defines(item: Item) -> set[str]:
    if isinstance(item, BlockReduce):
        return {item.name, item.other} - {""}
    if isinstance(item, (Lazy, Scalar)):
        return {item.name}
    if isinstance(item, Pass):
        return {name for op in item.ops for name in _outs(op)}
    return set()


def _outs(op: LoopOp) -> list[str]:
    if isinstance(op, (Sum, Extreme)):
        return [op.out]
    if isinstance(op, MinMax):
        return [op.lo, op.hi]
    return []


def fuse_blockwise(items: list[Item], arrays: dict[str, ArrayInfo]) -> list[Item]:
    """Run a block reduction inside the next pass over its elements: each chunk of the
    pass first reduces its own blocks and evaluates the per-block arrays that depend on
    them, then runs the ops, so the elements are read from memory once (the values are
    the same: a block is reduced as an array of its own).

    It applies when the blocks divide ``SUM_CHUNK`` (no block spans two chunks) and
    everything between the reduction and the pass either ignores its results, is another
    reduction of the same blocks (it joins), is a
    per-block array of the same blocks (then filled by the prologue too), is a lazy
    elementwise array (read inside the pass), sizes the payload (by lengths), or is a
    pass over the blocks (it moves after the pass). The reduction stays in place as the
    allocation of its buffers.
    """
    out = list(items)
    i = -1
    while i + 1 < len(out):
        i += 1
        br = out[i]
        if not (isinstance(br, BlockReduce) and not br.in_pass and br.block > 0
                and SUM_CHUNK % br.block == 0):
            continue
        found = _fusion(out, i, br, arrays)
        if found is None:
            continue
        target, prologue, moved = found
        this = out[target]
        assert isinstance(this, Pass)
        # The prologue's items stay where they were, as the allocations of their buffers.
        marked = {id(p): dataclasses.replace(p, in_pass=True) for p in prologue}
        this = dataclasses.replace(this, prologue=tuple(marked[id(p)] for p in prologue),
                                   block=br.block)
        rest = [marked.get(id(x), x) for x in out[i + 1:target]
                if not any(x is m for m in moved)]
        out = out[:i] + [marked[id(br)]] + rest + [this] + moved + out[target + 1:]
    return out


def _fusion(out: list[Item], i: int, br: BlockReduce, arrays: dict[str, ArrayInfo]
            ) -> tuple[int, list[BlockReduce | Lazy], list[Item]] | None:
    """Where the block reduction ``out[i]`` fuses (``fuse_blockwise``): the index of the
    pass it joins, the prologue (it and what joins it), and the passes over the blocks
    that move after that pass; None where something in between forbids it."""
    base, blocks = extent_of(br.array, arrays), arrays[br.name].extent
    fused = _defines(br)
    prologue: list[BlockReduce | Lazy] = [br]
    moved: list[Item] = []
    late: set[str] = set()
    for j in range(i + 1, len(out)):
        item = out[j]
        refs = _names(item)
        if refs & late:
            return None
        if isinstance(item, Pass) and item.extent == base and not item.prologue:
            return j, prologue, moved
        if isinstance(item, BlockReduce) and item.block == br.block \
                and extent_of(item.array, arrays) == base:
            prologue.append(item)  # the same blocks: reduced in the same prologue
            fused |= _defines(item)
            continue
        if not refs & fused:
            continue
        if isinstance(item, Lazy) and arrays[item.name].extent == blocks:
            prologue.append(item)
            fused.add(item.name)
        elif isinstance(item, Lazy) and arrays[item.name].extent == base:
            continue  # an element function: read per element inside the pass
        elif isinstance(item, PayloadSizes):
            continue  # sizes of sections: the blocks' count, not their values
        elif isinstance(item, Pass) and item.extent == blocks:
            moved.append(item)
            late |= _defines(item)
        else:
            return None
    return None


def place_input(items: list[Item], early: bool, cpu: bool = False) -> list[Item]:
    """Put the encoder's first read of g (error feedback's ``r += g`` and the non-finite
    flag of the sum) before any other read of g: as the first op of the first pass when
    that pass runs over n, else as a loop of its own (first of all when a gather may read
    any index). Without a residual the flag comes from g, as the last op of the first
    pass over n (the chunk is then in cache), or in a filter's or topk's scan of g; else
    in the loop of its own."""
    out: list[Item] = []
    pending = not early
    take = -1  # where a TakeInput loop of its own goes in ``out``
    checks = False  # whether it still has to flag g: no later loop over g does
    gname = ""
    for item in items:
        if isinstance(item, EncodeInput):
            gname = item.name
        if early and isinstance(item, EncodeInput):
            out.append(item)
            take, checks = len(out), True
            out.append(TakeInput())
            continue
        if pending:
            if isinstance(item, Pass):
                if item.extent == N:
                    item = _check_in(dataclasses.replace(item, ops=(TakeInputOp(), *item.ops)),
                                     cpu)
                else:
                    take, checks = len(out), True
                    out.append(TakeInput())
                pending = False
            elif isinstance(item, (Selection, Scatter, PackLet, BlockReduce, Return)):
                take, checks = len(out), True
                out.append(TakeInput())
                pending = False
                if isinstance(item, Selection) and _scans_input(item, gname, cpu):
                    item, checks = dataclasses.replace(item, watch=True), False
            elif isinstance(item, PayloadSizes):
                item = dataclasses.replace(item, residual_on_retry=True)
        elif checks and isinstance(item, Pass) and item.extent == N:
            item, checks = _check_in(item, cpu), False
        elif checks and isinstance(item, Selection) and _scans_input(item, gname, cpu):
            item, checks = dataclasses.replace(item, watch=True), False
        out.append(item)
    if take >= 0:
        out[take] = TakeInput(checks=checks)
    return out


def _scans_input(item: Item, gname: str, cpu: bool) -> bool:
    """Whether ``item`` is a filter or topk over the encoder's input itself, whose scan
    reads every element of g (on the CPU the flag then rides it)."""
    return cpu and isinstance(item, Selection) and item.call.fn in ("filter", "topk") \
        and isinstance(item.call.args[0], ir.Var) and item.call.args[0].name == gname


def _check_in(item: Pass, cpu: bool) -> Pass:
    """Give a pass over n the non-finite flag of g (for encodes without a residual). On
    the CPU, in the loop of an op that reads every element anyway: a direct float
    reduction (it waits on its adds' latency with vector units to spare), else a section
    write; else (and on the GPU, where each op is a kernel) as the pass's last op."""
    if cpu:
        for kinds in ((Sum, Extreme, MinMax), (Store, PackStore)):
            for k in reversed(range(len(item.ops))):
                op = item.ops[k]
                if isinstance(op, kinds) and (not isinstance(op, (Sum, Extreme, MinMax))
                                              or op.direct):
                    ops = list(item.ops)
                    ops[k] = dataclasses.replace(op, watch=True)
                    return dataclasses.replace(item, ops=tuple(ops))
    return dataclasses.replace(item, ops=(*item.ops, CheckInputOp()))
