"""The HiPress error hierarchy (``hipress.PayloadError`` and the rest): every error a user
can catch derives from ``HiPressError``.

The classes live in the leaf module ``hipress_errors``, which imports nothing of the
project, so that the compiler (``compll``) and the engine (``casync``) raise them without
importing the facade above them; this module and ``hipress`` re-export them.
"""

from hipress_errors import CompileError, ConfigError, HiPressError, PayloadError, SyncError

__all__ = ["HiPressError", "CompileError", "PayloadError", "SyncError", "ConfigError"]
