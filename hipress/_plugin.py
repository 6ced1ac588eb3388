"""Helpers shared by the framework plugins."""

from __future__ import annotations

import importlib
from types import ModuleType

from hipress.errors import ConfigError


def require_framework(module: str, label: str, install_hint: str) -> ModuleType:
    """Import a framework or raise a ConfigError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"hipress.{label} needs {module}, which is not importable here ({exc}); "
            f"install it with: {install_hint}"
        ) from exc
