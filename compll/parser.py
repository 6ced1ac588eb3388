"""Source text to IR: the lark grammar plus one transformer."""

from __future__ import annotations

import functools
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken
from lark.indenter import Indenter

from . import ir
from .diagnostics import DslSyntaxError, SourceMap

__all__ = ["parse"]

_TOKEN_NAMES = {
    "_NL": "end of line", "_INDENT": "indented block", "_DEDENT": "end of block",
    "NAME": "name", "INT": "integer", "FLOAT": "number", "STRING": "string",
    "LPAR": "'('", "RPAR": "')'", "COMMA": "','", "COLON": "':'", "EQUAL": "'='",
    "LSQB": "'['", "RSQB": "']'", "$END": "end of file", "MINUS": "'-'", "ADD_OP": "'+' or '-'",
    "MUL_OP": "'*', '/' or '%'", "COMP_OP": "a comparison", "RARROW": "'->'", "IF": "'if'",
    "TRUE": "'true'", "FALSE": "'false'", "NOT": "'not'", "LET": "'let'", "RETURN": "'return'",
}


class _Indent(Indenter):
    NL_type = "_NL"
    OPEN_PAREN_types = ["LPAR", "LSQB"]
    CLOSE_PAREN_types = ["RPAR", "RSQB"]
    INDENT_type = "_INDENT"
    DEDENT_type = "_DEDENT"
    tab_len = 4


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    grammar = (Path(__file__).parent / "grammar.lark").read_text()
    return Lark(
        grammar, parser="lalr", postlex=_Indent(), propagate_positions=True,
        maybe_placeholders=True,
    )


def _pos(meta_or_token) -> ir.Pos:
    return ir.Pos(meta_or_token.line, meta_or_token.column)


@v_args(meta=True)
class _ToIR(Transformer):
    """Turns lark's parse tree into IR nodes (all untyped)."""

    def start(self, meta, items):
        return [item for item in items if item is not None]

    def param_decl(self, meta, children):
        name, ty, default = children
        return ir.Param(str(name), ty, default, _pos(name))

    def require_decl(self, meta, children):
        cond, message = children
        return ir.Require(cond, str(message)[1:-1], _pos(meta))

    def unbiased_decl(self, meta, children):
        return ir.Unbiased(_pos(meta))

    def func_def(self, meta, children):
        name = children[0]
        args = [c for c in children[1:] if isinstance(c, tuple)]
        rest = [c for c in children[1:] if c is not None and not isinstance(c, tuple)]
        returns, body = rest[0], tuple(rest[1:])
        return ir.Function(
            str(name), tuple((a[1], a[2]) for a in args), returns, body, _pos(name)
        )

    def arg(self, meta, children):
        name, ty = children
        return ("arg", str(name), ty)

    def let_stmt(self, meta, children):
        *bindings, value = children
        return ir.Let(
            tuple(b[0] for b in bindings),
            tuple(b[1] for b in bindings),
            value,
            _pos(meta),
            tuple(b[2] for b in bindings),
        )

    def binding(self, meta, children):
        name, ty = children
        return (str(name), ty, _pos(name))

    def return_stmt(self, meta, children):
        return ir.Return(children[0], _pos(meta))

    def type(self, meta, children):
        (name,) = children
        return ir.Type(ir.TypeKind.NAMED, str(name))

    def array_type(self, meta, children):
        name, length = children
        if length is None:
            size = ir.Length(ir.LengthKind.SYM, name="?")
        elif isinstance(length, Token) and length.type == "INT":
            size = ir.Length(ir.LengthKind.CONST, int(str(length), 0))
        else:
            size = ir.Length(ir.LengthKind.SYM, name=str(length))
        return ir.Type(ir.TypeKind.NAMED_ARRAY, str(name), size)

    def lambda_(self, meta, children):
        name, body = children
        return ir.Lambda((str(name),), body, _pos(meta))

    def lambda_multi(self, meta, children):
        *names, body = children
        return ir.Lambda(tuple(str(n) for n in names), body, _pos(meta))

    def select(self, meta, children):
        cond, then, other = children
        return ir.Select(cond, then, other, _pos(meta))

    def or_op(self, meta, children):
        return ir.Binary("or", children[0], children[1], _pos(meta))

    def and_op(self, meta, children):
        return ir.Binary("and", children[0], children[1], _pos(meta))

    def not_op(self, meta, children):
        return ir.Unary("not", children[0], _pos(meta))

    def binop(self, meta, children):
        left, op, right = children
        return ir.Binary(str(op), left, right, _pos(op))

    def neg(self, meta, children):
        return ir.Unary("-", children[0], _pos(meta))

    def int_lit(self, meta, children):
        return ir.Const(int(str(children[0]), 0), _pos(meta))

    def float_lit(self, meta, children):
        return ir.Const(float(str(children[0])), _pos(meta))

    def true_lit(self, meta, children):
        return ir.Const(True, _pos(meta))

    def false_lit(self, meta, children):
        return ir.Const(False, _pos(meta))

    def var(self, meta, children):
        return ir.Var(str(children[0]), _pos(meta))

    def call(self, meta, children):
        name, *arguments = children
        args, kwargs = [], []
        for a in arguments:
            if a is None:
                continue
            if isinstance(a, tuple):
                kwargs.append(a)
            else:
                args.append(a)
        return ir.Call(str(name), tuple(args), tuple(kwargs), _pos(name))

    def kwarg(self, meta, children):
        name, value = children
        return (str(name), value)


