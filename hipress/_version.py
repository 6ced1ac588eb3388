"""HiPress's version, as the facade shows it (``hipress.__version__``); defined on the ground
floor (``hipress_base.version``), which every layer reads."""

from hipress_base.version import __version__

__all__ = ["__version__"]
