"""The scheduled loop IR as text (``str(kernel)``; ``HIPRESS_DUMP=schedule`` prints it):
one line per statement, each pass with its loop ops indented under it."""

from __future__ import annotations

from .ir import show
from .schedule import (
    BindSections,
    BlockReduce,
    CheckInputOp,
    CheckSections,
    EncodeInput,
    Extreme,
    Item,
    Kernel,
    Lazy,
    LoopOp,
    MinMax,
    PackedSection,
    PackLet,
    PackStore,
    Pass,
    PayloadSizes,
    Scalar,
    ScalarSection,
    Scatter,
    ScatterOut,
    Selection,
    Store,
    StreamKeys,
    Sum,
    TakeInput,
    TakeInputOp,
)

__all__ = ["format_kernel"]


def _show_op(op: LoopOp) -> str:
    if isinstance(op, (Sum, Extreme)):
        what = "sum" if isinstance(op, Sum) else op.op
        key = f", key={show(op.key)}" if op.key is not None else ""
        direct = " direct" if op.direct else ""
        watch = ", and the non-finite flag of g" if op.watch else ""
        return f"{op.out} = {what}({show(op.array)}{key}){direct}{watch}"
    if isinstance(op, MinMax):
        key = f", key={show(op.key)}" if op.key is not None else ""
        watch = ", and the non-finite flag of g" if op.watch else ""
        return (f"{op.lo}, {op.hi} = minmax({show(op.array)}{key})"
                f"{' direct' if op.direct else ''}{watch}")
    if isinstance(op, Store):
        watch = ", and the non-finite flag of g" if op.watch else ""
        return f"section{op.section} <- {op.elem} {show(op.value)}{watch}"
    if isinstance(op, PackStore):
        watch = ", and the non-finite flag of g" if op.watch else ""
        return f"section{op.section} <- pack{op.bits} {show(op.value)}{watch}"
    if isinstance(op, TakeInputOp):
        return "take g (r += g, non-finite flag of the sum)"
    if isinstance(op, CheckInputOp):
        return "non-finite flag of g (without a residual)"
    return f"out <- {show(op.value)}"


def _show_item(item: Item) -> list[str]:
    if isinstance(item, Pass):
        head = [f"pass over {item.extent}:"]
        if item.prologue:
            names = ", ".join(n for p in item.prologue for n in (p.name, getattr(p, "other", ""))
                              if n)
            head = [f"pass over {item.extent}, each chunk first {names} of its blocks "
                    f"of {item.block}:"]
        staged = [f"unpack {name} ({bits} bits)" for name, bits in item.stage]
        staged += [f"expand {name} (blocks of {block})" for name, block in item.expand]
        notes = [f"    (stages {', '.join(staged)})"] if staged else []
        notes += ["    (runs block by block)"] if item.by_block else []
        notes += ["    (run by the caller)"] if item.settle else []
        return head + [f"    {_show_op(op)}" for op in item.ops] + notes
    if isinstance(item, (Scalar, Lazy)):
        later = " (in the pass below)" if isinstance(item, Lazy) and item.in_pass else ""
        if isinstance(item, Lazy) and item.materialize and not item.in_pass:
            later = " (into a buffer)"
        return [f"let {item.name} = {show(item.value)}{later}"]
    if isinstance(item, (Selection, PackLet, Scatter)):
        names = ", ".join(item.names) if isinstance(item, Selection) else item.name
        watch = ", and the non-finite flag of g" if getattr(item, "watch", False) else ""
        return [f"barrier {names} = {show(item.call)}{watch}"]
    if isinstance(item, BlockReduce):
        names = f"{item.name}, {item.other}" if item.other else item.name
        key = f", key={show(item.key)}" if item.key is not None else ""
        what = "minmax" if item.other else item.op
        direct = " direct" if item.direct else ""
        later = " (in the pass below)" if item.in_pass else ""
        return [f"barrier {names} = block {what}({show(item.array)}{key}, block={item.block})"
                + direct + later]
    if isinstance(item, TakeInput):
        alone = ", or of g without a residual" if item.checks else ""
        return [f"take g (r += g, non-finite flag of the sum{alone})"]
    if isinstance(item, EncodeInput):
        return [f"input {item.name}"]
    if isinstance(item, PayloadSizes):
        retry = " (a retry holds r + g)" if item.residual_on_retry else ""
        return [f"payload: {len(item.sections)} sections{retry}"]
    if isinstance(item, ScalarSection):
        return [f"section{item.section} <- {item.elem} {show(item.value)}"]
    if isinstance(item, PackedSection):
        return [f"section{item.section} <- {item.name}"]
    if isinstance(item, CheckSections):
        return ["check payload"]
    if isinstance(item, BindSections):
        return [f"sections {', '.join(item.names)}"]
    if isinstance(item, ScatterOut):
        return [f"out <- {show(item.call)}"]
    if isinstance(item, StreamKeys):
        return [f"random streams {', '.join(map(str, item.streams))}"]
    return ["return"]


def format_kernel(kernel: Kernel) -> str:
    lines = [f"{kernel.fn}:"]
    for item in kernel.items:
        lines += ["  " + line for line in _show_item(item)]
    return "\n".join(lines)
