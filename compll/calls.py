"""The typing rules of CompLL's array operators, one function per builtin.

``RULES[name](checker, call)`` checks a call of an operator whose arity and keywords the
checker has already checked against ``compll.builtins``, and returns the call with its
arguments checked and its type (and, for the draws, its random stream) set. ``cast`` and
``elementwise`` check the scalar functions from their entries in the table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from . import ir
from .builtins import Builtin, RuleError
from .ir import FLOATS, PACKED_BITS, Length, LengthKind, Pos, Type, TypeKind
from .typing_rules import is_int, promote_one

__all__ = ["RULES", "cast", "elementwise"]


class Checker(Protocol):
    """What a rule uses of ``compll.checker.Checker``, which calls the rules (so this
    module does not import it)."""

    lambda_env: dict[str, Type] | None
    #: random streams handed out to draws without an explicit one
    stream: int

    def err(self, message: str, pos: Pos | None, cls: type = ...) -> Exception: ...
    def expr(self, e: ir.Expr) -> ir.Expr: ...
    def typed_args(self, e: ir.Call) -> tuple[ir.Expr, ...]: ...
    def const_value(self, x: ir.Expr) -> Any: ...
    def value_type(self, e: ir.Expr, what: str) -> Type: ...
    def broadcast(self, types: list[Type], elem: str, pos: Pos,
                  literal: bool = False) -> Type: ...
    def same_length(self, a: Type, b: Type, pos: Pos) -> None: ...
    def fresh_length(self, what: str, pos: Pos) -> Length: ...
    def length_of_scalar(self, expr: ir.Expr) -> Length: ...
    def lambda_body(self, lam: ir.Expr, params: tuple[Type, ...], what: str) -> ir.Lambda: ...


_U32 = Type.scalar("u32")
_REDUCE_OPS = ("sum", "max", "min")


def cast(c: Checker, e: ir.Call) -> ir.Expr:
    (x,) = c.typed_args(e)
    ty = c.value_type(x, e.fn)
    return dataclasses.replace(e, args=(x,), ty=c.broadcast([ty], e.fn, e.pos))


def elementwise(c: Checker, e: ir.Call, spec: Builtin) -> ir.Expr:
    args = c.typed_args(e)
    types = [c.value_type(a, e.fn) for a in args]
    if any(t.elem == "bool" for t in types):
        raise c.err(f"{e.fn} needs numbers, not bool", e.pos)
    assert spec.operand is not None
    try:
        operand = spec.operand(types)
    except RuleError as exc:
        raise c.err(str(exc), e.pos) from None
    elem = spec.result_of(operand)
    literal = all(t.literal for t in types) and elem != "bool"
    ty = c.broadcast(types, elem, e.pos, literal)
    return dataclasses.replace(e, args=args, ty=ty, operand_ty=Type.scalar(operand))


def array_arg(c: Checker, x: ir.Expr, what: str, packed: bool = False) -> Type:
    assert x.ty is not None
    kinds = (TypeKind.ARRAY, TypeKind.PACKED) if packed else (TypeKind.ARRAY,)
    if x.ty.kind not in kinds:
        raise c.err(f"{what} needs an array, not {x.ty}", x.pos)
    return x.ty


def scalar_arg(c: Checker, x: ir.Expr, what: str, ints: bool = False) -> Type:
    assert x.ty is not None
    if x.ty.kind is not TypeKind.SCALAR or (ints and not is_int(x.ty.elem)):
        kind = "an integer" if ints else "a number"
        raise c.err(f"{what} needs {kind}, not {x.ty}", x.pos)
    return x.ty


def const_kwarg(c: Checker, e: ir.Call, key: str, default: Any, ints: bool = True) -> Any:
    raw = e.kwarg(key)
    if raw is None:
        return default
    value = c.const_value(c.expr(raw))
    if ints and (isinstance(value, bool) or not isinstance(value, int)):
        raise c.err(f"{key}= must be a constant integer", raw.pos)
    return value


def _size(c: Checker, e: ir.Call) -> ir.Expr:
    (a,) = c.typed_args(e)
    array_arg(c, a, "size", packed=True)
    return dataclasses.replace(e, args=(a,), ty=_U32)


def _iota(c: Checker, e: ir.Call) -> ir.Expr:
    (k,) = c.typed_args(e)
    scalar_arg(c, k, "iota", ints=True)
    return dataclasses.replace(e, args=(k,), ty=Type.array("u32", c.length_of_scalar(k)))


def _map(c: Checker, e: ir.Call) -> ir.Expr:
    arrays = tuple(c.expr(a) for a in e.args[:-1])
    types = [array_arg(c, a, "map") for a in arrays]
    for t in types[1:]:
        c.same_length(types[0], t, e.pos)
    lam = c.lambda_body(e.args[-1], tuple(types), "map")
    assert lam.ty is not None
    ty = Type.array(lam.ty.elem, types[0].length)  # type: ignore[arg-type]
    return dataclasses.replace(e, args=arrays + (lam,), ty=ty)


def key_lambda(c: Checker, e: ir.Call, elem: str) -> ir.Lambda | None:
    key = e.kwarg("key")
    if key is None:
        return None
    return c.lambda_body(key, (Type.scalar(elem),), f"{e.fn}'s key")


def with_key(e: ir.Call, key: ir.Lambda | None) -> tuple[tuple[str, ir.Expr], ...]:
    """``e``'s keyword arguments with ``key`` replaced by its checked lambda."""
    kwargs = tuple((k, v) for k, v in e.kwargs if k != "key")
    return kwargs + ((("key", key),) if key is not None else ())


