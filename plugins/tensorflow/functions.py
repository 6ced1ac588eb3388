"""Broadcasts of TensorFlow variables through the shared core."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from hipress import distributed as core

__all__ = ["broadcast_variables"]


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> None:
    """Assign ``root_rank``'s values to ``variables`` (``tf.Variable`` or Keras variables)
    on every rank, in order.

    Example:
        >>> hp.broadcast_variables(model.variables, root_rank=0)
    """
    if not core.is_initialized():
        core.init()
    variables = list(variables)
    arrays = [np.array(v.numpy(), order="C", copy=True) for v in variables]
    core.broadcast_arrays([a.reshape(-1).view(np.uint8) for a in arrays], root_rank)
    for v, a in zip(variables, arrays, strict=True):
        v.assign(a)
