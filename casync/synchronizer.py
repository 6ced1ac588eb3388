"""``Synchronizer``: the engine's front door — submit gradients, get averaged gradients.

The engine's parts, each in its own module: the checked configuration
(``casync.settings.EngineConfig``), the codecs and residuals (``casync.codecs``), the
links by memory (``casync.links``), the step in progress and its graphs
(``casync.steps``), how a tensor is staged and given back (``casync.staging``), and the
executor and health services. The planner learns the model by itself
(``casync.plan.Learner``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError, SyncError

from . import lifecycle, staging
from .codecs import Codecs
from .devices import Link, Memory
from .executor import Executor
from .guard import Guard
from .health import Health
from .links import Links
from .model.planner import CostPlanner
from .plan import DEFAULT_ALGORITHM, HIERARCHICAL, Plan, Planner, StaticPlanner
from .settings import EngineConfig, agree, default_timeout, publish_invalid
from .state import load_state_dict as load_engine_state
from .state import state_dict as engine_state
from .steps import Steps
from .transport import Transport

__all__ = ["Synchronizer", "default_timeout"]


class Synchronizer:
    """Averages gradients across the ranks of a Gloo group with compression-aware graphs.

    A step's tensors are coalesced into chunks (``casync.chunks``): each tensor keeps
    its own payload, but a chunk travels as one message per peer and stage and is
    encoded and decoded by batched kernel calls, so a step costs messages per chunk,
    not per tensor. A chunk starts as soon as it is full; ``end_step`` (or
    ``synchronize``) sends the rest.

    One level over one group; ``casync.engine`` builds it, or a hierarchical engine
    (``casync.hierarchy``), from the same arguments.

    Args:
        algorithm: the CompLL algorithm for compressed tensors, or ``"none"``; or the
            settings already checked (a ``casync.settings.EngineConfig``, as
            ``casync.engine`` passes them), and then none of the settings below.
        topology: ``ps``, ``ring`` or ``allgather`` (see ``casync.graphs``).
        planner: decides per tensor: a ``Planner``; or a plan name as ``plan`` takes.
        plan: ``"static"`` (the default): a ``StaticPlanner`` over the above with
            ``min_compress``; ``"auto"``: a ``CostPlanner`` on this group's measured costs
            (profiled once at start-up, then cached). The wrappers' ``plan=``.
        min_compress: static plans allreduce tensors below this many elements.
        error_feedback: keep residuals; ``None`` means on for biased algorithms only.
        group: the process group (Gloo); default the world.
        timeout: seconds before a silent peer raises ``SyncError``
            (default ``HIPRESS_TIMEOUT`` or 300).
        chunk_elems: a chunk is sent once it holds this many elements.
        seed: the RNG seed of stochastic algorithms (the same on every rank).
        transport: a ``Transport`` (tests instrument it); by default built on ``group``.
        cuda_transport: how messages of CUDA tensors travel (``casync.devices``):
            ``"staged"`` (compressed payloads through pinned host memory over ``group``),
            ``"nccl"`` (device buffers over ``nccl_group``, default the world), or
            ``"auto"``: nccl when the default group is NCCL; default
            ``HIPRESS_CUDA_TRANSPORT``, else auto.
        nccl_group: the NCCL group over the same ranks as ``group`` (default the world).
        trace: record task timings (``take_trace``).
        guard: apply the engine's rules on top of the plan (``casync.guard``): the first
            steps uncompressed, and tensors whose averaged gradient was mostly exact zeros
            then (embeddings) never compressed. The plugins' wrappers turn it on.
        **params: parameters of ``algorithm``.

    Raises:
        ConfigError: a bad setting (at once, on this rank; the other ranks learn it at
            their settings check), or ranks that disagree on one (every rank, naming it).
        SyncError: a rank did not reach the settings check within ``timeout``.

    Example:
        >>> sync = Synchronizer("onebit", "ring")
        >>> futures = [sync.submit(n, p.grad) for n, p in model.named_parameters()]
        >>> sync.synchronize()   # every p.grad now holds the average over ranks
    """

    def __init__(self, algorithm: str | None | EngineConfig = DEFAULT_ALGORITHM,
                 topology: str = "ps", *, planner: Planner | str | None = None,
                 group: Any = None, transport: Transport | None = None,
                 nccl_group: Any = None, trace: bool = False, **options: Any) -> None:
        try:
            self.config = _config(algorithm, topology, planner, options)
        except ConfigError as exc:
            # the other ranks learn it at their settings check instead of waiting on this one
            publish_invalid(exc, transport.group if transport is not None else group)
            raise
        config, settings = self.config, self.config.settings
        # -- the group
        self.transport = transport if transport is not None else Transport(group)
        self.rank, self.size = self.transport.rank, self.transport.size
        # -- what to compress with, and how chunks travel
        self.codecs = Codecs(settings, config.target, config.seed)
        self.links = Links(self.transport, config.cuda_transport, nccl_group)
        first: Planner = planner if config.custom_planner else StaticPlanner(  # type: ignore[assignment]
            settings.algorithm, settings.topology, min_compress=settings.min_compress,
            **dict(settings.params))
        # Compared before anything collective, the profiler of plan="auto" included: ranks
        # that disagree then fail with the field named instead of meeting in a collective.
        agree(config.agreement(first, self.codecs.probe()), self.transport.group, self.rank,
              self.size, settings.timeout)
        if config.auto:
            assert settings.algorithm is not None
            first = CostPlanner.measured(self.transport, settings.algorithm, config.target,
                                         steps=self.time_steps)
        # -- the services: graphs run on the executor, progress and failures go to health
        self.executor = Executor(self.transport, settings.timeout, trace)
        self.health = Health(self.transport.group, self.rank, self.size)
        self.executor.explain = self._explain
        # -- the steps
        self.steps = Steps(self.transport, first, self.codecs, self.links, self.executor,
                           config.chunk_elems, settings.timeout,
                           Guard() if settings.guard else None)
        lifecycle.register(self)  # closed before its group is destroyed, or at exit

    # -- what every engine reports (casync.Engine) ---------------------------------

    @property
    def error(self) -> BaseException | None:
        """What broke the engine (a ``SyncError``), or None while it works."""
        return self.executor.error

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent since the engine started."""
        return int(self.transport.bytes_sent)

    @property
    def group(self) -> Any:
        """The process group the engine runs on."""
        return self.transport.group

    def take_trace(self) -> list[Any] | None:
        """The tasks run since the last call (lane, name, start, end), and a fresh record;
        None unless built with ``trace=True``."""
        taken = self.executor.trace
        if taken is not None:
            self.executor.trace = []
        return taken

    # -- configuration ------------------------------------------------------------------

    @property
    def planner(self) -> Planner:
        """How each tensor is planned (``casync.state`` replaces it with a loaded one)."""
        return self.steps.planner

    @planner.setter
    def planner(self, planner: Planner) -> None:
        self.steps.planner = planner

    @property
    def step(self) -> int:
        """The number of the step in progress (0 first)."""
        return self.steps.number

    @step.setter
    def step(self, number: int) -> None:
        self.steps.number = number

    def codec(self, plan: Plan) -> Any:
        """The codec ``plan`` compresses with (built once, cached per algorithm+params)."""
        return self.codecs.of(plan)

    def link(self, memory: Memory | None) -> Link:
        """How chunks on ``memory`` (None: the host) travel (``casync.links``)."""
        return self.links.of(memory)

    def codec_params(self) -> dict[str, Any] | None:
        """The algorithm's parameters in force (defaults filled in), or None."""
        probe = self.codecs.probe()
        return None if probe is None else probe.params

    def state_dict(self) -> dict[str, Any]:
        """What the engine carries between steps — residuals, step, plan — to checkpoint
        (``casync.state``). Waits for the steps in flight first.

        Example:
            >>> torch.save(sync.state_dict(), f"hipress-rank{rank}.pt")
        """
        self._between_steps("state_dict")
        return engine_state(self)

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from a ``state_dict`` saved by the same rank of a job of the same size:
        the next steps give the same bits as the saved job's would have.

        Raises:
            ConfigError: the state is of another rank, world size (unless
                ``reset_residuals``) or setting; the message names the field.
        """
        self._between_steps("load_state_dict")
        load_engine_state(self, state, reset_residuals)

    def _between_steps(self, what: str) -> None:
        if self.steps.names:
            raise ConfigError(f"{what}() came in the middle of step {self.step}; call it "
                              "after synchronize() (or optimizer.step()) and before the next "
                              "backward")
        self.steps.settle()

    def _explain(self, error: SyncError, step: int) -> SyncError:
        """Publish what this rank saw fail in ``step``, then add what the others saw."""
        self.health.report(str(error).split(": ", 1)[-1][:300])
        found = self.health.diagnose(step)
        self.health.linger(step)
        return SyncError(f"{error}{found}")

    # -- the step -----------------------------------------------------------------------

    def submit(self, name: str, tensor: Any) -> Any:
        """Queue ``tensor`` to be averaged in place across ranks.

        Tensors must be submitted in the same order on every rank within a step. A
        tensor waits in its chunk until the chunk fills or the step ends.

        Returns:
            A ``torch.futures.Future`` resolving to ``tensor`` once it holds the average.

        Raises:
            SyncError: an earlier failure broke the group (restart the job).
            ConfigError: a name submitted twice in one step, or a non-float tensor.
        """
        self._check_usable()
        names = self.steps.names
        if name in names:
            raise self._twice(name)
        completion = staging.Completion(None, 1, tensor)
        entry = staging.entry(name, tensor, completion)
        memory = entry.memory
        future = completion.future = staging.future(self, memory)
        if memory is not None:
            entry.ready = memory.ready_event()
        if not names:
            self._start()
        names.add(name)
        if self.size == 1:
            staging.give_back(entry)
            future.set_result(tensor)
        else:
            self.steps.queue([entry])
        return future

    def submit_many(self, tensors: Iterable[tuple[str, Any]]) -> Any:
        """Queue ``(name, tensor)`` pairs, in order, as ``submit`` queues each, with one
        future for them all.

        For callers that hand over many tensors at once (a DDP bucket, a step's
        gradients): the checks, the future and, on a GPU, the ordering event are paid
        once per call instead of once per tensor.

        Returns:
            A ``torch.futures.Future`` resolving to the list of the tensors once every
            one holds the average.

        Raises:
            SyncError: an earlier failure broke the group (restart the job).
            ConfigError: a name twice (in the batch, or already in this step), a
                non-float tensor, or tensors of two GPUs; nothing of the batch is queued
                then.
        """
        self._check_usable()
        items = list(tensors)
        names = [name for name, _ in items]
        current = self.steps.names
        if len(set(names)) != len(names) or not current.isdisjoint(names):
            seen = set(current)
            for name in names:
                if name in seen:
                    raise self._twice(name)
                seen.add(name)
        completion = staging.Completion(None, len(items), [tensor for _, tensor in items])
        entries = [staging.entry(name, tensor, completion) for name, tensor in items]
        memories = {e.memory.device: e.memory for e in entries if e.memory is not None}
        if memories:
            gpus = sorted(d for d, m in memories.items() if m.cuda)
            if len(gpus) > 1:  # one future's value is ordered on one engine stream
                raise ConfigError(f"submit_many takes the tensors of one GPU, not of "
                                  f"{', '.join(gpus)}: call it once per device")
            # One ordering event per device: it follows all the work queued so far.
            events = {device: m.ready_event() for device, m in memories.items()}
            for entry in entries:
                if entry.memory is not None:
                    entry.ready = events[entry.memory.device]
        future = completion.future = staging.future(self, *memories.values())
        if items and not current:
            self._start()
        current.update(names)
        if self.size == 1:
            for entry in entries:
                staging.give_back(entry)
        else:
            self.steps.queue(entries)
        if self.size == 1 or not items:
            completion.resolve()
        return future

    def _check_usable(self) -> None:
        if self.executor.error is not None:
            raise SyncError(f"the synchronizer failed earlier ({self.executor.error}); "
                            "restart the job")

    def _twice(self, name: str) -> ConfigError:
        return ConfigError(f"tensor {name!r} was already submitted in step {self.step}; "
                           "call synchronize() to finish the step first")

    def _start(self) -> None:
        """A step's first submit: earlier steps' sends have left; progress is posted."""
        self.steps.settle()
        self.health.progress(self.step)

    def flush(self) -> None:
        """Send the chunks still filling now (DDP's hook does at the end of a bucket)."""
        self.steps.flush()

    def synchronize(self) -> None:
        """Finish the step: send the last chunks, wait for every tensor, then advance.

        Raises:
            SyncError: a peer died, stalled past the timeout or sent bad data.
        """
        self.end_step()
        self.steps.settle()

    def end_step(self) -> None:
        """Close the step without waiting: send the last chunks and advance the step.

        For callers that wait on the futures themselves (the DDP comm hook). The next
        step's first ``submit`` makes sure this step's sends have left before their
        buffers are reused.
        """
        self.steps.end()

    def close(self, wait: float | None = None) -> None:
        """Let the last step's messages leave, then stop the engine's threads (the
        process group stays up) and wait up to ``wait`` seconds for them; by default 5,
        or none for a failed engine, whose threads may sit in Gloo until its group's
        connections are cut. ``dist.destroy_process_group()`` and the interpreter's exit
        call it for engines still open (``casync.lifecycle``)."""
        try:
            if self.executor.error is None:
                self.end_step()
                self.steps.settle()
        finally:
            lifecycle.forget(self)
            self.executor.close()
            self.health.close()
            if wait is None:
                wait = 5.0 if self.executor.error is None else 0.0
            if wait > 0:
                # The lanes drop their last tasks, and the tensors those reach, now: freed
                # by a lane while the interpreter finalizes, a tensor aborts the process
                # (casync.teardown). A failed engine's lanes may sit in Gloo instead;
                # hipress.distributed cuts its connections before it waits for them.
                self.executor.join(wait)

    # -- measuring itself -----------------------------------------------------------------

    @classmethod
    def time_steps(cls, transport: Transport, planner: Planner, algorithm: str,
                   chunk_elems: int, count: int, size: int, reps: int) -> float:
        """The median seconds of ``reps`` steps of ``count`` tensors of ``size`` floats on a
        fresh engine over ``transport`` (``casync.plan.StepTimer``: the profiler prices the
        engine's own costs from them)."""
        import torch  # only here: NumPy-only callers of casync never import it

        sync = cls(algorithm, planner=planner, group=transport.group, transport=transport,
                   timeout=600, chunk_elems=chunk_elems)
        rng = np.random.default_rng(transport.rank)
        tensors = [torch.from_numpy((rng.standard_normal(size) * 1e-3).astype(np.float32))
                   for _ in range(count)]

        def step() -> None:
            for i, t in enumerate(tensors):
                sync.submit(f"g{i}", t)
            sync.synchronize()

        try:
            step()
            times = []
            for _ in range(reps):
                transport.dist.barrier(group=transport.group)
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        finally:
            sync.close()
        return statistics.median(times)



def _config(algorithm: str | None | EngineConfig, topology: str, planner: Any,
            options: dict[str, Any]) -> EngineConfig:
    """The engine's checked settings (``EngineConfig.resolve``), of one level."""
    config = EngineConfig.resolve(algorithm, topology, planner, options)
    if config.settings.topology == HIERARCHICAL:
        raise ConfigError("a Synchronizer is one level; build a hierarchical engine with "
                          "casync.engine(algorithm, 'hierarchical', ...)")
    return config
