"""The CompLL IR: frozen dataclasses, each node carrying its source position.

The parser builds these nodes with ``ty=None``; the checker returns a copy of the
tree in which every expression has its type and every builtin call is resolved.
Interpreter and code generators consume only checked trees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "Pos", "LengthKind", "Length", "TypeKind", "Type", "Expr", "Const", "Var", "Unary",
    "Binary", "Select", "Call", "Lambda", "Let", "Return", "Stmt", "Function", "Param", "Require",
    "Unbiased", "Section", "Program",
    "SCALARS", "FLOATS", "INTS", "BOOL", "PACKED_BITS", "operands", "show", "shape", "calls",
]

SCALARS = ("f32", "f16", "i32", "u32", "u8", "bool")
FLOATS = ("f32", "f16")
INTS = ("i32", "u32", "u8")
BOOL = "bool"
PACKED_BITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Pos:
    """A 1-based line and column in a DSL source file."""

    line: int
    column: int


class LengthKind(StrEnum):
    """What an array's length is (``Length.kind``)."""

    N = "n"  # the tensor's length
    CONST = "const"  # ``value`` elements
    BLOCKS = "blocks"  # one element per block of ``value`` elements of ``base``
    SYM = "sym"  # computed at run time, identified by ``name``


@dataclass(frozen=True)
class Length:
    """The symbolic length of an array (``LengthKind``). Two arrays may be combined
    elementwise only when their lengths are equal."""

    kind: LengthKind
    value: int = 0  # "const": the count; "blocks": the block size (0: one block)
    name: str = ""
    base: Length | None = None  # "blocks": the length cut into blocks

    def __str__(self) -> str:
        if self.kind is LengthKind.N:
            return "n"
        if self.kind is LengthKind.CONST:
            return str(self.value)
        if self.kind is LengthKind.BLOCKS:
            return f"ceil({self.base} / {self.value})" if self.value else "1"
        return self.name


class TypeKind(StrEnum):
    """What a CompLL type is (``Type.kind``)."""

    SCALAR = "scalar"
    ARRAY = "array"
    PACKED = "packed"  # a bit-packed unsigned array of ``bits`` bits
    BYTES = "bytes"  # a payload
    TUPLE = "tuple"  # ``items``
    NAMED = "named"  # a scalar annotation as written (``elem`` names it), before checking
    NAMED_ARRAY = "named_array"  # an array annotation as written, before checking


@dataclass(frozen=True)
class Type:
    """A CompLL type (``TypeKind``)."""

    kind: TypeKind
    elem: str = ""
    length: Length | None = None
    bits: int = 0
    items: tuple[Type, ...] = ()
    literal: bool = False  # an untyped numeric literal that adapts to the other operand

    def __str__(self) -> str:
        if self.kind is TypeKind.SCALAR:
            return self.elem
        if self.kind is TypeKind.ARRAY:
            return f"{self.elem}[{self.length}]"
        if self.kind is TypeKind.PACKED:
            return f"u{self.bits}[{self.length}]"
        if self.kind is TypeKind.TUPLE:
            return "(" + ", ".join(str(t) for t in self.items) + ")"
        return self.kind

    @staticmethod
    def scalar(elem: str, literal: bool = False) -> Type:
        return Type(TypeKind.SCALAR, elem, literal=literal)

    @staticmethod
    def array(elem: str, length: Length) -> Type:
        return Type(TypeKind.ARRAY, elem, length)


@dataclass(frozen=True)
class Const:
    value: int | float | bool
    pos: Pos
    ty: Type | None = None


@dataclass(frozen=True)
class Var:
    name: str
    pos: Pos
    ty: Type | None = None


@dataclass(frozen=True)
class Unary:
    op: str  # "-", "not"
    operand: Expr
    pos: Pos
    ty: Type | None = None


@dataclass(frozen=True)
class Binary:
    op: str  # + - * / % < <= > >= == != and or & | ^ << >>
    left: Expr
    right: Expr
    pos: Pos
    ty: Type | None = None


@dataclass(frozen=True)
class Select:
    """``if cond then a else b``, elementwise when any operand is an array."""

    cond: Expr
    then: Expr
    other: Expr
    pos: Pos
    ty: Type | None = None


