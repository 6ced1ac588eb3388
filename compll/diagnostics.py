"""CompLL's error classes: one hierarchy under hipress.CompileError."""

from __future__ import annotations

from hipress.errors import CompileError

from .ir import Pos

__all__ = [
    "CompileError", "DslSyntaxError", "DslTypeError", "LayoutError", "BuildError",
    "SourceMap",
]


class DslSyntaxError(CompileError):
    """The source does not parse."""


class DslTypeError(CompileError):
    """A program parses but is ill-typed or uses an operator wrongly."""


class LayoutError(CompileError):
    """``encode`` and ``decode`` disagree on the payload layout."""


class BuildError(CompileError):
    """A generated kernel failed to compile or load."""


class SourceMap:
    """Turns IR positions into errors that show the file, line, column and a caret."""

    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.lines = source.splitlines()

    def error(self, cls: type[CompileError], message: str, pos: Pos | None) -> CompileError:
        if pos is None:
            return cls(message, self.path)
        text = self.lines[pos.line - 1] if 0 < pos.line <= len(self.lines) else None
        return cls(message, self.path, pos.line, pos.column, text)
