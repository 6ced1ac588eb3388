"""HiPress for TensorFlow (``import hipress.tensorflow as hp``).

This module checks that TensorFlow is importable; it runs in its own virtual
environment (``.venv-tf``) because TensorFlow needs NumPy >= 1.26.
"""

from hipress._plugin import require_framework

tf = require_framework("tensorflow", "tensorflow", "pip install 'hipress[tf]'")

__all__: list[str] = []
