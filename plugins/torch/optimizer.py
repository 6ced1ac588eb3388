"""``DistributedOptimizer``: synchronize gradients during backward, without DDP."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from casync.plan import MIN_COMPRESS
from hipress import distributed as core
from hipress.errors import ConfigError

from .internals import at_backward_end
from .state import plain

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the user's optimizer class (Horovod's pattern)."""

    def __init__(self, params: Any, named_parameters: list[tuple[str, torch.Tensor]],
                 backward_passes_per_step: int, options: core.EngineOptions) -> None:
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]
        if isinstance(backward_passes_per_step, bool) \
                or not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ConfigError(f"backward_passes_per_step must be an integer >= 1, not "
                              f"{backward_passes_per_step!r}")
        self._passes = backward_passes_per_step
        names = [name for name, _ in named_parameters]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"named_parameters has duplicate names {dups}; pass "
                             "model.named_parameters() so every parameter has its own name")
        self._names = {p: name for name, p in named_parameters}
        unnamed = [p for g in self.param_groups for p in g["params"] if p not in self._names]
        if unnamed:
            raise ConfigError(f"{len(unnamed)} optimized parameters are missing from "
                             "named_parameters; pass model.named_parameters() for the same "
                             "model the optimizer updates")
        self._sync = options.engine()
        self._counts: dict[torch.Tensor, int] = {}
        self._submitted: set[torch.Tensor] = set()  # in flight in the engine
        self._averaged: set[torch.Tensor] = set()  # hold the average, until step/zero_grad
        self._queued = False  # the end-of-backward synchronization is queued
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for g in self.param_groups for p in g["params"] if p.requires_grad]

    def remove_hooks(self) -> None:
        """Stop averaging: backward leaves gradients local from now on (torchft's
        ``LocalSGD`` removes its hooks on exit alike). ``step``, ``zero_grad`` and the
        state keep working; the engine stays for ``state_dict``."""
        if self._submitted:
            raise ConfigError("remove_hooks() came while gradients were being averaged; "
                              "call it after optimizer.step()")
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._counts.clear()

    def _on_grad(self, p: torch.Tensor) -> None:
        if p in self._submitted or p in self._averaged:
            raise ConfigError(
                f"the gradient of {self._names[p]!r} was computed more than "
                f"backward_passes_per_step={self._passes} times before optimizer.step() "
                "or zero_grad(); call step() after every backward_passes_per_step backward "
                "passes, or raise backward_passes_per_step")
        self._counts[p] = self._counts.get(p, 0) + 1
        if self._counts[p] == self._passes:
            self._submitted.add(p)
            assert p.grad is not None
            if not self._queued:
                # Averages land before backward() returns, as with DDP: a GradScaler's
                # unscale_/step and clip_grad_norm_ then read the same gradients on every
                # rank (a rank that skipped step() for an overflow its peers did not see
                # would leave them waiting).
                self._queued = True
                at_backward_end(self._end_backward)
            self._sync.submit(self._names[p], p.grad)

    def _end_backward(self) -> None:
        self._queued = False
        self.synchronize()

    def synchronize(self) -> None:
        """Wait until every submitted gradient holds the average over ranks. Backward
        calls it when it ends; calling it again does nothing."""
        self._sync.synchronize()
        self._averaged |= self._submitted
        self._counts.clear()
        self._submitted.clear()

    def step(self, closure: Any = None) -> Any:
        if self._submitted or self._counts:
            if any(c < self._passes for p, c in self._counts.items()
                   if p not in self._submitted):
                raise ConfigError(
                    f"optimizer.step() came after fewer than backward_passes_per_step="
                    f"{self._passes} backward passes; call it once every "
                    f"{self._passes} passes")
            self.synchronize()
        result = super(self.__class__, self).step(closure)
        self._averaged.clear()
        return result

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state, with HiPress's (residuals, step, plan) under
        ``"hipress"``: ``torch.save(opt.state_dict())`` keeps both. Each rank saves its own."""
        state = super(self.__class__, self).state_dict()
        state["hipress"] = plain(self._sync.state_dict())
        return state

    def load_state_dict(self, state_dict: dict[str, Any], reset_residuals: bool = False) -> None:
        """Load both parts of ``state_dict()``; HiPress's must come from the same rank of a
        job of the same size (see ``casync.Synchronizer.load_state_dict``)."""
        state = dict(state_dict)
        hipress_state = state.pop("hipress", None)
        super(self.__class__, self).load_state_dict(state)
        if hipress_state:
            self._sync.load_state_dict(hipress_state, reset_residuals)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._submitted:
            raise ConfigError(
                "optimizer.zero_grad() was called while gradients were still being "
                "synchronized (inside backward, or after a backward whose synchronization "
                "failed); call it before backward() or after step()")
        super(self.__class__, self).zero_grad(set_to_none)
        self._averaged.clear()  # a step GradScaler skipped ends here


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         algorithm: str | None = None, backward_passes_per_step: int = 1,
                         topology: str = "ps", error_feedback: bool | None = None,
                         min_compress: int = MIN_COMPRESS, timeout: float | None = None,
                         plan: str = "static", guard: bool = True,
                         **codec_params: Any) -> torch.optim.Optimizer:
    """Wrap an optimizer so gradients are averaged across ranks as backward produces them.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its class and hyper-parameters are kept.
        named_parameters: ``model.named_parameters()``; names key error feedback and
            must match across ranks.
        algorithm: a CompLL algorithm or ``"none"``; default ``HIPRESS_ALGORITHM``, else
            HiPress's default (``casync.plan.DEFAULT_ALGORITHM``).
        backward_passes_per_step: local gradient accumulation before each sync.
        min_compress: gradients (or buckets of small ones) under this many elements go
            through a plain allreduce.
        plan: ``"static"`` (``topology`` and ``min_compress``) or ``"auto"`` (the
            cost-model planner on costs profiled once on this group).
        guard: the engine's rules on top of the plan (``casync.guard``): the first steps
            uncompressed, row-sparse gradients (embeddings) never compressed.
        topology, error_feedback, timeout, **codec_params: as for ``casync.Synchronizer``.

    Returns:
        An optimizer of a subclass of ``type(optimizer)``. Gradients are submitted as
        backward produces them, and hold the average over ranks when ``backward()``
        returns (as with DDP), so ``torch.amp.GradScaler`` (``scaler.step(opt)``, with or
        without ``scaler.unscale_(opt)``) and ``clip_grad_norm_`` work unchanged: a NaN or
        an Inf on any rank reaches every rank, which all skip the step together.

    Example:
        >>> opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                               named_parameters=model.named_parameters(),
        ...                               algorithm="dgc", ratio=0.01)
    """
    if named_parameters is None:
        named = [(f"param.{i}.{j}", p) for i, g in enumerate(optimizer.param_groups)
                 for j, p in enumerate(g["params"])]
    else:
        named = list(named_parameters)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    options = core.EngineOptions(algorithm, plan, topology, min_compress, error_feedback,
                                 timeout, guard=guard, **codec_params)
    return cls(optimizer.param_groups, named, backward_passes_per_step, options)
