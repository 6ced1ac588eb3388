"""The DDP communication hook: ``ddp.register_comm_hook(HookState(...), comm_hook)``."""

# No "from __future__ import annotations": DDP checks the hook's real annotations.

import time
from typing import Any

import torch
import torch.distributed as dist

from casync import Engine
from casync.plan import MIN_COMPRESS
from hipress import distributed as core
from hipress.breakdown import StepTrace
from hipress.errors import HiPressError

from .internals import at_backward_end
from .state import plain

__all__ = ["HookState", "comm_hook"]



class HookState:
    """What ``comm_hook`` compresses with, and the engine it runs on.

    Args:
        algorithm: a CompLL algorithm (``hipress.algorithms()``) or ``"none"``; default
            ``HIPRESS_ALGORITHM`` (``hipress run --algorithm``), else HiPress's default
            (``casync.plan.DEFAULT_ALGORITHM``).
        plan: ``"static"``: compress buffers of at least ``min_compress`` elements over
            ``topology``; ``"auto"``: choose per tensor from costs profiled on this
            group at start-up (compress or not, topology, partitions).
        topology: ``ps``, ``ring``, ``allgather``, or ``hierarchical``: uncompressed
            inside each node (torchrun's ``LOCAL_WORLD_SIZE``), compressed over ps across
            nodes (``casync.hierarchy``).
        error_feedback: ``None`` = on for biased algorithms.
        min_compress: smaller buckets go through a plain allreduce.
        timeout: seconds before a silent peer raises ``SyncError``.
        trace: record where each step's time goes (``take_trace``; ``hipress bench train
            --breakdown``): the hook's calls, the wait at the end of backward and every
            engine task.
        guard: the engine's rules on top of the plan (``casync.guard``): the first steps
            uncompressed, and gradients that were mostly exact zeros then (embeddings)
            never compressed. ``False``: compress what the plan says from the first step.
        **codec_params: the algorithm's parameters (e.g. ``ratio=0.001`` for dgc).

    Example:
        >>> ddp.register_comm_hook(hp.HookState(algorithm="dgc", ratio=0.01), hp.comm_hook)
    """

    def __init__(self, algorithm: str | None = None, plan: str = "static",
                 topology: str = "ps", error_feedback: bool | None = None,
                 min_compress: int = MIN_COMPRESS, timeout: float | None = None,
                 trace: bool = False, guard: bool = True, **codec_params: Any) -> None:
        # user knobs, validated here (a ConfigError says why)
        self.options = core.EngineOptions(algorithm, plan, topology, min_compress,
                                          error_feedback, timeout, trace=trace, guard=guard,
                                          **codec_params)
        self.algorithm = self.options.algorithm
        self.plan = plan
        self.topology = topology
        # internal state, created on the first bucket (the process group exists by then)
        self._engine = core.LazyEngine(self.options)
        self.sync: Engine | None = None
        self._step_futures: list[torch.futures.Future[Any]] | None = None
        self._error: BaseException | None = None  # the engine did not start this step
        #: a parameter (by identity) -> its name in the engine, in the order DDP first
        #: handed them over: the same in every run, whatever its buckets are later
        self._param_names: dict[int, str] = {}
        # statistics
        self.steps = 0
        self._trace: StepTrace | None = StepTrace() if trace else None

    def synchronizer(self) -> Engine:
        if self.sync is None or not core.is_live(self.sync):
            self.sync = self._engine.get()
        return self.sync

    def state_dict(self) -> dict[str, Any]:
        """HiPress's state for a checkpoint: the engine's residuals, step and plan, and
        this state's statistics. Each rank saves its own.

        Example:
            >>> torch.save({"model": ddp.state_dict(), "opt": opt.state_dict(),
            ...             "hipress": hook_state.state_dict()}, f"ckpt-rank{rank}.pt")
        """
        return {"steps": self.steps, "engine": plain(self._engine.state_dict())}

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()`` (of the same rank and world size; see
        ``casync.Synchronizer.load_state_dict``), now or when the first bucket comes."""
        self.steps = int(state.get("steps", 0))
        self._engine.load_state_dict(state.get("engine", {}), reset_residuals)

    def take_trace(self) -> "StepTrace | None":
        """What was recorded since the last call (``trace=True``), then start afresh: the
        hook's calls and the end-of-backward wait on the training thread, and the engine's
        tasks (``casync.executor``'s trace). None without ``trace``."""
        if self._trace is None:
            return None
        taken, self._trace = self._trace, StepTrace()
        tasks = self.sync.take_trace() if self.sync is not None else None
        if tasks is not None:
            taken.tasks = tasks
        return taken

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent through the hook so far."""
        return 0 if self.sync is None else int(self.sync.bytes_sent)

    def __getstate__(self) -> dict[str, Any]:
        # Engines, process groups, futures and object ids do not travel in pickles.
        dropped: dict[str, Any] = {
            "sync": None, "_step_futures": None, "_error": None, "_param_names": {},
            "_trace": StepTrace() if self._trace is not None else None,
            "_engine": core.LazyEngine(self.options)}
        return {k: v for k, v in self.__dict__.items() if k not in dropped} | dropped

    def _watch(self, futures: list[torch.futures.Future[Any]]) -> None:
        """Make this backward pass raise the engine's ``SyncError`` as a ``SyncError``.

        DDP waits on the hook's futures in C++, and an exception that completes a future
        reaches the user as a plain ``RuntimeError``. A callback queued on the autograd
        engine at the first bucket runs when backward ends, before DDP's own (queued at
        the last bucket), on the thread that called ``backward()``: it waits for the
        step's tensors and raises the engine's error itself, which keeps its type.
        """
        if self._step_futures is None:
            self._step_futures = []
            at_backward_end(self._check_step)
        self._step_futures.extend(futures)

    def _failed(self, error: BaseException) -> torch.futures.Future[torch.Tensor]:
        """A bucket's future when the engine could not start (ranks disagree on a
        setting, one's was invalid): backward raises ``error`` itself, with its type."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_exception(error)  # type: ignore[arg-type]  # typed as the value's type
        self._error = error
        self._watch([])
        return future

    def _check_step(self) -> None:
        futures, self._step_futures = self._step_futures or [], None
        error, self._error = self._error, None
        if error is not None:
            raise error
        if self._trace is not None:
            start = time.perf_counter()
            try:
                self._wait(futures)
            finally:
                self._trace.tail.append((start, time.perf_counter()))
            return
        self._wait(futures)

    def _wait(self, futures: list[torch.futures.Future[Any]]) -> None:
        for future in futures:
            try:
                future.wait()
            except Exception:
                error = self.sync.error if self.sync is not None else None
                if error is not None:
                    raise error from None
                raise


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket with CaSync; the future resolves to the bucket buffer.

    Follows DDP's hook contract: returns at once and decodes in place. Each parameter's
    gradient keeps its own payload (codecs such as onebit keep one scale per tensor, and
    one scale for a whole bucket loses accuracy), but the bucket travels as a few chunks:
    one message per peer and stage, one batched kernel call per encode or decode. Its
    gradients too small to compress go through one plain allreduce, in place.
    """
    if state._trace is not None:
        start = time.perf_counter()
        try:
            return _comm_hook(state, bucket)
        finally:
            state._trace.hook.append((start, time.perf_counter()))
    return _comm_hook(state, bucket)


def _comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    try:
        sync = state.synchronizer()
    except HiPressError as exc:
        return state._failed(exc)
    buffer = bucket.buffer()
    grads = _views_into(buffer, bucket.gradients())
    if grads is None:
        parts = [sync.submit(f"bucket{bucket.index()}", buffer)]
        future = parts[0]
    else:
        names = state._param_names
        for p in bucket.parameters():
            names.setdefault(id(p), f"param{len(names)}")
        # One batch, one future: not a future per parameter gathered by collect_all.
        parts = [sync.submit_many((names[id(p)], g)
                                  for p, g in zip(bucket.parameters(), grads, strict=True))]

        def whole(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            done.value()  # re-raises a SyncError
            return buffer

        # A child of a CUDA-aware future is CUDA-aware on the same devices (torch's
        # Future.then): DDP's consumers of the buffer wait for the engine's stream.
        future = parts[0].then(whole)
    state._watch(parts)
    if bucket.is_last():
        sync.end_step()
        state.steps += 1
    else:
        sync.flush()  # a bucket's chunks start now, as DDP hands it over
    return future


def _views_into(buffer: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The bucket's gradients as flat views of ``buffer``, or None if they are copies."""
    start, itemsize = buffer.data_ptr(), buffer.element_size()
    views, offset = [], 0
    for g in grads:
        if g.data_ptr() != start + offset * itemsize or not g.is_contiguous():
            return None
        views.append(buffer[offset:offset + g.numel()])
        offset += g.numel()
    return views if offset == buffer.numel() else None
