"""Hugging Face Accelerate: one line after ``accelerator.prepare``.

    model, opt, data = accelerator.prepare(model, opt, data)
    hipress.torch.accelerate.compress(accelerator, model)

A DDP model (``DistributedType.MULTI_CPU``/``MULTI_GPU``) gets HiPress's communication
hook; a model under FSDP2 (``fully_shard``; Accelerate's FSDP plugin, version 2) gets
``compress_fsdp``. Accelerate's own ``DistributedDataParallelKwargs(comm_hook=...)`` takes
only its enum of torch's hooks, so it cannot carry this one. The state is registered with
``accelerator.register_for_checkpointing`` (every rank's in the one file rank 0 writes),
so ``save_state``/``load_state`` carry it with no more code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from hipress.errors import ConfigError

from .fsdp import FSDPState, compress_fsdp
from .hooks import HookState, comm_hook
from .state import AllRanksState

__all__ = ["compress"]


def compress(accelerator: Any, model: torch.nn.Module, **options: Any
             ) -> HookState | FSDPState:
    """Compress ``model``'s gradient synchronization and checkpoint its state with
    ``accelerator``'s.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: what ``accelerator.prepare`` returned for the model (DDP, or FSDP2).
        **options: ``HookState``'s (DDP) or ``compress_fsdp``'s (FSDP2) settings;
            nothing: HiPress's defaults.

    Returns:
        The ``HookState`` or ``FSDPState`` in use (its ``bytes_sent``, ``trace``...).

    Raises:
        ConfigError: a model Accelerate did not distribute (one process: nothing to
            synchronize), or a bad setting.

    Example:
        >>> model, opt = accelerator.prepare(model, opt)
        >>> hp.accelerate.compress(accelerator, model, algorithm="dgc", ratio=0.01)
    """
    state: HookState | FSDPState
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        state = HookState(**options)
        model.register_comm_hook(state, comm_hook)
    elif isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule)
                                              for m in model.modules()):
        state = compress_fsdp(model, **options)
    else:
        raise ConfigError(f"hipress.torch.accelerate.compress: the model is a "
                          f"{type(model).__name__}, not one Accelerate distributed (DDP or "
                          "FSDP2); call it after accelerator.prepare in a job of several "
                          "processes")
    accelerator.register_for_checkpointing(AllRanksState(state))
    return state
