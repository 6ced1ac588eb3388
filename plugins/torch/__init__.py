"""HiPress for PyTorch (``import hipress.torch as hp``).

The plugin API (``init``, ``HookState``, ``comm_hook``, ``DistributedOptimizer``) is
built on top of CaSync; this module checks that PyTorch itself is importable.
"""

from hipress._plugin import require_framework

torch = require_framework("torch", "torch", "pip install 'torch==2.13.*'")

__all__: list[str] = []
