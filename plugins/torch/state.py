"""Checkpoint state that loads under torch's defaults.

``torch.load`` unpickles with ``weights_only=True`` by default (torch ≥ 2.6), and so do
Lightning, Accelerate's ``load_state``, Trainer's resume and ``torch.distributed.checkpoint``:
only tensors and plain Python values pass. The engine keeps its residuals as NumPy
arrays (it serves TensorFlow and MXNet too), so every ``state_dict()`` of this plugin goes
through ``plain`` on its way out; loading takes either form (``numpy.asarray`` reads a
CPU tensor without a copy), so checkpoints written before load as they did.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["plain"]


def plain(value: Any) -> Any:
    """``value`` with every NumPy array made a CPU tensor (sharing its memory) and every
    NumPy scalar a Python one, through dicts, lists and tuples.

    Example:
        >>> plain({"r": np.zeros(2, np.float32), "n": np.int64(3)})
        {'r': tensor([0., 0.]), 'n': 3}
    """
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value
