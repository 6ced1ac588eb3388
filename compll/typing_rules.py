"""CompLL's promotion rules, shared by the checker, the interpreter and the renderers.

The rules follow C so generated kernels need no special casing: ``f16`` computes as
``f32``; ``bool`` and ``u8`` promote to ``i32``; mixing ``i32`` and ``u32`` gives
``u32``; any float makes the result ``f32``. An untyped literal takes the type of
the other operand (a float literal makes it ``f32``).
"""

from __future__ import annotations

import numpy as np

from .ir import FLOATS, INTS, Type

__all__ = ["DTYPES", "ITEMSIZE", "arith_elem", "promote_one", "is_numeric", "is_int"]

DTYPES: dict[str, type] = {
    "f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32,
    "u8": np.uint8, "bool": np.bool_,
}
ITEMSIZE = {"f32": 4, "f16": 2, "i32": 4, "u32": 4, "u8": 1, "bool": 1}


def is_numeric(elem: str) -> bool:
    return elem in FLOATS or elem in INTS or elem == "bool"


def is_int(elem: str) -> bool:
    return elem in INTS


def promote_one(elem: str) -> str:
    """The type an operand of this element type computes in."""
    if elem in FLOATS:
        return "f32"
    if elem in ("bool", "u8"):
        return "i32"
    return elem


def arith_elem(a: Type, b: Type) -> str:
    """The element type in which ``a op b`` is computed."""
    if a.literal and b.literal:
        return "f32" if "f32" in (a.elem, b.elem) else "i32"
    if a.literal or b.literal:
        lit, other = (a, b) if a.literal else (b, a)
        other_elem = promote_one(other.elem)
        if lit.elem == "f32":
            return "f32"
        return other_elem
    pa, pb = promote_one(a.elem), promote_one(b.elem)
    if "f32" in (pa, pb):
        return "f32"
    if "u32" in (pa, pb):
        return "u32"
    return "i32"
