"""Every private torch symbol HiPress uses, in one place.

torch offers no public way to do these; each is named in ``PRIVATE``, and
``tests/test_torch_internals.py`` resolves every name there, so an upgrade that moves one
fails that test loudly instead of failing a user's training in the middle.

- FSDP2's communication interfaces, ``ReduceScatter`` and ``AllGather``: what
  ``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather`` (public) take. torch
  documents them there but exports them from no public module.
- ``queue_callback`` of autograd's engine: run a function once the backward in progress
  has ended (DDP does the same in C++); the gradients of a step are then all averaged
  before ``backward()`` returns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

__all__ = ["AllGather", "ReduceScatter", "at_backward_end", "PRIVATE", "resolve"]

#: The private symbols, by dotted path (module, then attributes).
PRIVATE = (
    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
    "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather",
    "torch.autograd.Variable._execution_engine.queue_callback",
)


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass in progress ends (from inside it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def resolve(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)
