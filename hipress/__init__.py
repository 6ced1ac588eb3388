"""HiPress: compression-aware gradient synchronization for data-parallel training.

    import hipress
    c = hipress.codec("terngrad", seed=0)
    y = c.decode(c.encode(x), len(x))

The facade on top of the layers: the compiler (``compll``: ``codec``, ``algorithms``,
``Codec``), the engine (``casync``) and the plugins. Importing ``hipress`` (or
``hipress.errors``) loads neither: ``codec``, ``algorithms`` and ``Codec`` come from
``compll`` when first used.
"""

from typing import Any

from ._version import __version__
from .errors import CompileError, ConfigError, HiPressError, PayloadError, SyncError

__all__ = [
    "Codec", "algorithms", "codec", "threads",
    "HiPressError", "CompileError", "ConfigError", "PayloadError", "SyncError",
    "__version__",
]

_FROM_COMPLL = ("Codec", "algorithms", "codec", "threads")


def __getattr__(name: str) -> Any:
    """``codec``, ``algorithms``, ``Codec`` and ``threads`` (the CPU kernels' thread count
    and why, ``compll.parallelism``), from the compiler on first use (PEP 562): a script
    that only needs the errors or the plugins' core does not build it."""
    if name in _FROM_COMPLL:
        import compll

        value = getattr(compll, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hipress' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM_COMPLL])
