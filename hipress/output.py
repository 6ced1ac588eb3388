"""Where ``hipress`` commands print tables: a rich console that keeps every column whole.

On a terminal rich fits a table to the window; written to a file or a pipe (a CI log,
``| tee``), its default of 80 columns cut cells to ``casyn…``. Then the console is as
wide as the widest table needs, up to ``WIDE`` characters.
"""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console

__all__ = ["console", "WIDE"]

#: The width of output that is not a terminal: wide enough for every table HiPress prints.
WIDE = 200


def console(width: int | None = None, **options: Any) -> Console:
    """A rich console: ``width`` (or the window's) on a terminal; ``WIDE`` columns
    otherwise, so no cell is truncated in a log."""
    if sys.stdout.isatty():
        return Console(width=width, **options)
    return Console(width=WIDE, **options)
