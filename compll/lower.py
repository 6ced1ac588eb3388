"""Lowering: make every barrier operator a statement of its own.

Elementwise operators (``map``, arithmetic, casts, ``iota``, ``gather``, ``unpack``,
``random``) stay lazy: a backend evaluates them per element inside whichever loop
consumes them, so chains of them fuse into one pass. Barrier operators (``reduce``,
``filter``, ``sort``, ``topk``, ``scatter``) need a whole array first; lowering hoists
each one that sits inside an expression into a ``let`` of a fresh ``_tN`` name, in
evaluation order. No barrier can sit inside a lambda (lambdas see only scalars), and
randomness is counter-based, so hoisting changes no result.
"""

from __future__ import annotations

import dataclasses

from . import ir
from .builtins import Kind, of_kind

__all__ = ["BARRIERS", "lower"]

BARRIERS = of_kind(Kind.BARRIER)


class _Hoister:
    def __init__(self) -> None:
        self.count = 0
        self.out: list[ir.Stmt] = []

    def expr(self, e: ir.Expr, top: bool = False) -> ir.Expr:
        if isinstance(e, ir.Unary):
            return dataclasses.replace(e, operand=self.expr(e.operand))
        if isinstance(e, ir.Binary):
            return dataclasses.replace(e, left=self.expr(e.left), right=self.expr(e.right))
        if isinstance(e, ir.Select):
            return dataclasses.replace(
                e, cond=self.expr(e.cond), then=self.expr(e.then), other=self.expr(e.other)
            )
        if isinstance(e, ir.Call):
            args = tuple(a if isinstance(a, ir.Lambda) else self.expr(a) for a in e.args)
            call = dataclasses.replace(e, args=args)
            if e.fn in BARRIERS and not top:
                name = f"_t{self.count}"
                self.count += 1
                self.out.append(ir.Let((name,), (None,), call, e.pos, (e.pos,)))
                return ir.Var(name, e.pos, e.ty)
            return call
        return e

    def stmt(self, s: ir.Stmt, fn: str) -> None:
        if isinstance(s, ir.Let):
            self.out.append(dataclasses.replace(s, value=self.expr(s.value, top=True)))
            return
        value = s.value
        if fn == "encode":
            assert isinstance(value, ir.Call)
            value = dataclasses.replace(value, args=tuple(self.expr(a) for a in value.args))
        else:  # decode may return a scatter directly: backends write it in place
            value = self.expr(value, top=isinstance(value, ir.Call) and value.fn == "scatter")
        self.out.append(dataclasses.replace(s, value=value))


def lower(program: ir.Program) -> ir.Program:
    """Return ``program`` with barrier operators hoisted into their own statements."""
    funcs = {}
    for fn in (program.encode, program.decode):
        hoister = _Hoister()
        for stmt in fn.body:
            hoister.stmt(stmt, fn.name)
        funcs[fn.name] = dataclasses.replace(fn, body=tuple(hoister.out))
    return dataclasses.replace(program, encode=funcs["encode"], decode=funcs["decode"])
