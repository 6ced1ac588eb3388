"""Checkpoint state that loads under torch's defaults.

``torch.load`` unpickles with ``weights_only=True`` by default (torch ≥ 2.6), and so do
Lightning, Accelerate's ``load_state``, Trainer's resume and ``torch.distributed.checkpoint``:
only tensors and plain Python values pass. The engine keeps its residuals as NumPy
arrays (it serves TensorFlow and MXNet too), so every ``state_dict()`` of this plugin goes
through ``plain`` on its way out; loading takes either form (``numpy.asarray`` reads a
CPU tensor without a copy), so checkpoints written before load as they did.

Each rank's state is its own (its residuals). Where a trainer writes one file from rank
0, ``AllRanksState`` gathers every rank's into it and gives each rank its own back.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hipress import distributed as core
from hipress.errors import ConfigError

__all__ = ["plain", "AllRanksState"]


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


class AllRanksState:
    """Every rank's HiPress state in one checkpoint, for trainers that save rank 0's file
    only (Lightning, Accelerate, Trainer): ``state_dict()`` gathers each rank's
    ``obj.state_dict()`` to every rank (a collective: every rank calls it, as those
    trainers do), ``load_state_dict()`` restores this rank's own from the shared file.

    Args:
        obj: anything with ``state_dict``/``load_state_dict`` whose state is per rank
            (``HookState``, ``FSDPState``, ``DiLoCo``, ``DistributedOptimizer``).
        group: the ranks that share the file (default HiPress's Gloo group: the state is
            gathered through host memory, as it lives there).

    Example:
        >>> accelerator.register_for_checkpointing(hp.AllRanksState(hook_state))
    """

    FORMAT = "hipress.all-ranks/1"

    def __init__(self, obj: Any, group: Any = None) -> None:
        self.obj = obj
        self.group = group

    def _group(self) -> Any:
        if self.group is not None:
            return self.group
        if not core.is_initialized():  # the trainer made the process group
            core.init()
        return core.gloo_group()

    def state_dict(self) -> dict[str, Any]:
        mine = plain(self.obj.state_dict())
        group = self._group()
        states: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(states, mine, group=group)
        return {"format": self.FORMAT, "world": len(states), "ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's part of ``state``; a per-rank state (not gathered) loads as is."""
        if not isinstance(state, dict) or state.get("format") != self.FORMAT:
            self.obj.load_state_dict(state)
            return
        group = self._group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if state["world"] != world:
            raise ConfigError(f"the checkpoint holds the HiPress states of {state['world']} "
                              f"ranks, this job has {world} (field 'world size'): start "
                              f"{state['world']} ranks")
        self.obj.load_state_dict(state["ranks"][rank])
