"""A program's declarations checked and the typed ``Program`` assembled: parameters
(with their values: a default or an override), ``require``s evaluated for those values,
``unbiased``, and the ``encode`` and ``decode`` functions, which ``compll.checker`` types.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError

from . import ir
from .builtins import BUILTINS
from .checker import Checker
from .diagnostics import SourceMap
from .ir import INTS, Pos, TypeKind

__all__ = ["check"]


def _signature_error(checker: Checker, fn: ir.Function) -> None:
    want = {
        "encode": "encode(g: f32[]) -> bytes",
        "decode": "decode(p: bytes, n: u32) -> f32[n]",
    }[fn.name]
    ok = True
    if fn.name == "encode":
        ok = (len(fn.args) == 1 and fn.args[0][1].kind is TypeKind.NAMED_ARRAY
              and fn.args[0][1].elem == "f32" and fn.returns.elem == "bytes"
              and fn.returns.kind is TypeKind.NAMED)
    else:
        ok = (len(fn.args) == 2 and fn.args[0][1].kind is TypeKind.NAMED
              and fn.args[0][1].elem == "bytes"
              and fn.args[1][1].kind is TypeKind.NAMED and fn.args[1][1].elem == "u32"
              and fn.returns.kind is TypeKind.NAMED_ARRAY and fn.returns.elem == "f32")
    if not ok:
        raise checker.err(f"{fn.name} must be declared as '{want}'", fn.pos)


def _coerce_param(checker: Checker, param: ir.Param, value: Any, pos: Pos | None) -> Any:
    elem = param.ty.elem
    if elem == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{checker.name}: parameter {param.name} must be true or false, "
                              f"got {value!r}")
        return value
    if isinstance(value, bool):
        raise ConfigError(f"{checker.name}: parameter {param.name} is {elem}, got a bool")
    if elem in INTS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ConfigError(f"{checker.name}: parameter {param.name} is {elem} (an integer), "
                              f"got {value!r}")
        lo, hi = (0, 2**32 - 1) if elem == "u32" else (-(2**31), 2**31 - 1)
        if elem == "u8":
            hi = 255
        if not lo <= value <= hi:
            raise ConfigError(f"{checker.name}: parameter {param.name}={value} is out of the "
                              f"{elem} range {lo}..{hi}")
        return value
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{checker.name}: parameter {param.name} is {elem}, got {value!r}")
    return float(np.float32(value))  # parameters hold exactly the f32 the kernels see


def check(
    items: list, smap: SourceMap, name: str, overrides: dict[str, Any] | None = None
) -> ir.Program:
    """Check parsed items and specialise them for parameter values.

    Args:
        items: what ``parser.parse`` returned.
        smap: its source map, for error positions.
        name: the algorithm name (the file stem).
        overrides: parameter values that replace the declared defaults.

    Returns:
        The typed ``Program``, with ``layout`` and ``param_values`` filled in.

    Raises:
        DslTypeError, LayoutError: on an ill-formed program.
        ConfigError: on an unknown or ill-typed parameter, or a failed ``require``.
    """
    overrides = dict(overrides or {})
    checker = Checker(smap, name, {})
    params: list[ir.Param] = []
    requires: list[ir.Require] = []
    funcs: dict[str, ir.Function] = {}
    unbiased = False
    for item in items:
        if isinstance(item, ir.Param):
            params.append(_param(checker, item, overrides))
        elif isinstance(item, ir.Require):
            requires.append(item)
        elif isinstance(item, ir.Unbiased):
            if unbiased:
                raise checker.err("unbiased is declared twice", item.pos)
            unbiased = True
        else:
            funcs[item.name] = _declared_function(checker, item, funcs)
    if overrides:
        raise _unknown_params(name, [p.name for p in params], overrides)
    checked_requires = [_require(checker, req, name) for req in requires]
    functions = {}
    for fn in ("encode", "decode"):  # encode first: it defines the layout decode reads
        if fn not in funcs:
            raise checker.err(f"the program has no {fn} function", None)
        functions[fn] = checker.function(funcs[fn])
    encode, decode = functions["encode"], functions["decode"]
    assert checker.layout is not None
    return ir.Program(
        name=name,
        path=smap.path,
        source="\n".join(smap.lines),
        params=tuple(params),
        requires=tuple(checked_requires),
        encode=encode,
        decode=decode,
        param_values=tuple(checker.param_values.items()),
        layout=checker.layout,
        unbiased=unbiased,
    )


def _declared_function(checker: Checker, item: ir.Function,
                       funcs: dict[str, ir.Function]) -> ir.Function:
    """``encode`` or ``decode`` as declared, its signature checked, once."""
    if item.name not in ("encode", "decode"):
        raise checker.err(
            f"unknown function {item.name!r}: a program defines encode and decode",
            item.pos,
        )
    if item.name in funcs:
        raise checker.err(f"{item.name} is defined twice", item.pos)
    _signature_error(checker, item)
    return item


def _param(checker: Checker, item: ir.Param, overrides: dict[str, Any]) -> ir.Param:
    """A declared parameter, checked, with its value (an override, taken out of
    ``overrides``, or its default) recorded in ``checker``."""
    if item.name in checker.param_types or item.name in BUILTINS:
        raise checker.err(f"parameter {item.name!r} is already defined", item.pos)
    ty = checker.resolve_type(item.ty, item.pos, for_param=True)
    if ty.kind is not TypeKind.SCALAR or ty.elem in ("f16", "u8"):
        raise checker.err("a parameter is f32, i32, u32 or bool", item.pos)
    default = checker.expr(item.default)
    assert default.ty is not None
    if default.ty.kind is not TypeKind.SCALAR:
        raise checker.err("a parameter's default must be a scalar", item.default.pos)
    value = checker.const_value(default)
    if item.name in overrides:
        value = overrides.pop(item.name)
    param = ir.Param(item.name, ty, default, item.pos)
    checker.param_values[item.name] = _coerce_param(checker, param, value, item.pos)
    checker.param_types[item.name] = ty
    return param


def _unknown_params(name: str, names: list[str], unknown: dict[str, Any]) -> ConfigError:
    hints = [f"{bad!r}: did you mean {close[0]!r}?" for bad in sorted(unknown)
             if (close := difflib.get_close_matches(bad, names, 1))]
    return ConfigError(
        f"{name}: unknown parameter(s) {', '.join(sorted(unknown))}; "
        f"{name} takes: {', '.join(names) or 'none'}"
        + (f" ({'; '.join(hints)})" if hints else "")
    )


def _require(checker: Checker, req: ir.Require, name: str) -> ir.Require:
    """A ``require``, checked and evaluated for the parameters' values."""
    cond = checker.expr(req.cond)
    if cond.ty is None or cond.ty.kind is not TypeKind.SCALAR or cond.ty.elem != "bool":
        raise checker.err("require needs a bool condition", req.cond.pos)
    if not checker.const_value(cond):
        shown = ", ".join(f"{k}={v}" for k, v in checker.param_values.items())
        raise ConfigError(f"{name}: {req.message} (got {shown})")
    return dataclasses.replace(req, cond=cond)
