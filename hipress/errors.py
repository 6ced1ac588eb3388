"""The errors a user can catch, every one a ``HiPressError`` (defined on the ground floor,
``hipress_base.errors``, so that ``compll`` and ``casync`` raise them without importing the
facade; each names this module as its own).

Example:
    >>> try:
    ...     hipress.codec("onebit").decode(b"junk", 10)
    ... except hipress.errors.PayloadError as exc:
    ...     print(exc)
"""

from hipress_base.errors import (
    BuildError,
    CompileError,
    ConfigError,
    DslSyntaxError,
    DslTypeError,
    HiPressError,
    LayoutError,
    PayloadError,
    SyncError,
)

__all__ = ["HiPressError", "CompileError", "DslSyntaxError", "DslTypeError", "LayoutError",
           "BuildError", "PayloadError", "SyncError", "ConfigError"]