def _reduce(c: Checker, e: ir.Call) -> ir.Expr:
    a = c.expr(e.args[0])
    at = array_arg(c, a, "reduce")
    op = e.args[1]
    if not isinstance(op, ir.Var) or op.name not in _REDUCE_OPS:
        raise c.err("reduce's operator must be sum, max or min", op.pos)
    key = key_lambda(c, e, at.elem)
    elem = key.ty.elem if key is not None and key.ty is not None else at.elem
    if op.name == "sum":
        out = "f32" if elem in FLOATS else ("i32" if elem == "i32" else "u32")
    else:
        if elem == "bool":
            raise c.err(f"reduce {op.name} needs numbers, not bool", e.pos)
        out = promote_one(elem) if elem in FLOATS else elem
    kwargs: tuple[tuple[str, ir.Expr], ...] = (("key", key),) if key is not None else ()
    ty = Type.scalar(out)
    raw = e.kwarg("block")
    if raw is not None:  # one value per block of B elements (B = 0: one block)
        block = const_kwarg(c, e, "block", 0)
        if not 0 <= block < 2**32:
            raise c.err("block= must be in 0..4294967295 (0: one block of all)", raw.pos)
        assert at.length is not None
        ty = Type.array(out, Length(LengthKind.BLOCKS, block, base=at.length))
        kwargs += (("block", ir.Const(block, raw.pos, Type.scalar("u32"))),)
    return dataclasses.replace(
        e, args=(a, op), kwargs=kwargs, ty=ty, operand_ty=Type.scalar(elem)
    )


def _expand(c: Checker, e: ir.Call) -> ir.Expr:
    (r,) = c.typed_args(e)
    rt = array_arg(c, r, "expand")
    if rt.length is None or rt.length.kind is not LengthKind.BLOCKS or rt.length.base is None:
        raise c.err(f"expand takes one value per block (from reduce(..., block=B)), not {rt}",
                    r.pos)
    return dataclasses.replace(e, args=(r,), ty=Type.array(rt.elem, rt.length.base))


def index_flag(c: Checker, e: ir.Call) -> bool:
    raw = e.kwarg("index")
    if raw is None:
        return False
    if not isinstance(raw, ir.Const) or not isinstance(raw.value, bool):
        raise c.err("index= must be true or false", raw.pos)
    return raw.value


def indexed_result(c: Checker, e: ir.Call, elem: str, length: Length, index: bool) -> Type:
    values = Type.array(elem, length)
    if not index:
        return values
    return Type(TypeKind.TUPLE, items=(Type.array("u32", length), values))


def _filter(c: Checker, e: ir.Call) -> ir.Expr:
    a = c.expr(e.args[0])
    at = array_arg(c, a, "filter")
    pred = c.lambda_body(e.args[1], (at,), "filter")
    if pred.ty is None or pred.ty.elem != "bool":
        raise c.err("filter's predicate must give a bool", e.args[1].pos)
    ty = indexed_result(c, e, at.elem, c.fresh_length("filter", e.pos),
                             index_flag(c, e))
    return dataclasses.replace(e, args=(a, pred), ty=ty)


def _sort(c: Checker, e: ir.Call) -> ir.Expr:
    a = c.expr(e.args[0])
    at = array_arg(c, a, "sort")
    key = key_lambda(c, e, at.elem)
    desc = e.kwarg("descending")
    if desc is not None and not (isinstance(desc, ir.Const) and isinstance(desc.value, bool)):
        raise c.err("descending= must be true or false", desc.pos)
    ty = indexed_result(c, e, at.elem, at.length, index_flag(c, e))  # type: ignore
    return dataclasses.replace(e, args=(a,), kwargs=with_key(e, key), ty=ty)


