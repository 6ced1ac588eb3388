"""Source positions as errors (``SourceMap``), and the dump of each stage's output for
``HIPRESS_DUMP``. The error classes live on the ground floor (``hipress_base.errors``)."""

from __future__ import annotations

import os
import sys
from pprint import pformat
from typing import Any

from hipress_base.errors import (
    BuildError,
    CompileError,
    DslSyntaxError,
    DslTypeError,
    LayoutError,
)

from .ir import Pos

__all__ = [
    "CompileError", "DslSyntaxError", "DslTypeError", "LayoutError", "BuildError",
    "SourceMap", "dump_stage",
]


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


def dump_stage(stage: str, value: Any) -> None:
    """Print a stage's output to stderr when ``HIPRESS_DUMP`` names it (or is ``all``)."""
    wanted = os.environ.get("HIPRESS_DUMP", "")
    if stage in wanted.split(",") or wanted == "all":
        text = value if isinstance(value, str) else pformat(value, width=100)
        print(f"--- compll {stage} ---\n{text}", file=sys.stderr)
