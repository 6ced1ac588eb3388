"""Hugging Face ``transformers.Trainer``: one line before ``trainer.train()``.

    trainer = Trainer(model=model, args=args, train_dataset=data)
    hipress.torch.transformers.compress(trainer)
    trainer.train()                  # or train(resume_from_checkpoint=True)

No ``TrainingArguments`` field takes a communication hook, so a callback installs it when
training begins, on the model the Trainer wrapped (DDP's hook; ``compress_fsdp`` for a
model under FSDP2). Trainer checkpoints hold no per-rank objects of a callback's, so the
callback writes every rank's HiPress state as ``hipress.pt`` into each checkpoint folder
the Trainer saves (from rank 0) and, when training resumes at a saved step, each rank
takes its own back from that folder (loaded with ``weights_only=True``).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from hipress.errors import ConfigError

from .fsdp import FSDPState, compress_fsdp
from .hooks import HookState, comm_hook
from .state import AllRanksState

__all__ = ["compress", "HiPressCallback", "FILENAME"]

#: HiPress's file in a Trainer checkpoint folder
FILENAME = "hipress.pt"


class HiPressCallback(TrainerCallback):
    """Installs HiPress on ``trainer``'s wrapped model when training begins and carries
    its state in the Trainer's checkpoints (``compress`` adds it).

    Args:
        trainer: the ``transformers.Trainer``.
        **options: ``HookState``'s (DDP) or ``compress_fsdp``'s (FSDP2) settings.

    Attributes:
        state: the ``HookState`` or ``FSDPState`` in use once training began.
    """

    def __init__(self, trainer: Any, **options: Any) -> None:
        self.trainer = trainer
        self.options = options
        self.state: HookState | FSDPState | None = None
        self._wrapped: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wrapped = self.trainer.model_wrapped
        if wrapped is not self._wrapped:  # a new wrapper (a new train()): a new hook
            if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
                self.state = HookState(**self.options)
                wrapped.register_comm_hook(self.state, comm_hook)
            elif any(isinstance(m, FSDPModule) for m in self.trainer.model.modules()):
                self.state = compress_fsdp(self.trainer.model, **self.options)
            else:
                raise ConfigError(f"hipress.torch.transformers: the Trainer trains a "
                                  f"{type(wrapped).__name__}, not a DDP or FSDP2 model; "
                                  "launch several processes (torchrun, accelerate launch)")
            self._wrapped = wrapped
        if state.global_step > 0:
            self._resume(args, state.global_step)

    def _resume(self, args: Any, step: int) -> None:
        """Each rank's own state from the checkpoint the Trainer resumed from."""
        folders = [os.path.join(args.output_dir, f"checkpoint-{step}")]
        if isinstance(args.resume_from_checkpoint, str):
            folders.insert(0, args.resume_from_checkpoint)
        for folder in folders:
            path = os.path.join(folder, FILENAME)
            if os.path.exists(path):
                AllRanksState(self.state).load_state_dict(torch.load(path, weights_only=True))
                return
        warnings.warn(f"training resumes at step {step} without HiPress's state (no "
                      f"{FILENAME} in {' or '.join(folders)}): the residuals start afresh",
                      stacklevel=2)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None:
            return
        gathered = AllRanksState(self.state).state_dict()  # every rank takes part
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(gathered, os.path.join(folder, FILENAME))


def compress(trainer: Any, **options: Any) -> HiPressCallback:
    """Compress ``trainer``'s gradient synchronization from its next ``train()`` on.

    Args:
        trainer: the ``transformers.Trainer``.
        **options: ``HookState``'s (DDP) or ``compress_fsdp``'s (FSDP2) settings;
            nothing: HiPress's defaults.

    Returns:
        The callback (its ``state`` is the ``HookState`` in use once training began).

    Example:
        >>> hp.transformers.compress(trainer, algorithm="cgx", bits=4)
    """
    callback = HiPressCallback(trainer, **options)
    trainer.add_callback(callback)
    return callback
