"""The HiPress error hierarchy: every error a user can catch derives from HiPressError.

A leaf module: it imports nothing of the project, and the ``hipress`` package imports
nothing else eagerly, so every layer (``compll``, ``casync``, the plugins) raises these
without loading the layers above it. Users see them as ``hipress.PayloadError``,
``hipress.errors.SyncError`` and so on.
"""

from __future__ import annotations

__all__ = ["HiPressError", "CompileError", "PayloadError", "SyncError", "ConfigError"]


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


class PayloadError(HiPressError, ValueError):
    """A compressed payload is malformed, truncated or belongs to another codec."""


class SyncError(HiPressError, RuntimeError):
    """Gradient synchronization failed: a peer died, stalled or disagreed."""


class ConfigError(HiPressError, ValueError):
    """A setting, parameter or environment variable has an unusable value."""
