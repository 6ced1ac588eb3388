"""A Gluon KVStore that synchronizes with CaSync: ``Trainer(..., kvstore=hp.KVStore())``."""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from hipress import distributed as core
from hipress.errors import ConfigError

from .arrays import stage, write_back

__all__ = ["KVStore"]


@mx.kv.KVStoreBase.register
class HiPress(mx.kv.KVStoreBase):
    """MXNet's KVStore interface over the HiPress engine (registered as ``"hipress"``).

    ``pushpull`` sums a key's values over all ranks (as MXNet's ``dist_sync`` and
    Horovod KVStores do: pass the global batch size to ``trainer.step``, or use
    ``hp.DistributedTrainer``, which averages). The optimizer stays on the workers
    (``is_capable("optimizer")`` is False), so Gluon calls ``pushpull`` per gradient.

    The first step synchronizes each key as it comes and learns the order in which the
    trainer pushes them; from the second step on, the keys are batched into one engine
    step that runs when the last key of the step arrives.

    Args:
        algorithm, plan, topology, min_compress, error_feedback, timeout, guard, **params:
            see ``hipress.distributed.EngineOptions``.
    """

    def __init__(self, algorithm: str | None = None, **options: Any) -> None:
        self.options = core.EngineOptions(algorithm, **options)
        if not core.is_initialized():
            core.init()
        self._engine = core.LazyEngine(self.options)
        self._order: list[Any] = []      # keys of one step, learned in the first
        self._learning = True
        self._pending: list[tuple[Any, Any, list[mx.nd.NDArray]]] = []

    # -- the KVStoreBase interface -----------------------------------------------------

    @property
    def type(self) -> str:
        return "hipress"

    @property
    def rank(self) -> int:
        return core.rank()

    @property
    def num_workers(self) -> int:
        return core.size()

    @staticmethod
    def is_capable(capability: str) -> bool:
        if capability.lower() == mx.kv.KVStoreBase.OPTIMIZER:
            return False
        raise ConfigError(f"unknown KVStore capability {capability!r}")

    def broadcast(self, key: Any, value: mx.nd.NDArray, out: Any, priority: int = 0) -> None:
        """Rank 0's ``value`` into every array of ``out`` on every rank."""
        buf = value.asnumpy().copy()
        core.broadcast_arrays([buf.reshape(-1).view(np.uint8)], 0)
        for o in out if isinstance(out, list) else [out]:
            o[:] = buf

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """Sum ``value`` (an NDArray or one per device) over ranks into ``out`` (default
        ``value``)."""
        values = value if isinstance(value, list) else [value]
        outs = values if out is None else (out if isinstance(out, list) else [out])
        if self._learning and key in self._order:
            self._learning = False  # a key came back: one step's order is known
        if self._learning:
            self._order.append(key)
            self._pending.append(self._stage(key, values, outs))
            self._run()
            return
        if key not in self._order:
            self._run()
            self._pending.append(self._stage(key, values, outs))
            self._run()
            return
        self._pending.append(self._stage(key, values, outs))
        if key == self._order[-1]:
            self._run()

    def state_dict(self) -> dict[str, Any]:
        """HiPress's state for a checkpoint: the engine's residuals, step and plan, and the
        order of a step's keys learned in the first step. Each rank saves its own."""
        return {"engine": self._engine.state_dict(), "order": list(self._order),
                "learning": self._learning}

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()`` (same rank, same world size)."""
        self._engine.load_state_dict(state.get("engine", {}), reset_residuals)
        self._order = list(state.get("order", []))
        self._learning = bool(state.get("learning", True))

    def set_optimizer(self, optimizer: Any) -> None:
        raise NotImplementedError("the HiPress KVStore keeps the optimizer on the workers; "
                                  "create the Trainer with update_on_kvstore=False")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        raise NotImplementedError("the optimizer lives in the Trainer: use "
                                  "trainer.save_states(fname)")

    def load_optimizer_states(self, fname: str) -> None:
        raise NotImplementedError("the optimizer lives in the Trainer: use "
                                  "trainer.load_states(fname)")

    # -- batching ----------------------------------------------------------------------

    def _stage(self, key: Any, values: list[mx.nd.NDArray],
               outs: list[mx.nd.NDArray]) -> tuple[Any, Any, list[mx.nd.NDArray]]:
        return (key, *stage(values, outs))

    def _run(self) -> None:
        """Synchronize the pending keys in one engine step and write the sums out."""
        if not self._pending:
            return
        engine = self._engine.get()
        pending, self._pending = self._pending, []
        engine.submit_many((str(key), buf) for key, buf, _ in pending)
        engine.synchronize()
        world = float(core.size())
        for _, buf, targets in pending:
            buf *= world  # the engine averages; a KVStore sums
            write_back(buf, targets)


KVStore = HiPress
