"""HiPress: compression-aware gradient synchronization for data-parallel training.

    import hipress
    c = hipress.codec("terngrad", seed=0)
    y = c.decode(c.encode(x), len(x))
"""

from .errors import CompileError, ConfigError, HiPressError, PayloadError, SyncError  # noqa: I001
from .codec import Codec, algorithms, codec

__version__ = "0.1.0"

__all__ = [
    "Codec", "algorithms", "codec",
    "HiPressError", "CompileError", "ConfigError", "PayloadError", "SyncError",
    "__version__",
]