def _topk(c: Checker, e: ir.Call) -> ir.Expr:
    a, k = c.expr(e.args[0]), c.expr(e.args[1])
    at = array_arg(c, a, "topk")
    scalar_arg(c, k, "topk's k", ints=True)
    key = key_lambda(c, e, at.elem)
    length = c.fresh_length("topk", e.pos)
    ty = indexed_result(c, e, at.elem, length, index_flag(c, e))
    return dataclasses.replace(e, args=(a, k), kwargs=with_key(e, key), ty=ty)


def random_stream(c: Checker, e: ir.Call) -> int:
    if c.lambda_env is None:
        raise c.err(
            f"{e.fn}() draws one number per element; call it inside a map lambda", e.pos
        )
    explicit = const_kwarg(c, e, "stream", None)
    if explicit is not None:
        if not 0 <= explicit < 2**16:
            raise c.err("stream= must be in 0..65535", e.pos)
        return int(explicit)
    c.stream += 1
    return 2**16 + c.stream - 1  # automatic streams never collide with explicit ones


def _random(c: Checker, e: ir.Call) -> ir.Expr:
    stream = random_stream(c, e)
    return dataclasses.replace(e, kwargs=(), ty=Type.scalar("f32"), stream=stream)


def _randint(c: Checker, e: ir.Call) -> ir.Expr:
    stream = random_stream(c, e)
    (hi,) = c.typed_args(e)
    scalar_arg(c, hi, "randint", ints=True)
    return dataclasses.replace(e, args=(hi,), kwargs=(), ty=_U32, stream=stream)


def _gather(c: Checker, e: ir.Call) -> ir.Expr:
    a, idx = c.typed_args(e)
    at, it = array_arg(c, a, "gather"), array_arg(c, idx, "gather's indices")
    if not is_int(it.elem):
        raise c.err(f"gather's indices must be integers, not {it}", idx.pos)
    return dataclasses.replace(e, args=(a, idx), ty=Type.array(at.elem, it.length))  # type: ignore


def _scatter(c: Checker, e: ir.Call) -> ir.Expr:
    idx, vals, n = c.typed_args(e)
    it, vt = array_arg(c, idx, "scatter's indices"), array_arg(c, vals, "scatter")
    if not is_int(it.elem):
        raise c.err(f"scatter's indices must be integers, not {it}", idx.pos)
    if vt.elem == "bool":
        raise c.err("scatter needs numeric values, not bool", vals.pos)
    c.same_length(it, vt, e.pos)
    scalar_arg(c, n, "scatter's size", ints=True)
    ty = Type.array(vt.elem, c.length_of_scalar(n))
    return dataclasses.replace(e, args=(idx, vals, n), ty=ty)


def _pack(c: Checker, e: ir.Call) -> ir.Expr:
    (a,) = c.typed_args(e)
    at = array_arg(c, a, "pack")
    if not (is_int(at.elem) or at.elem == "bool"):
        raise c.err(f"pack needs integers or bools, not {at}; cast with u8(...)", a.pos)
    if e.kwarg("bits") is None:
        raise c.err("pack needs bits=1, 2, 4 or 8", e.pos)
    bits = const_kwarg(c, e, "bits", 8)
    if bits not in PACKED_BITS:
        raise c.err(f"pack's bits must be 1, 2, 4 or 8, not {bits}", e.kwarg("bits").pos)  # type: ignore[union-attr]
    ty = Type(TypeKind.PACKED, "u8", at.length, bits=bits)
    return dataclasses.replace(e, args=(a,), kwargs=(), ty=ty)


def _unpack(c: Checker, e: ir.Call) -> ir.Expr:
    (a,) = c.typed_args(e)
    at = array_arg(c, a, "unpack", packed=True)
    if at.kind is not TypeKind.PACKED:
        raise c.err(f"unpack needs a packed array, not {at}", a.pos)
    return dataclasses.replace(e, args=(a,), ty=Type.array("u8", at.length))  # type: ignore


def _concat(c: Checker, e: ir.Call) -> ir.Expr:
    raise c.err("concat builds the payload: use it only as 'return concat(...)' in "
                   "encode", e.pos)


def _extract(c: Checker, e: ir.Call) -> ir.Expr:
    raise c.err("extract reads the payload: use it only as 'let a, b = extract(p)' "
                   "in decode", e.pos)


#: The rule of each array operator, by name.
RULES: dict[str, Callable[[Checker, ir.Call], ir.Expr]] = {
    "size": _size,
    "iota": _iota,
    "map": _map,
    "reduce": _reduce,
    "expand": _expand,
    "filter": _filter,
    "sort": _sort,
    "topk": _topk,
    "random": _random,
    "randint": _randint,
    "gather": _gather,
    "scatter": _scatter,
    "pack": _pack,
    "unpack": _unpack,
    "concat": _concat,
    "extract": _extract,
}
