"""PyTorch Lightning: one callback.

    trainer = L.Trainer(strategy="ddp", callbacks=[hipress.torch.lightning.HiPress()])

``HiPress`` installs HiPress's communication hook on the model Lightning's DDP strategy
wrapped (on CPU too: ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA devices
only), or ``compress_fsdp`` on a model that ``ModelParallelStrategy`` sharded with FSDP2.
Its state rides in Lightning's checkpoint as the callback's state: every rank's in the
file rank 0 writes, each rank's own back on ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule

from hipress.errors import ConfigError

from .fsdp import FSDPState, compress_fsdp
from .hooks import HookState, comm_hook
from .state import AllRanksState

__all__ = ["HiPress"]


class HiPress(pl.Callback):
    """Compress the gradient synchronization of Lightning's DDP or FSDP2 training.

    Args:
        **options: ``HookState``'s (DDP) or ``compress_fsdp``'s (FSDP2) settings;
            nothing: HiPress's defaults.

    Attributes:
        state: the ``HookState`` or ``FSDPState`` in use once ``fit`` started.

    Example:
        >>> trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
        ...                     callbacks=[HiPress(algorithm="dgc", ratio=0.01)])
    """

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.state: HookState | FSDPState | None = None
        self._saved: dict[str, Any] | None = None  # loaded before fit built the state

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.state is not None:
            return  # a second fit on the same trainer keeps its state
        model = trainer.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.state = HookState(**self.options)
            model.register_comm_hook(self.state, comm_hook)
        elif any(isinstance(m, FSDPModule) for m in pl_module.modules()):
            self.state = compress_fsdp(pl_module, **self.options)
        else:
            raise ConfigError(f"hipress.torch.lightning.HiPress: the strategy "
                              f"{type(trainer.strategy).__name__} gave a "
                              f"{type(model).__name__}; use strategy='ddp' (or FSDP2 "
                              "through ModelParallelStrategy) with several processes")
        if self._saved is not None:
            AllRanksState(self.state).load_state_dict(self._saved)
            self._saved = None

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state (Lightning calls this on every rank; rank 0 writes it)."""
        if self.state is None:
            return {}
        return AllRanksState(self.state).state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep it until ``on_fit_start`` builds the state (Lightning restores callbacks
        before it wraps the model)."""
        if not state_dict:
            return
        if self.state is not None:
            AllRanksState(self.state).load_state_dict(state_dict)
        else:
            self._saved = state_dict