# "lambda" is a Python keyword, so the rule's method carries a trailing underscore.
setattr(_ToIR, "lambda", _ToIR.lambda_)


def _describe(token: Token | None) -> str:
    if token is None or token.type == "$END":
        return "end of file"
    if token.type in ("_NL", "_INDENT", "_DEDENT"):
        return _TOKEN_NAMES[token.type]
    return repr(str(token))


def _expected(names) -> str:
    shown = sorted({_TOKEN_NAMES.get(n, repr(n.lower())) for n in names if not n.startswith("__")})
    if len(shown) > 6:
        return ""
    return "; expected " + " or ".join(shown) if shown else ""


def parse(source: str, path: str = "<string>") -> tuple[list, SourceMap]:
    """Parse CompLL source into IR items (``Param``, ``Require``, ``Function``).

    Raises:
        DslSyntaxError: with the file, line, column and a caret excerpt.
    """
    smap = SourceMap(path, source)
    text = source if source.endswith("\n") else source + "\n"
    try:
        tree = _lark().parse(text)
    except UnexpectedCharacters as exc:
        at = exc.pos_in_stream
        char = text[at] if at is not None and at < len(text) else "?"
        raise smap.error(
            DslSyntaxError, f"unexpected character {char!r}", ir.Pos(exc.line, exc.column)
        ) from None
    except UnexpectedToken as exc:
        tok = exc.token
        line = tok.line if tok.line is not None else len(smap.lines)
        column = tok.column if tok.column is not None else 1
        if tok.type == "_DEDENT" or tok.type == "$END":
            line, column = _end_position(smap, tok)
        if tok.type == "_INDENT":  # positioned at the newline; point at the indented text
            line, column = tok.end_line or line, tok.end_column or column
            msg = "unexpected indentation"
        else:
            msg = f"unexpected {_describe(tok)}{_expected(exc.expected)}"
        raise smap.error(DslSyntaxError, msg, ir.Pos(line, column)) from None
    except UnexpectedEOF:
        raise smap.error(
            DslSyntaxError, "unexpected end of file", ir.Pos(len(smap.lines) or 1, 1)
        ) from None
    except UnexpectedInput as exc:  # pragma: no cover - other lark errors
        raise smap.error(DslSyntaxError, str(exc), ir.Pos(exc.line, exc.column)) from None
    except Exception as exc:  # lark's Indenter raises DedentError for bad dedents
        if type(exc).__name__ == "DedentError":
            raise smap.error(DslSyntaxError, "inconsistent indentation", None) from None
        raise
    return _ToIR().transform(tree), smap


def _end_position(smap: SourceMap, tok: Token) -> tuple[int, int]:
    if tok.line is not None and tok.type != "$END":
        return tok.line, tok.column or 1
    last = len(smap.lines) or 1
    return last, len(smap.lines[-1]) + 1 if smap.lines else 1
