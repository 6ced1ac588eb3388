"""The HiPress error hierarchy: every error a user can catch derives from HiPressError.

The ground floor: it imports nothing of the project, so every layer (``compll``,
``casync``, the facade, the plugins) raises these without loading a layer above it. The
facade re-exports them (``hipress.errors``, ``hipress.SyncError``), and each class names
``hipress.errors`` as its module, which is where users and pickles find it.
"""

from __future__ import annotations

__all__ = ["HiPressError", "CompileError", "DslSyntaxError", "DslTypeError", "LayoutError",
           "BuildError", "PayloadError", "SyncError", "ConfigError"]


class HiPressError(Exception):
    """Base class of every error HiPress raises on purpose."""


class CompileError(HiPressError):
    """A DSL program failed to parse, check or build.

    When the error points at source text, ``path``, ``line`` and ``column`` are set
    and ``str(err)`` reads ``file:line:col: message`` followed by the source line
    and a caret.
    """

    def __init__(
        self,
        message: str,
        path: str | None = None,
        line: int | None = None,
        column: int | None = None,
        source_line: str | None = None,
    ) -> None:
        self.message = message
        self.path = path
        self.line = line
        self.column = column
        self.source_line = source_line
        super().__init__(self._format())

    def _format(self) -> str:
        if self.line is None:
            where = f"{self.path}: " if self.path else ""
            return f"{where}{self.message}"
        head = f"{self.path or '<string>'}:{self.line}:{self.column}: {self.message}"
        if self.source_line is None:
            return head
        caret = " " * max((self.column or 1) - 1, 0) + "^"
        return f"{head}\n    {self.source_line.rstrip()}\n    {caret}"

    def __reduce__(self):  # builds may run in other processes: keep every field
        return (
            type(self),
            (self.message, self.path, self.line, self.column, self.source_line),
        )


class DslSyntaxError(CompileError):
    """The source does not parse."""


class DslTypeError(CompileError):
    """A program parses but is ill-typed or uses an operator wrongly."""


class LayoutError(CompileError):
    """``encode`` and ``decode`` disagree on the payload layout."""


class BuildError(CompileError):
    """A generated kernel failed to compile or load."""


class PayloadError(HiPressError, ValueError):
    """A compressed payload is malformed, truncated or belongs to another codec."""


class SyncError(HiPressError, RuntimeError):
    """Gradient synchronization failed: a peer died, stalled or disagreed."""


class ConfigError(HiPressError, ValueError):
    """A setting, parameter or environment variable has an unusable value."""


# Users meet these as hipress.errors.X (tracebacks, reprs, pickles): the facade's module,
# which re-exports every one of them.
for _cls in (HiPressError, CompileError, DslSyntaxError, DslTypeError, LayoutError,
             BuildError, PayloadError, SyncError, ConfigError):
    _cls.__module__ = "hipress.errors"
del _cls
