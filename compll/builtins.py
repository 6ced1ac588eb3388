"""CompLL's builtins, defined once: what each takes, what kind of operator it is, and for
the scalar functions their typing rule, their NumPy meaning and their C rendering.

The checker takes arity and keywords from here, ``lower`` hoists the ``BARRIER`` kind,
the interpreter and the renderer evaluate ``ELEMENTWISE`` entries through their ``numpy``
and ``c`` fields, and the other kinds are dispatched by name (``call_NAME`` in the
checker and the renderer, ``op_NAME`` in the interpreter), so adding an operator means
adding a row here and one method per stage. The binary operators (``+``, ``<``, ``&``,
``and``...) are rows of ``OPERATORS``: their typing class, the types their operands are
computed in, their NumPy meaning and their C rendering, read by all three stages.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .ir import SCALARS, Type
from .typing_rules import DTYPES, arith_elem, is_int, promote_one

__all__ = ["Kind", "Builtin", "BUILTINS", "RuleError", "named", "of_kind", "fmax", "fmin",
           "OpKind", "Operator", "OPERATORS"]


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


# -- binary operators ---------------------------------------------------------------------

class OpKind(enum.Enum):
    LOGIC = "logic"  # and, or: bools; both sides evaluated (they have no side effects)
    BITWISE = "bitwise"  # & | ^: integers, or bools element by element
    SHIFT = "shift"  # << >>: in the left operand's type, the count a u32 taken mod 32
    COMPARE = "compare"  # a bool, from the operands in their common type
    ARITH = "arith"  # + - * / %: in the operands' common type, with C's wrapping rules


def _int_div(a: np.ndarray, b: np.ndarray, elem: str, mod: bool) -> np.ndarray:
    """C's integer division (truncating) or remainder; by zero gives 0, as the kernels'
    helpers do; the result wraps to ``elem``."""
    wide_a, wide_b = a.astype(np.int64), b.astype(np.int64)
    safe = np.where(wide_b == 0, 1, wide_b)
    q = np.abs(wide_a) // np.abs(safe) * np.sign(wide_a) * np.sign(safe)  # truncation
    out = wide_a - q * safe if mod else q
    return np.where(wide_b == 0, 0, out).astype(np.int64).astype(DTYPES[elem])


def _shift(left: bool) -> Callable[[np.ndarray, np.ndarray, str], np.ndarray]:
    def apply(a: np.ndarray, b: np.ndarray, elem: str) -> np.ndarray:
        count = (b.astype(np.int64) & 31).astype(a.dtype)
        return np.left_shift(a, count) if left else np.right_shift(a, count)
    return apply


@dataclass(frozen=True)
class Operator:
    """One binary operator. ``numpy(a, b, elem)`` applies it to operands already cast to
    their computing types (``operand_types``; ``elem`` the left one's); ``c`` is a C
    format per computing type (``"*"`` for the rest), ``{0}`` and ``{1}`` the operands and
    ``{elem}`` the type's name."""

    symbol: str
    kind: OpKind
    numpy: Callable[[np.ndarray, np.ndarray, str], np.ndarray]
    c: Mapping[str, str]
    integers_only: bool = False

    def operand_types(self, result: str, left: Type, right: Type) -> tuple[str, str]:
        """The types the left and right operands are computed in, given the checked
        type of the result."""
        if self.kind is OpKind.LOGIC or (self.kind is OpKind.BITWISE and result == "bool"):
            return "bool", "bool"
        if self.kind is OpKind.SHIFT:
            return result, "u32"
        elem = arith_elem(left, right)
        return elem, elem

    def render_c(self, elem: str, a: str, b: str) -> str:
        fmt = self.c.get(elem, self.c.get("*"))
        assert fmt is not None, (self.symbol, elem)
        return fmt.format(a, b, elem=elem)


def _compare(symbol: str, fn: Callable[..., np.ndarray]) -> Operator:
    return Operator(symbol, OpKind.COMPARE, lambda a, b, elem: fn(a, b),
                    {"*": f"({{0}} {symbol} {{1}})"})


def _wrapping(symbol: str, name: str, fn: Callable[..., np.ndarray]) -> Operator:
    # i32 overflow is undefined in C: the kernels' helpers compute it in u32.
    return Operator(symbol, OpKind.ARITH, lambda a, b, elem: fn(a, b),
                    {"i32": f"hp_{name}_i32({{0}}, {{1}})",
                     "u32": f"((uint32_t)({{0}} {symbol} {{1}}))", "*": f"({{0}} {symbol} {{1}})"})


_OPERATORS = [
    Operator("and", OpKind.LOGIC, lambda a, b, elem: a & b, {"*": "((bool)({0} & {1}))"}),
    Operator("or", OpKind.LOGIC, lambda a, b, elem: a | b, {"*": "((bool)({0} | {1}))"}),
    Operator("&", OpKind.BITWISE, lambda a, b, elem: a & b, {"*": "({0} & {1})"}, True),
    Operator("|", OpKind.BITWISE, lambda a, b, elem: a | b, {"*": "({0} | {1})"}, True),
    Operator("^", OpKind.BITWISE, lambda a, b, elem: a ^ b, {"*": "({0} ^ {1})"}, True),
    Operator("<<", OpKind.SHIFT, _shift(True), {"*": "hp_shl_{elem}({0}, {1})"}, True),
    Operator(">>", OpKind.SHIFT, _shift(False), {"*": "hp_shr_{elem}({0}, {1})"}, True),
    _compare("<", np.less),
    _compare("<=", np.less_equal),
    _compare(">", np.greater),
    _compare(">=", np.greater_equal),
    _compare("==", np.equal),
    _compare("!=", np.not_equal),
    _wrapping("+", "add", np.add),
    _wrapping("-", "sub", np.subtract),
    _wrapping("*", "mul", np.multiply),
    Operator("/", OpKind.ARITH,
             lambda a, b, elem: a / b if elem == "f32" else _int_div(a, b, elem, mod=False),
             {"f32": "({0} / {1})", "*": "hp_div_{elem}({0}, {1})"}),
    Operator("%", OpKind.ARITH, lambda a, b, elem: _int_div(a, b, elem, mod=True),
             {"*": "hp_mod_{elem}({0}, {1})"}, True),
]

#: Every binary operator by its symbol.
OPERATORS: dict[str, Operator] = {op.symbol: op for op in _OPERATORS}
