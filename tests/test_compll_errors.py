"""Malformed programs: each error names the file, line, column and what is wrong."""

import pickle
import textwrap

import pytest

from compll import load_source
from compll.diagnostics import DslSyntaxError, DslTypeError, LayoutError
from hipress import CompileError, ConfigError

pytestmark = pytest.mark.pure

DECODE_ONEBIT = """
decode(p: bytes, n: u32) -> f32[n]:
    let s: f32, b: u1[n] = extract(p)
    return map(unpack(b), v -> if v == 1 then s else -s)
"""


def program(encode_body: str, decode: str = DECODE_ONEBIT, head: str = "") -> str:
    body = textwrap.indent(textwrap.dedent(encode_body).strip("\n"), "    ")
    return f"{head}encode(g: f32[]) -> bytes:\n{body}\n{decode}"


OK_ENCODE = """
let s = reduce(g, max, key=abs)
return concat(s, pack(map(g, x -> x >= 0.0), bits=1))
"""

CASES = [
    # (id, source, error class, line, column, message fragment)
    ("bad-char", program("let s = g @ 2\n" + OK_ENCODE), DslSyntaxError, 2, 15,
     "unexpected character '@'"),
    ("missing-return", program("let s = reduce(g, max)\n"), DslTypeError, 1, 1,
     "encode must end with a return statement"),
    ("undefined-name", program("let s = reduce(h, max)\n" + OK_ENCODE), DslTypeError, 2, 20,
     "undefined name 'h'"),
    ("unknown-function", program("let s = maxx(g)\n" + OK_ENCODE), DslTypeError, 2, 13,
     "unknown function 'maxx'"),
    ("and-needs-bools", program("let s = reduce(g, max) and true\n" + OK_ENCODE), DslTypeError,
     2, 13, "'and' needs bools"),
    ("length-mismatch", program(
        "let t = topk(g, 5)\nlet u = map(g, t, (a, b) -> a + b)\n" + OK_ENCODE),
     DslTypeError, 3, 13, "arrays of different lengths"),
    ("pack-bits", program(
        "let s = reduce(g, max)\nreturn concat(s, pack(map(g, x -> x >= 0.0), bits=3))\n"),
     DslTypeError, 3, 55, "pack's bits must be 1, 2, 4 or 8, not 3"),
    ("pack-floats", program(
        "let s = reduce(g, max)\nreturn concat(s, pack(g, bits=1))\n"),
     DslTypeError, 3, 27, "pack needs integers or bools"),
    ("random-outside-map", program("let r = random()\n" + OK_ENCODE), DslTypeError, 2, 13,
     "call it inside a map lambda"),
    ("layout-count", program(OK_ENCODE, """
decode(p: bytes, n: u32) -> f32[n]:
    let s, b, c = extract(p)
    return map(unpack(b), v -> s)
"""), LayoutError, 6, 5, "encode writes 2 section(s) but decode extracts 3"),
    ("layout-type", program(OK_ENCODE, """
decode(p: bytes, n: u32) -> f32[n]:
    let s: f16, b: u1[n] = extract(p)
    return map(unpack(b), v -> f32(s))
"""), LayoutError, 6, 9, "section 1 ('s'): encode writes f32 but decode expects f16"),
    ("layout-bits", program(OK_ENCODE, """
decode(p: bytes, n: u32) -> f32[n]:
    let s: f32, b: u2[n] = extract(p)
    return map(unpack(b), v -> s)
"""), LayoutError, 6, 17, "encode writes u1[n] but decode expects u2[n]"),
    ("decode-length", program(OK_ENCODE, """
decode(p: bytes, n: u32) -> f32[n]:
    let s: f32, b: u1[n] = extract(p)
    return map(iota(5), v -> s)
"""), DslTypeError, 7, 12, "decode must return an f32 array of n elements"),
    ("redefined", program("let s = 1\nlet s = 2\n" + OK_ENCODE), DslTypeError, 3, 9,
     "'s' is already defined"),
    ("bad-indent", program("let s = 1\n  let t = 2\n" + OK_ENCODE), DslSyntaxError, 3, 7,
     "unexpected indentation"),
    ("signature", "encode(g: f32) -> bytes:\n    return concat(g)\n" + DECODE_ONEBIT,
     DslTypeError, 1, 1, "encode must be declared as 'encode(g: f32[]) -> bytes'"),
    ("param-type", "param k: f64 = 1\n" + program(OK_ENCODE), DslTypeError, 1, 7,
     "unknown type 'f64'"),
    ("unknown-kwarg", program("let s = reduce(g, sum, keys=abs)\n" + OK_ENCODE), DslTypeError,
     2, 33, "reduce has no keyword argument 'keys'"),
    ("nested-lambda", program(
        "let s = reduce(g, max, key=x -> reduce(g, max, key=y -> y))\n" + OK_ENCODE),
     DslTypeError, 2, 44, "array 'g' cannot be used inside a lambda"),
    ("no-decode", program(OK_ENCODE, ""), DslTypeError, None, None,
     "the program has no decode function"),
    ("bool-in-payload", program("return concat(true)\n"), DslTypeError, 2, 19,
     "a bool cannot go into a payload"),
    ("unclosed-paren", program("let s = reduce(g, max\n" + OK_ENCODE), DslSyntaxError, 4, 5,
     "unexpected 'let'"),
    ("not-int-index", program(
        "let v = gather(g, g)\n" + OK_ENCODE), DslTypeError, 2, 23,
     "gather's indices must be integers"),
    ("if-branches", program("let s = if true then 1.0 else false\n" + OK_ENCODE), DslTypeError,
     2, 13, "'then' and 'else' differ"),
    ("code-after-return", program(OK_ENCODE + "let z = 1\n"), DslTypeError, 4, 5,
     "code after return is never run"),
    ("extract-in-encode", program("let a, b = extract(g)\n" + OK_ENCODE), DslTypeError, 2, 16,
     "extract can only be used in decode"),
    ("float-overflow", "param eps: f32 = 1e400\n" + program(OK_ENCODE), DslTypeError, 1, 18,
     "float literal out of the f32 range"),
    ("float-overflow-f32", program("let s = -4e38\n" + OK_ENCODE), DslTypeError, 2, 14,
     "float literal out of the f32 range"),
    ("expand-not-blocks", program("let e = map(g, expand(g), (x, y) -> x + y)\n" + OK_ENCODE),
     DslTypeError, 2, 27, "expand takes one value per block"),
    ("block-negative", program("let m = reduce(g, max, block=-3)\n" + OK_ENCODE), DslTypeError,
     2, 34, "block= must be in 0..4294967295"),
    ("block-not-integer", program("let m = reduce(g, max, block=2.5)\n" + OK_ENCODE),
     DslTypeError, 2, 34, "block= must be a constant integer"),
    ("block-not-constant", program("let m = reduce(g, max, block=size(g))\n" + OK_ENCODE),
     DslTypeError, 2, 34, "must be a constant"),
    ("blocks-with-elements", program("let m = reduce(g, max, block=4)\n"
                                     "let e = map(m, g, (x, y) -> x + y)\n" + OK_ENCODE),
     DslTypeError, 3, 13, "arrays of different lengths (ceil(n / 4) and n)"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_error_position_and_message(case):
    _, source, cls, line, column, fragment = case
    with pytest.raises(cls) as info:
        load_source(source, "algo.cll")
    err = info.value
    assert isinstance(err, CompileError)
    assert fragment in err.message, str(err)
    assert (err.line, err.column) == (line, column), str(err)
    if line is not None:
        assert str(err).startswith(f"algo.cll:{line}:{column}: ")
        assert str(err).splitlines()[-1].strip() == "^"


def test_at_least_fifteen_distinct_errors():
    assert len({c[5] for c in CASES}) >= 15


def test_errors_survive_pickling():
    with pytest.raises(CompileError) as info:
        load_source(program("let s = nope\n" + OK_ENCODE), "x.cll")
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is type(info.value)
    assert str(clone) == str(info.value)
    assert (clone.line, clone.column) == (info.value.line, info.value.column)


def test_failed_require_is_a_config_error():
    src = 'param k: u32 = 3\nrequire k < 3, "k must be below 3"\n' + program(OK_ENCODE)
    with pytest.raises(ConfigError, match="k must be below 3"):
        load_source(src, "x.cll")
    assert load_source(src, "x.cll", params={"k": 2}).param("k") == 2


def test_unknown_and_mistyped_parameters():
    src = "param k: u32 = 3\n" + program(OK_ENCODE)
    with pytest.raises(ConfigError, match="unknown parameter.*ratio.*takes: k"):
        load_source(src, "x.cll", params={"ratio": 0.1})
    with pytest.raises(ConfigError, match="integer"):
        load_source(src, "x.cll", params={"k": 0.5})
    with pytest.raises(ConfigError, match="out of the u32 range"):
        load_source(src, "x.cll", params={"k": -1})


def test_names_cannot_shadow_builtins_or_params():
    with pytest.raises(DslTypeError, match="builtin"):
        load_source(program("let abs = 1\n" + OK_ENCODE), "x.cll")
    with pytest.raises(DslTypeError, match="already defined"):
        load_source("param s: f32 = 1.0\n" + program(OK_ENCODE), "x.cll")
