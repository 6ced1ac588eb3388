"""CompLL's builtins, defined once: what each takes, what kind of operator it is, and for
the scalar functions their typing rule, their NumPy meaning and their C rendering.

The checker takes arity and keywords from here, ``lower`` hoists the ``BARRIER`` kind,
the interpreter and the renderer evaluate ``ELEMENTWISE`` entries through their ``numpy``
and ``c`` fields, and the other kinds are dispatched by name (``call_NAME`` in the
checker and the renderer, ``op_NAME`` in the interpreter), so adding an operator means
adding a row here and one method per stage.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .ir import SCALARS, Type
from .typing_rules import arith_elem, is_int, promote_one

__all__ = ["Kind", "Builtin", "BUILTINS", "RuleError", "named", "of_kind", "fmax", "fmin"]


class Kind(enum.Enum):
    CAST = "cast"  # f32(x), u8(x)...: a conversion, elementwise
    ELEMENTWISE = "elementwise"  # a scalar function, also applied per element of arrays
    LAZY = "lazy"  # an array evaluated per element inside whichever loop consumes it
    SCALAR = "scalar"  # a scalar property of an array
    BARRIER = "barrier"  # needs the whole array first: lowered into a statement of its own
    PACK = "pack"  # bit packing: a payload section, or a buffer when bound by let
    PAYLOAD = "payload"  # builds (encode) or reads (decode) the payload


class RuleError(Exception):
    """A typing rule rejects its operands; the checker reports it at the call."""


def fmax(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """max(a, b) = isnan(b) ? a : isnan(a) ? b : (a > b ? a : b)."""
    return np.where(np.isnan(b), a, np.where(np.isnan(a), b, np.where(a > b, a, b)))


def fmin(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(b), a, np.where(np.isnan(a), b, np.where(a < b, a, b)))


def _sign(op: str, x: np.ndarray) -> np.ndarray:
    if op == "u32":
        return (x > 0).astype(np.uint32)
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _extreme(name: str) -> Callable[..., np.ndarray]:
    def apply(op: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        if op == "f32":
            return fmin(x, y) if name == "min" else fmax(x, y)
        return np.minimum(x, y) if name == "min" else np.maximum(x, y)
    return apply


def _exponent(op: str, x: np.ndarray) -> np.ndarray:
    field_ = ((np.asarray(x, np.float32).view(np.uint32) >> np.uint32(23))
              & np.uint32(0xFF)).astype(np.int32)
    return np.where(field_ == 0, -127, field_ - 127).astype(np.int32)


def _pow2(op: str, x: np.ndarray) -> np.ndarray:
    e = x.astype(np.int64)
    biased = np.clip(e + 127, 1, 254).astype(np.uint32) << np.uint32(23)
    val = np.asarray(biased, dtype=np.uint32).view(np.float32)
    return np.where(e < -126, np.float32(0), np.where(e > 127, np.float32(np.inf), val))


def _same(types: list[Type]) -> str:
    return promote_one(types[0].elem)


def _f32(types: list[Type]) -> str:
    return "f32"


def _int_exponent(types: list[Type]) -> str:
    if not is_int(types[0].elem):
        raise RuleError("pow2 takes an integer exponent")
    return "i32"


def _both(types: list[Type]) -> str:
    return arith_elem(types[0], types[1])


@dataclass(frozen=True)
class Builtin:
    """One builtin. ``lo``..``hi`` positional arguments and the keywords it accepts.

    Elementwise entries also carry ``operand`` (the element type the arguments are cast
    to, from their types), ``result`` (the result's element type; empty: the operand's),
    ``numpy`` (``f(operand, *args)`` on arrays already cast) and ``c`` (a C format per
    operand type, ``"*"`` for the rest; ``{rint}`` is the target's rounding function).
    """

    name: str
    kind: Kind
    lo: int
    hi: int
    kwargs: tuple[str, ...] = ()
    operand: Callable[[list[Type]], str] | None = None
    result: str = ""
    numpy: Callable[..., np.ndarray] | None = None
    c: Mapping[str, str] = field(default_factory=dict)

    def result_of(self, operand: str) -> str:
        return self.result or operand

    def render_c(self, operand: str, args: list[str], rint: str) -> str:
        fmt = self.c.get(operand, self.c.get("*"))
        if fmt is None:
            raise KeyError(f"{self.name} has no C rendering for {operand}")
        return fmt.format(*args, rint=rint)


def _fn(name: str, operand: Callable[[list[Type]], str], numpy: Callable[..., np.ndarray],
        c: Mapping[str, str], result: str = "", arity: int = 1) -> Builtin:
    return Builtin(name, Kind.ELEMENTWISE, arity, arity, (), operand, result, numpy, c)


_TABLE = [
    *(Builtin(t, Kind.CAST, 1, 1) for t in SCALARS),
    _fn("abs", _same, lambda op, x: np.abs(x),
        {"f32": "hp_fabs({0})", "i32": "hp_abs_i32({0})", "*": "({0})"}),
    _fn("sign", _same, _sign, {"f32": "hp_sign_f32({0})", "u32": "((uint32_t)({0} > 0u))",
                               "*": "((int32_t)(({0} > 0) - ({0} < 0)))"}),
    _fn("floor", _f32, lambda op, x: np.floor(x), {"*": "floorf({0})"}),
    _fn("ceil", _f32, lambda op, x: np.ceil(x), {"*": "ceilf({0})"}),
    _fn("sqrt", _f32, lambda op, x: np.sqrt(x), {"*": "sqrtf({0})"}),
    _fn("round", _f32, lambda op, x: np.rint(x), {"*": "{rint}({0})"}),
    _fn("min", _both, _extreme("min"),
        {"f32": "hp_fmin({0}, {1})", "*": "({0} < {1} ? {0} : {1})"}, arity=2),
    _fn("max", _both, _extreme("max"),
        {"f32": "hp_fmax({0}, {1})", "*": "({0} > {1} ? {0} : {1})"}, arity=2),
    _fn("isnan", _f32, lambda op, x: np.isnan(x), {"*": "hp_isnan({0})"}, result="bool"),
    _fn("isfinite", _f32, lambda op, x: np.isfinite(x), {"*": "hp_isfinite({0})"},
        result="bool"),
    _fn("exponent", _f32, _exponent, {"*": "hp_exponent({0})"}, result="i32"),
    _fn("mantissa", _f32,
        lambda op, x: np.asarray(x, np.float32).view(np.uint32) & np.uint32(0x7FFFFF),
        {"*": "hp_mantissa({0})"}, result="u32"),
    _fn("pow2", _int_exponent, _pow2, {"*": "hp_pow2({0})"}, result="f32"),
    Builtin("size", Kind.SCALAR, 1, 1),
    Builtin("iota", Kind.LAZY, 1, 1),
    Builtin("map", Kind.LAZY, 2, 9),
    Builtin("gather", Kind.LAZY, 2, 2),
    Builtin("unpack", Kind.LAZY, 1, 1),
    Builtin("random", Kind.LAZY, 0, 0, ("stream",)),
    Builtin("randint", Kind.LAZY, 1, 1, ("stream",)),
    Builtin("expand", Kind.LAZY, 1, 1),
    Builtin("reduce", Kind.BARRIER, 2, 2, ("key", "block")),
    Builtin("filter", Kind.BARRIER, 2, 2, ("index",)),
    Builtin("sort", Kind.BARRIER, 1, 1, ("key", "descending", "index")),
    Builtin("topk", Kind.BARRIER, 2, 2, ("key", "index")),
    Builtin("scatter", Kind.BARRIER, 3, 3),
    Builtin("pack", Kind.PACK, 1, 1, ("bits",)),
    Builtin("concat", Kind.PAYLOAD, 0, 255),
    Builtin("extract", Kind.PAYLOAD, 0, 255),
]

#: Every builtin by name.
BUILTINS: dict[str, Builtin] = {b.name: b for b in _TABLE}


def named(name: str) -> Builtin | None:
    return BUILTINS.get(name)


def of_kind(*kinds: Kind) -> frozenset[str]:
    """The names of the builtins of the given kinds."""
    return frozenset(b.name for b in _TABLE if b.kind in kinds)
