"""``DistributedTrainer``: a Gluon Trainer that averages gradients with CaSync."""

from __future__ import annotations

from typing import Any

import mxnet as mx

from hipress import distributed as core

from .arrays import stage, write_back

__all__ = ["DistributedTrainer"]


class DistributedTrainer(mx.gluon.Trainer):
    """A ``gluon.Trainer`` whose ``step`` averages gradients over ranks first (Horovod's
    ``DistributedTrainer``): submit every gradient, one engine step, then update.

    Args:
        params, optimizer, optimizer_params: as for ``gluon.Trainer``.
        algorithm, plan, topology, min_compress, error_feedback, timeout, guard, **options:
            see ``hipress.distributed.EngineOptions``.

    Example:
        >>> trainer = hp.DistributedTrainer(net.collect_params(), "sgd",
        ...                                 {"learning_rate": 0.1}, algorithm="dgc")
        >>> trainer.step(batch_size)   # batch size per rank
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: Any = None,
                 algorithm: str | None = None, **options: Any) -> None:
        self._hipress = core.EngineOptions(algorithm, **options)
        self._engine = core.LazyEngine(self._hipress)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)

    def state_dict(self) -> dict[str, Any]:
        """HiPress's state (the engine's residuals, step and plan) for a checkpoint, beside
        ``save_states`` (the optimizer's); each rank saves its own."""
        return self._engine.state_dict()

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()`` (same rank, same world size)."""
        self._engine.load_state_dict(state, reset_residuals)

    def _allreduce_grads(self) -> None:
        engine = self._engine.get()
        staged, named = [], []
        for i, param in enumerate(self._params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            buf, targets = stage(grads, grads)
            staged.append((buf, targets))
            named.append((f"{i}:{param.name}", buf))
        engine.submit_many(named)
        engine.synchronize()
        for buf, targets in staged:
            write_back(buf, targets)