@dataclass(frozen=True)
class Call:
    """A builtin call. ``kwargs`` holds keyword arguments in source order.

    After checking, ``stream`` is the random stream of ``random``/``randint`` and
    ``operand_ty`` the common operand type an arithmetic builtin computes in.
    """

    fn: str
    args: tuple[Expr, ...]
    kwargs: tuple[tuple[str, Expr], ...]
    pos: Pos
    ty: Type | None = None
    stream: int = -1
    operand_ty: Type | None = None

    def kwarg(self, name: str) -> Expr | None:
        for key, value in self.kwargs:
            if key == name:
                return value
        return None


@dataclass(frozen=True)
class Lambda:
    params: tuple[str, ...]
    body: Expr
    pos: Pos
    ty: Type | None = None
    param_types: tuple[Type, ...] = ()


Expr = Const | Var | Unary | Binary | Select | Call | Lambda


@dataclass(frozen=True)
class Let:
    names: tuple[str, ...]
    annotations: tuple[Type | None, ...]
    value: Expr
    pos: Pos
    annotation_pos: tuple[Pos, ...] = ()


@dataclass(frozen=True)
class Return:
    value: Expr
    pos: Pos


Stmt = Let | Return


@dataclass(frozen=True)
class Function:
    name: str  # "encode" or "decode"
    args: tuple[tuple[str, Type], ...]
    returns: Type
    body: tuple[Stmt, ...]
    pos: Pos


@dataclass(frozen=True)
class Param:
    name: str
    ty: Type
    default: Expr
    pos: Pos


@dataclass(frozen=True)
class Require:
    cond: Expr
    message: str
    pos: Pos


@dataclass(frozen=True)
class Unbiased:
    """The ``unbiased`` declaration: E[decode(encode(g))] = g, so no error feedback."""

    pos: Pos


@dataclass(frozen=True)
class Section:
    """One section of a payload layout, as ``encode`` writes it.

    ``group`` ties sections whose element counts must agree (they came from one
    run-time length, e.g. the indices and values of a top-k).
    """

    ty: Type  # scalar, array or packed
    group: str = ""


@dataclass(frozen=True)
class Program:
    """A parsed (or, after checking, a checked and specialised) CompLL program."""

    name: str
    path: str
    source: str
    params: tuple[Param, ...]
    requires: tuple[Require, ...]
    encode: Function
    decode: Function
    param_values: tuple[tuple[str, int | float | bool], ...] = ()
    layout: tuple[Section, ...] = ()
    unbiased: bool = False

    def param(self, name: str) -> int | float | bool:
        return dict(self.param_values)[name]


def operands(e: Expr) -> list[Expr]:
    """The direct operands of a unary, binary or select expression."""
    if isinstance(e, Unary):
        return [e.operand]
    if isinstance(e, Binary):
        return [e.left, e.right]
    if isinstance(e, Select):
        return [e.cond, e.then, e.other]
    return []


def show(e: Expr | None) -> str:
    """An expression as DSL-like text (for dumps and messages)."""
    if e is None:
        return ""
    if isinstance(e, Const):
        return str(e.value).lower() if isinstance(e.value, bool) else repr(e.value)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Unary):
        return f"{e.op}{' ' if e.op == 'not' else ''}{show(e.operand)}"
    if isinstance(e, Binary):
        return f"({show(e.left)} {e.op} {show(e.right)})"
    if isinstance(e, Select):
        return f"(if {show(e.cond)} then {show(e.then)} else {show(e.other)})"
    if isinstance(e, Lambda):
        params = e.params[0] if len(e.params) == 1 else f"({', '.join(e.params)})"
        return f"{params} -> {show(e.body)}"
    args = [show(a) for a in e.args] + [f"{k}={show(v)}" for k, v in e.kwargs]
    return f"{e.fn}({', '.join(args)})"


def shape(node: object) -> object:
    """An IR node's structure without source positions and types: two reductions over
    the same elements have the same shape."""
    if isinstance(node, (list, tuple)):
        return tuple(shape(x) for x in node)
    if dataclasses.is_dataclass(node):
        return (type(node).__name__, *(shape(getattr(node, f.name))
                                       for f in dataclasses.fields(node)
                                       if f.name not in ("pos", "ty", "operand_ty",
                                                         "param_types", "annotation_pos")))
    return node


def calls(node: object, fn: str) -> bool:
    """Whether any call of ``fn`` appears in an IR node (or a list of nodes)."""
    if isinstance(node, Call) and node.fn == fn:
        return True
    if isinstance(node, (list, tuple)):
        return any(calls(x, fn) for x in node)
    if dataclasses.is_dataclass(node):
        return any(calls(getattr(node, f.name), fn) for f in dataclasses.fields(node))
    return False
