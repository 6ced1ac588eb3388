"""The CompLL checker: types, shapes and the payload layout.

``Checker`` types expressions and statements: every expression gets its type, every
random call its stream, and ``layout`` collects the payload sections that ``encode``
writes and ``decode`` reads back. ``compll.declarations.check`` runs it over a parsed
program and assembles the typed, specialised ``Program``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from . import calls, ir
from .builtins import BUILTINS, OPERATORS, Builtin, Kind, OpKind, of_kind
from .diagnostics import DslTypeError, LayoutError, SourceMap
from .interpreter import eval_constant
from .ir import FLOATS, SCALARS, Length, LengthKind, Pos, Type, TypeKind
from .typing_rules import arith_elem, is_numeric, promote_one

__all__ = ["Checker", "section_type_in_decode"]

_SCALAR_FNS = of_kind(Kind.ELEMENTWISE, Kind.CAST)
_REDUCE_OPS = ("sum", "max", "min")
_BOOL = Type.scalar("bool")
_U32 = Type.scalar("u32")


class _Scope:
    """Names visible in one function: arguments, lets and their defining values."""

    def __init__(self, fn: str, names: dict[str, Type]) -> None:
        self.fn = fn
        self.types = dict(names)
        self.values: dict[str, ir.Expr] = {}
        self.lengths: dict[str, Length] = {}


class Checker:
    """Types one program; ``compll.calls`` holds the rules of its builtin calls."""

    def __init__(self, smap: SourceMap, name: str, param_types: dict[str, Type]) -> None:
        self.smap = smap
        self.name = name
        self.param_types = param_types
        self.param_values: dict[str, Any] = {}
        self.scope = _Scope("", {})
        self.lambda_env: dict[str, Type] | None = None
        self.lambda_arrays: tuple[Length, ...] = ()
        self.stream = 0
        self.fresh = 0
        self.layout: tuple[ir.Section, ...] | None = None

    # -- errors ---------------------------------------------------------------------------
    def err(self, message: str, pos: Pos | None, cls: type = DslTypeError) -> Exception:
        return self.smap.error(cls, message, pos)

    # -- lengths --------------------------------------------------------------------------
    def fresh_length(self, what: str, pos: Pos) -> Length:
        self.fresh += 1
        return Length(LengthKind.SYM, name=f"{what}@{pos.line}:{pos.column}")

    def length_of_scalar(self, expr: ir.Expr) -> Length:
        """The array length that the value of a scalar expression stands for."""
        if isinstance(expr, ir.Const) and isinstance(expr.value, int):
            return Length(LengthKind.CONST, int(expr.value))
        if isinstance(expr, ir.Call) and expr.fn == "size" and expr.args:
            ty = expr.args[0].ty
            if ty is not None and ty.length is not None:
                return ty.length
        if isinstance(expr, ir.Var):
            if expr.name in self.scope.lengths:
                return self.scope.lengths[expr.name]
            if expr.name in self.scope.values:
                return self.length_of_scalar(self.scope.values[expr.name])
            return Length(LengthKind.SYM, name=f"{self.scope.fn}:{expr.name}")
        return self.fresh_length("len", expr.pos)

    def same_length(self, a: Type, b: Type, pos: Pos) -> None:
        if a.length != b.length:
            raise self.err(
                f"arrays of different lengths ({a.length} and {b.length}) cannot be "
                "combined elementwise", pos,
            )

    # -- top level ------------------------------------------------------------------------
    def resolve_type(self, ty: Type, pos: Pos, for_param: bool = False) -> Type:
        elem = ty.elem
        if ty.kind is TypeKind.NAMED:
            if elem == "bytes" and not for_param:
                return Type(TypeKind.BYTES)
            if elem in SCALARS:
                return Type.scalar(elem)
            raise self.err(f"unknown type {elem!r}; use one of {', '.join(SCALARS)}", pos)
        length = ty.length or Length(LengthKind.SYM, name="?")
        if length.kind is LengthKind.SYM and length.name == "n":
            length = Length(LengthKind.N)
        if elem in ("u1", "u2", "u4"):
            return Type(TypeKind.PACKED, "u8", length, bits=int(elem[1:]))
        if elem in SCALARS:
            return Type.array(elem, length)
        raise self.err(
            f"unknown element type {elem!r}; arrays hold {', '.join(SCALARS)} and packed "
            "arrays are u1, u2, u4 or u8", pos,
        )

    # -- expressions ----------------------------------------------------------------------
    def expr(self, e: ir.Expr) -> ir.Expr:
        method: Callable[[Any], ir.Expr] = getattr(self, "expr_" + type(e).__name__.lower())
        return method(e)

    def expr_const(self, e: ir.Const) -> ir.Expr:
        if isinstance(e.value, bool):
            return dataclasses.replace(e, ty=_BOOL)
        if isinstance(e.value, int):
            if e.value > 0xFFFFFFFF:
                raise self.err(f"integer literal {e.value} does not fit in 32 bits", e.pos)
            return dataclasses.replace(e, ty=Type.scalar("i32", literal=True))
        with np.errstate(over="ignore"):
            overflows = not np.isfinite(np.float32(e.value))
        if overflows:  # the parser reads 1e400 as inf: no literal spells inf
            raise self.err("float literal out of the f32 range (at most "
                           f"{float(np.finfo(np.float32).max):.7g} in magnitude)", e.pos)
        return dataclasses.replace(e, ty=Type.scalar("f32", literal=True))

    def expr_var(self, e: ir.Var) -> ir.Expr:
        if self.lambda_env is not None and e.name in self.lambda_env:
            return dataclasses.replace(e, ty=self.lambda_env[e.name])
        ty = self.scope.types.get(e.name) or self.param_types.get(e.name)
        if ty is None:
            if e.name in BUILTINS or e.name in _REDUCE_OPS:
                raise self.err(f"{e.name!r} is an operator; call it as {e.name}(...)", e.pos)
            raise self.err(f"undefined name {e.name!r}", e.pos)
        if self.lambda_env is not None and ty.kind not in (TypeKind.SCALAR,):
            raise self.err(
                f"array {e.name!r} cannot be used inside a lambda; pass it to map as "
                "another argument", e.pos,
            )
        return dataclasses.replace(e, ty=ty)

    def value_type(self, e: ir.Expr, what: str) -> Type:
        assert e.ty is not None
        if e.ty.kind not in (TypeKind.SCALAR, TypeKind.ARRAY):
            raise self.err(f"{what} needs a number or an array of numbers, not {e.ty}", e.pos)
        return e.ty

    def broadcast(self, types: list[Type], elem: str, pos: Pos, literal: bool = False) -> Type:
        arrays = [t for t in types if t.kind is TypeKind.ARRAY]
        for other in arrays[1:]:
            self.same_length(arrays[0], other, pos)
        if arrays:
            return Type.array(elem, arrays[0].length)  # type: ignore[arg-type]
        return Type.scalar(elem, literal=literal)

    def expr_unary(self, e: ir.Unary) -> ir.Expr:
        x = self.expr(e.operand)
        ty = self.value_type(x, f"'{e.op}'")
        if e.op == "not":
            if ty.elem != "bool":
                raise self.err(f"'not' needs a bool, not {ty}", e.pos)
            return dataclasses.replace(e, operand=x, ty=ty)
        if ty.elem == "bool":
            raise self.err("cannot negate a bool; use 'not'", e.pos)
        elem = promote_one(ty.elem)
        return dataclasses.replace(e, operand=x, ty=self.broadcast([ty], elem, e.pos, ty.literal))

    def expr_binary(self, e: ir.Binary) -> ir.Expr:
        left, right = self.expr(e.left), self.expr(e.right)
        lt = self.value_type(left, f"'{e.op}'")
        rt = self.value_type(right, f"'{e.op}'")
        op = OPERATORS[e.op]
        literal = lt.literal and rt.literal
        if op.kind is OpKind.LOGIC:
            if lt.elem != "bool" or rt.elem != "bool":
                raise self.err(f"'{e.op}' needs bools, got {lt} and {rt}", e.pos)
            elem, literal = "bool", False
        elif op.kind is OpKind.BITWISE and lt.elem == "bool" and rt.elem == "bool":
            elem, literal = "bool", False
        else:
            elem = arith_elem(lt, rt)
            if op.integers_only and (lt.elem in FLOATS or rt.elem in FLOATS or elem == "f32"):
                raise self.err(f"'{e.op}' needs integers, got {lt} and {rt}", e.pos)
            if op.kind is OpKind.SHIFT:
                elem = "u32" if lt.literal and rt.elem == "u32" else promote_one(lt.elem)
            elif op.kind is OpKind.COMPARE:
                elem, literal = "bool", False
        return dataclasses.replace(
            e, left=left, right=right, ty=self.broadcast([lt, rt], elem, e.pos, literal)
        )

    def expr_select(self, e: ir.Select) -> ir.Expr:
        cond, then, other = self.expr(e.cond), self.expr(e.then), self.expr(e.other)
        ct = self.value_type(cond, "'if'")
        tt = self.value_type(then, "'then'")
        ot = self.value_type(other, "'else'")
        if ct.elem != "bool":
            raise self.err(f"the condition of 'if' must be a bool, not {ct}", e.cond.pos)
        if tt.elem == "bool" and ot.elem == "bool":
            elem = "bool"
        elif tt.elem == "bool" or ot.elem == "bool":
            raise self.err(f"'then' and 'else' differ: {tt} and {ot}", e.pos)
        else:
            elem = arith_elem(tt, ot)
        literal = tt.literal and ot.literal
        ty = self.broadcast([ct, tt, ot], elem, e.pos, literal)
        return dataclasses.replace(e, cond=cond, then=then, other=other, ty=ty)

    def expr_lambda(self, e: ir.Lambda) -> ir.Expr:
        raise self.err("a lambda can only be passed to map, reduce, filter, sort or topk", e.pos)

    def lambda_body(self, lam: ir.Expr, params: tuple[Type, ...], what: str) -> ir.Lambda:
        """Check a lambda (or a builtin name such as ``abs``) applied per element."""
        if isinstance(lam, ir.Var) and lam.name in _SCALAR_FNS and len(params) == 1:
            lam = ir.Lambda(("_x",), ir.Call(lam.name, (ir.Var("_x", lam.pos),), (), lam.pos),
                            lam.pos)
        if not isinstance(lam, ir.Lambda):
            raise self.err(f"{what} needs a lambda such as 'x -> abs(x)'", lam.pos)
        if len(lam.params) != len(params):
            raise self.err(
                f"{what} passes {len(params)} value(s) per element but the lambda takes "
                f"{len(lam.params)}", lam.pos,
            )
        if len(set(lam.params)) != len(lam.params):
            raise self.err("lambda parameters must have distinct names", lam.pos)
        outer = self.lambda_env
        if outer is not None:
            raise self.err("lambdas cannot be nested", lam.pos)
        self.lambda_env = {
            p: Type.scalar(t.elem) for p, t in zip(lam.params, params, strict=True)
        }
        try:
            body = self.expr(lam.body)
        finally:
            self.lambda_env = outer
        assert body.ty is not None
        if body.ty.kind is not TypeKind.SCALAR:
            raise self.err(f"a lambda must give one value per element, not {body.ty}", lam.pos)
        ty = Type.scalar(body.ty.elem)
        return dataclasses.replace(lam, body=body, ty=ty, param_types=params)

    def expr_call(self, e: ir.Call) -> ir.Expr:
        spec = BUILTINS.get(e.fn)
        if spec is None:
            near = sorted(b for b in BUILTINS if b[:2] == e.fn[:2])
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise self.err(f"unknown function {e.fn!r}{hint}", e.pos)
        if e.fn == "map" and len(e.args) < 2:
            raise self.err("map takes one or more arrays and then a lambda", e.pos)
        self.arity(e, spec)
        if spec.kind is Kind.CAST:
            return calls.cast(self, e)
        if spec.kind is Kind.ELEMENTWISE:
            return calls.elementwise(self, e, spec)
        return calls.RULES[e.fn](self, e)

    def arity(self, e: ir.Call, spec: Builtin) -> None:
        if not spec.lo <= len(e.args) <= spec.hi:
            want = str(spec.lo) if spec.lo == spec.hi else f"{spec.lo} to {spec.hi}"
            raise self.err(f"{e.fn} takes {want} argument(s), got {len(e.args)}", e.pos)
        for key, value in e.kwargs:
            if key not in spec.kwargs:
                allowed = ", ".join(spec.kwargs) if spec.kwargs else "none"
                raise self.err(
                    f"{e.fn} has no keyword argument {key!r} (allowed: {allowed})", value.pos
                )

    def typed_args(self, e: ir.Call) -> tuple[ir.Expr, ...]:
        return tuple(self.expr(a) for a in e.args)

    def const_value(self, x: ir.Expr) -> Any:
        """Evaluate a constant expression (literals and parameters)."""
        try:
            return eval_constant(x, self.param_values)
        except KeyError:
            raise self.err("this must be a constant (literals and params only)", x.pos) \
                from None

    # -- statements -----------------------------------------------------------------------
    def bind(self, name: str, ty: Type, pos: Pos) -> None:
        if name in self.scope.types or name in self.param_types:
            raise self.err(f"{name!r} is already defined", pos)
        if name in BUILTINS or name in _REDUCE_OPS:
            raise self.err(f"{name!r} is a builtin and cannot be redefined", pos)
        self.scope.types[name] = Type(ty.kind, ty.elem, ty.length, ty.bits, ty.items)

    def annotation_matches(self, want: Type, got: Type) -> bool:
        if got.kind is TypeKind.PACKED and got.bits == 8 and want.kind is TypeKind.ARRAY \
                and want.elem == "u8":
            want = Type(TypeKind.PACKED, "u8", want.length, bits=8)  # u8[n] names 8-bit packed data
        if want.kind != got.kind or want.elem != got.elem or want.bits != got.bits:
            return False
        if want.kind in (TypeKind.ARRAY, TypeKind.PACKED) and want.length is not None:
            if want.length.kind is LengthKind.SYM and want.length.name == "?":
                return True
            if want.length.kind is LengthKind.SYM:
                return got.length == self.scope.lengths.get(want.length.name, want.length)
            return want.length == got.length
        return True

    def stmt_let(self, s: ir.Let, decode_arg: str | None) -> ir.Let:
        value = s.value
        if isinstance(value, ir.Call) and value.fn == "extract":
            return self.let_extract(s, decode_arg)
        checked = self.expr(value)
        assert checked.ty is not None
        if checked.ty.kind is TypeKind.TUPLE:
            types: tuple[Type, ...] = checked.ty.items
        else:
            types = (checked.ty,)
        if len(types) != len(s.names):
            raise self.err(
                f"the value gives {len(types)} result(s) but {len(s.names)} name(s) are bound",
                s.pos,
            )
        for name, ann, ty, pos in zip(s.names, s.annotations, types, s.annotation_pos,
                                      strict=True):
            if ann is not None:
                want = self.resolve_type(ann, pos)
                lit_ok = ty.literal and want.kind is TypeKind.SCALAR and is_numeric(want.elem)
                if not lit_ok and not self.annotation_matches(want, ty):
                    raise self.err(f"{name!r} is declared {want} but the value is {ty}", pos)
                if lit_ok:
                    ty = want
            self.bind(name, ty, pos)
        if len(s.names) == 1:
            self.scope.values[s.names[0]] = checked
        return dataclasses.replace(s, value=checked)

    def let_extract(self, s: ir.Let, decode_arg: str | None) -> ir.Let:
        call = s.value
        assert isinstance(call, ir.Call)
        if self.scope.fn != "decode" or self.layout is None:
            raise self.err("extract can only be used in decode", call.pos)
        if len(call.args) != 1 or call.kwargs:
            raise self.err("extract takes the payload argument only", call.pos)
        arg = call.args[0]
        if not isinstance(arg, ir.Var) or arg.name != decode_arg:
            raise self.err(f"extract reads decode's payload argument {decode_arg!r}", arg.pos)
        if len(s.names) != len(self.layout):
            raise self.err(
                f"encode writes {len(self.layout)} section(s) but decode extracts "
                f"{len(s.names)}", s.pos, LayoutError,
            )
        types = []
        for i, (section, name, ann, pos) in enumerate(
            zip(self.layout, s.names, s.annotations, s.annotation_pos, strict=True)
        ):
            ty = section_type_in_decode(section)
            if ann is not None:
                want = self.resolve_type(ann, pos)
                if not self.annotation_matches(want, ty):
                    raise self.err(
                        f"section {i + 1} ({name!r}): encode writes {section.ty} but decode "
                        f"expects {want}", pos, LayoutError,
                    )
            self.bind(name, ty, pos)
            types.append(ty)
        checked = dataclasses.replace(
            call, args=(dataclasses.replace(arg, ty=Type(TypeKind.BYTES)),),
            ty=Type(TypeKind.TUPLE, items=tuple(types)),
        )
        return dataclasses.replace(s, value=checked)

    def function(self, fn: ir.Function) -> ir.Function:
        self.stream = 0
        body: list[ir.Stmt] = []
        decode_arg = None
        if fn.name == "encode":
            (gname, _), = fn.args
            self.scope = _Scope("encode", {gname: Type.array("f32", Length(LengthKind.N))})
        else:
            (pname, _), (nname, _) = fn.args
            decode_arg = pname
            self.scope = _Scope("decode", {pname: Type(TypeKind.BYTES), nname: _U32})
            self.scope.lengths[nname] = Length(LengthKind.N)
        returned = False
        for stmt in fn.body:
            if returned:
                raise self.err("code after return is never run", stmt.pos)
            if isinstance(stmt, ir.Let):
                body.append(self.stmt_let(stmt, decode_arg))
                continue
            returned = True
            body.append(self.stmt_return(fn, stmt))
        if not returned:
            raise self.err(f"{fn.name} must end with a return statement", fn.pos)
        return dataclasses.replace(fn, body=tuple(body))

    def stmt_return(self, fn: ir.Function, s: ir.Return) -> ir.Return:
        if fn.name == "encode":
            value = s.value
            if not (isinstance(value, ir.Call) and value.fn == "concat"):
                raise self.err("encode must return concat(...) of the payload sections",
                               value.pos)
            if value.kwargs or not value.args:
                raise self.err("concat takes one or more sections and no keywords", value.pos)
            items = self.typed_args(value)
            self.layout = tuple(self.section(x) for x in items)
            return dataclasses.replace(
                s, value=dataclasses.replace(value, args=items, ty=Type(TypeKind.BYTES))
            )
        value = self.expr(s.value)
        assert value.ty is not None
        if value.ty.kind is not TypeKind.ARRAY or value.ty.elem != "f32" \
                or value.ty.length != Length(LengthKind.N):
            raise self.err(f"decode must return an f32 array of n elements, not {value.ty}",
                           s.value.pos)
        return dataclasses.replace(s, value=value)

    def section(self, x: ir.Expr) -> ir.Section:
        ty = x.ty
        assert ty is not None
        if ty.kind is TypeKind.SCALAR:
            if ty.elem == "bool":
                raise self.err("a bool cannot go into a payload; cast it with u8(...)", x.pos)
            return ir.Section(Type.scalar(promote_one(ty.elem) if ty.literal else ty.elem))
        if ty.kind is TypeKind.ARRAY:
            if ty.elem == "bool":
                raise self.err("bool arrays cannot go into a payload; pack(..., bits=1) them",
                               x.pos)
            assert ty.length is not None
            if ty.length.kind is LengthKind.BLOCKS and not _fixed(ty.length):
                raise self.err("per-block values in a payload must cut n or a constant number "
                               "of elements into blocks", x.pos, LayoutError)
            group = ty.length.name if ty.length.kind is LengthKind.SYM else ""
            return ir.Section(ty, group)
        if ty.kind is TypeKind.PACKED:
            assert ty.length is not None
            if not _fixed(ty.length):
                raise self.err("a packed array in a payload must have n or a constant number "
                               "of elements", x.pos, LayoutError)
            return ir.Section(ty)
        raise self.err(f"concat takes scalars and arrays, not {ty}", x.pos)


def _fixed(length: Length) -> bool:
    """Whether a length is known from n alone (n, a constant, or blocks of those)."""
    if length.kind is LengthKind.BLOCKS:
        return length.base is not None and _fixed(length.base)
    return length.kind in (LengthKind.N, LengthKind.CONST)


def section_type_in_decode(section: ir.Section) -> Type:
    """The type decode sees for a section: run-time lengths become one symbol per group."""
    ty = section.ty
    if ty.kind in (TypeKind.ARRAY, TypeKind.PACKED) and ty.length is not None \
            and ty.length.kind is LengthKind.SYM:
        group = Length(LengthKind.SYM, name=f"payload:{section.group}")
        return dataclasses.replace(ty, length=group)
    return ty
