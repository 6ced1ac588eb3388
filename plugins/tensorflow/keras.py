"""Keras 3: an optimizer wrapper for ``model.fit`` and a broadcast callback."""

from __future__ import annotations

from typing import Any

import keras

from hipress import distributed as core

from .functions import broadcast_variables
from .gradients import Averager, _name

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesCallback"]


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    variables = list(trainable_variables) if trainable_variables is not None \
        else list(self._trainable_variables)
    names = [_name(i, v) for i, v in enumerate(variables)]
    grads = self._hipress_averager.average(list(grads), names)
    return super(self.__class__, self).apply(grads, trainable_variables)


def _state_dict(self: Any) -> dict[str, Any]:
    """HiPress's state (the engine's residuals, step and plan) for a checkpoint, beside
    the optimizer's own variables; each rank saves its own."""
    return self._hipress_averager.state_dict()


def _load_state_dict(self: Any, state: dict[str, Any], reset_residuals: bool = False) -> None:
    """Continue from ``state_dict()`` (same rank, same world size)."""
    self._hipress_averager.load_state_dict(state, reset_residuals)


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer,  # noqa: N802 - Horovod's name
                         algorithm: str | None = None, **options: Any) -> Any:
    """Wrap a Keras optimizer so every ``apply`` first averages the gradients over ranks.

    Returns an optimizer of a subclass of ``type(optimizer)`` with the same
    configuration, for ``model.compile(optimizer=...)``, with ``state_dict()`` and
    ``load_state_dict()`` for HiPress's state in checkpoints. Compile with
    ``jit_compile=False``: XLA cannot compile the step that leaves TensorFlow.

    Mixed precision: the loss scaler must look at averaged gradients, so that a NaN or an
    Inf on one rank makes every rank skip the step. Wrap a ``LossScaleOptimizer`` (its
    ``apply`` then runs after the average), or set the ``mixed_float16`` policy before
    calling this: the optimizer is then wrapped in one here, and ``compile`` does not wrap
    it again (a ``LossScaleOptimizer`` that ``compile`` put around this one would check
    each rank's own gradients).

    Args:
        optimizer: any Keras 3 optimizer.
        algorithm, plan, topology, min_compress, error_feedback, timeout, guard,
            **params: see ``hipress.distributed.EngineOptions``.

    Example:
        >>> opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.05), algorithm="onebit")
        >>> model.compile(optimizer=opt, loss="sparse_categorical_crossentropy",
        ...               jit_compile=False)
    """
    averager = Averager(core.EngineOptions(algorithm, **options))
    scaling = keras.optimizers.LossScaleOptimizer
    if keras.config.dtype_policy().name == "mixed_float16" \
            and not isinstance(optimizer, scaling):
        optimizer = scaling(optimizer)
    cls: Any = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {"apply": _apply, "state_dict": _state_dict, "load_state_dict": _load_state_dict})
    wrapped = cls.from_config(optimizer.get_config())
    wrapped._hipress_averager = averager
    return wrapped


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s weights (and optimizer state, once
    the optimizer has built it)."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._optimizer_done = False

    def on_train_begin(self, logs: Any = None) -> None:
        broadcast_variables(self.model.variables, self.root_rank)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # Optimizer slots exist after the first apply; align them once.
        if not self._optimizer_done and self.model.optimizer is not None:
            broadcast_variables(self.model.optimizer.variables, self.root_rank)
            self._optimizer_done = True
