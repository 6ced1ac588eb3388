"""HiPress for MXNet (``import hipress.mxnet as hp``).

This module checks that MXNet is importable; it runs in its own virtual
environment (``.venv-mx``) because MXNet 1.9.1 imports only with NumPy 1.23.5.
"""

from hipress._plugin import require_framework

mx = require_framework("mxnet", "mxnet", "pip install 'hipress[mxnet]' (NumPy 1.23.5 only)")

__all__: list[str] = []
