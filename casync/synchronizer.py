"""``Synchronizer``: the engine's front door — submit gradients, get averaged gradients."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import numpy as np

from compll import Codec, codec
from compll.payload import VERSION, algorithm_id
from hipress._version import __version__
from hipress.errors import ConfigError, SyncError

from . import lifecycle
from .chunks import CHUNK_ELEMS, Chunk, Chunker, Entry
from .devices import HostMemory, Link, Memory, memory_of
from .executor import Executor, Graph
from .feedback import ErrorFeedback
from .graphs import BUILDERS, Context, slots
from .health import Health
from .plan import MIN_COMPRESS, Plan, Planner, StaticPlanner
from .planner import CostPlanner
from .profiler import cached
from .settings import Settings, agree, default_timeout, publish_invalid
from .simulate import Gradient
from .state import load_state_dict as load_engine_state
from .state import state_dict as engine_state
from .transport import NcclTransport, Transport, tag_space

__all__ = ["Synchronizer", "default_timeout"]

#: tensors of these device types stay where they are and take the device path (torch
#: buffers, staged messages); tests add "cpu" to run that path on CPU tensors
DEVICE_TYPES = {"cuda"}

_log = logging.getLogger("hipress")
_HOW = {"gloo": "host buffers over Gloo",
        "staged": "compressed on the GPU, the payloads staged through pinned host memory "
                  "over Gloo",
        "nccl": "compressed on the GPU, the payloads over NCCL at their worst-case sizes"}


def _cuda_transport(choice: str | Transport | None) -> str | Transport:
    """``staged`` or ``nccl`` (or a test's transport): the argument, else
    ``HIPRESS_CUDA_TRANSPORT``, else ``auto``, which is ``nccl`` when the default process
    group is NCCL (one GPU per rank, as ``hp.init`` sets up) and ``staged`` otherwise."""
    if isinstance(choice, Transport):
        return choice
    raw = choice or os.environ.get("HIPRESS_CUDA_TRANSPORT") or "auto"
    if raw not in ("auto", "staged", "nccl"):
        raise ConfigError(f"cuda_transport={raw!r}: give 'auto', 'staged' or 'nccl'")
    if raw != "auto":
        return raw
    import torch.distributed as dist

    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    return "nccl" if nccl else "staged"


def _settings(algorithm: str | None, topology: str, planner: Planner | str | None,
              plan: str | None, min_compress: int | None, error_feedback: bool | None,
              timeout: float | None, params: dict[str, Any]) -> Settings:
    """The constructor's arguments, checked (``planner`` a ``Planner`` object, or a plan
    name as the wrappers' ``plan=`` takes)."""
    if planner is not None and not isinstance(planner, str):
        if plan is not None or min_compress is not None:
            raise ConfigError("pass a Planner as planner= or plan=/min_compress=, not both")
        chosen = "static"
    else:
        if planner is not None and plan is not None and planner != plan:
            raise ConfigError(f"planner={planner!r} and plan={plan!r} disagree; pass one")
        chosen = plan if plan is not None else (planner if planner is not None else "static")
    return Settings.of(algorithm, topology, chosen,
                       MIN_COMPRESS if min_compress is None else min_compress,
                       error_feedback, timeout, **params)


_PENDING: Any = None  # the future class, made once torch is imported


def _future(engine: Synchronizer, *memories: Memory | None) -> Any:
    """A future for tensors on ``memories`` that sends its chunk when waited on: a tensor
    waits in a chunk still filling until more tensors come or the step ends, and a
    caller that waits first would wait forever. The send happens at the wait, a point of
    the program every rank reaches in the same order, so the ranks' chunks stay equal.
    CUDA-aware on GPUs (torch refuses CUDA values in a CPU future; this one makes its
    waiters' streams wait for the engine's)."""
    global _PENDING
    if _PENDING is None:
        import torch

        class Pending(torch.futures.Future):
            """A ``torch.futures.Future`` whose ``wait()`` first sends its chunk."""

            _engine: Any = None

            def wait(self) -> Any:
                engine = self._engine() if self._engine is not None else None
                if engine is not None and not self.done():
                    engine.flush()
                return super().wait()

        _PENDING = Pending
    import torch

    devices: list[Any] = [torch.device(m.device) for m in memories if m is not None and m.cuda]
    future = _PENDING(devices=devices) if devices else _PENDING()
    future._engine = weakref.ref(engine)  # no cycle through the engine's entries
    return future


_TENSOR: Any = None  # torch.Tensor, once torch is imported (NumPy-only callers never do)
_F32: Any = None


def _stage(tensor: Any) -> tuple[Any, bool, int, Memory | None]:
    """The flat float32 buffer the engine works on for ``tensor``, whether results must be
    copied back, the buffer's address and its memory (None: the host).

    Host float32 data is used in place (NumPy arrays and CPU tensors, as NumPy views). A
    CUDA tensor stays on its GPU: float32 in place, fp16/bf16/f64 upcast there."""
    global _TENSOR, _F32
    if isinstance(tensor, np.ndarray):
        if tensor.dtype == np.float32 and tensor.flags.c_contiguous \
                and tensor.flags.writeable:
            flat = tensor.reshape(-1)
            return flat, False, flat.ctypes.data, None
        if tensor.dtype.kind != "f":
            raise ConfigError(f"gradients must be floating point, not {tensor.dtype}")
        flat = np.ascontiguousarray(tensor, dtype=np.float32).reshape(-1)
        return flat, True, flat.ctypes.data, None
    import torch

    _TENSOR, _F32 = torch.Tensor, torch.float32
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"submit() takes a torch tensor or NumPy array, not "
                          f"{type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ConfigError(f"gradients must be floating point, not {tensor.dtype}")
    t = tensor.detach()
    same = t.dtype == torch.float32 and t.is_contiguous()
    if t.device.type == "cpu" and "cpu" not in DEVICE_TYPES:
        if same:
            return t.view(-1).numpy(), False, t.data_ptr(), None
        host = t.to(dtype=torch.float32).contiguous().view(-1)
        return host.numpy(), True, host.data_ptr(), None
    if t.device.type not in DEVICE_TYPES:
        raise ConfigError(f"CaSync takes CPU and CUDA tensors, not {t.device.type}")
    on_gpu = t.view(-1) if same else t.to(dtype=torch.float32).contiguous().view(-1)
    return on_gpu, not same, on_gpu.data_ptr(), memory_of(on_gpu)


def _entry(name: str, tensor: Any, future: Any) -> Entry:
    """``tensor`` staged (``_stage``) as the ``Entry`` of ``name`` that resolves
    ``future``."""
    # The common case first, in a few attribute reads and no tuple: an entry per tensor
    # per step makes this the engine's hottest Python.
    if (type(tensor) is _TENSOR and tensor.dtype is _F32 and tensor.is_cpu
            and not tensor.requires_grad and tensor.is_contiguous()
            and "cpu" not in DEVICE_TYPES):
        flat = tensor.numpy()
        return Entry(name, tensor, flat if flat.ndim == 1 else flat.reshape(-1), False,
                     future, 0, tensor.data_ptr())
    buf, write_back, ptr, memory = _stage(tensor)
    return Entry(name, tensor, buf, write_back, future, 0, ptr, memory)


def _give_back(entry: Entry) -> None:
    if not entry.write_back:
        return
    if isinstance(entry.tensor, np.ndarray):
        entry.tensor[...] = entry.buf.reshape(entry.tensor.shape)
        return
    import torch

    values = entry.buf if isinstance(entry.buf, torch.Tensor) else torch.from_numpy(entry.buf)
    entry.tensor.detach().copy_(values.view(entry.tensor.shape))


class _Batch:
    """The one future of a ``submit_many``, shared by its entries: it resolves to the
    batch's tensors once the last of them holds the average."""

    __slots__ = ("future", "left", "tensors")

    def __init__(self, future: Any, tensors: list[Any]) -> None:
        self.future = future
        self.left = len(tensors)
        self.tensors = tensors

    def done(self) -> bool:
        return bool(self.future.done())

    def set_exception(self, error: BaseException) -> None:
        self.future.set_exception(error)


class Synchronizer:
    """Averages gradients across the ranks of a Gloo group with compression-aware graphs.

    A step's tensors are coalesced into chunks (``casync.chunks``): each tensor keeps
    its own payload, but a chunk travels as one message per peer and stage and is
    encoded and decoded by batched kernel calls, so a step costs messages per chunk,
    not per tensor. A chunk starts as soon as it is full; ``end_step`` (or
    ``synchronize``) sends the rest.

    Args:
        algorithm: the CompLL algorithm for compressed tensors, or ``"none"``.
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
        trace: record task timings in ``executor.trace``.
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

    _MAX_FITS = 3  # whole-model plans (CostPlanner.fit) per engine

    def __init__(self, algorithm: str | None = "onebit", topology: str = "ps", *,
                 planner: Planner | str | None = None, plan: str | None = None,
                 min_compress: int | None = None, error_feedback: bool | None = None,
                 group: Any = None, timeout: float | None = None,
                 chunk_elems: int = CHUNK_ELEMS, seed: int = 0,
                 target: str = "auto", transport: Transport | None = None,
                 cuda_transport: str | Transport | None = None, nccl_group: Any = None,
                 trace: bool = False, **params: Any) -> None:
        try:
            self.settings = _settings(algorithm, topology, planner, plan, min_compress,
                                      error_feedback, timeout, params)
            if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int) \
                    or chunk_elems < 1:
                raise ConfigError(f"chunk_elems must be an integer >= 1, not {chunk_elems!r}")
            self.cuda_transport = _cuda_transport(cuda_transport)
        except ConfigError as exc:
            # the other ranks learn it at their settings check instead of waiting on this one
            publish_invalid(exc, transport.group if transport is not None else group)
            raise
        settings = self.settings
        given = planner is not None and not isinstance(planner, str)
        self._auto = settings.plan == "auto" and settings.algorithm is not None and not given
        self.planner: Planner = planner if given else StaticPlanner(  # type: ignore[assignment]
            settings.algorithm, settings.topology, min_compress=settings.min_compress,
            **dict(settings.params))
        self.error_feedback = error_feedback
        self.timeout = settings.timeout
        self.chunk_elems = int(chunk_elems)
        self.seed = int(seed)
        self.target = target
        self.transport = transport if transport is not None else Transport(group)
        self.rank, self.size = self.transport.rank, self.transport.size
        self.step = 0
        self._codecs: dict[tuple[str, tuple[tuple[str, Any], ...]], Codec] = {}
        self._feedback: dict[str, ErrorFeedback] = {}
        self._tag = 0
        self._chunker = Chunker(self.size, self.chunk_elems)
        self._names: set[str] = set()
        self._done = threading.Lock()  # chunks finish on the executor's threads
        self._seen: list[tuple[str, int]] = []
        self._fitted: list[tuple[str, int]] | None = None
        self._fits = 0
        self._step_graphs: list[Graph] = []
        self._previous: list[Graph] = []  # closed steps whose sends may be in flight
        self._pool: dict[Hashable, Any] = {}
        self._links: dict[str, Link] = {}
        self._nccl_group = nccl_group
        self._device_transport: Transport | None = None
        self._rows: dict[Hashable, Any] = {}
        self.algorithm = settings.algorithm
        self.topology = settings.topology
        self.params = dict(settings.params)
        # Compared before anything collective, the profiler of plan="auto" included: ranks
        # that disagree then fail with the field named instead of meeting in a collective.
        self._check_agreement()
        if self._auto and settings.algorithm is not None:
            cost = cached(self.transport, (settings.algorithm,), target, engine=type(self))
            self.planner = CostPlanner(cost, (settings.algorithm,))
        # A planner that plans whole models (CostPlanner.fit) learns this step's tensors.
        self._fit = getattr(self.planner, "fit", None) if self.size > 1 else None
        self.executor = Executor(self.transport, self.timeout, trace)
        self.health = Health(self.transport.group, self.rank, self.size)
        self.executor.explain = self._explain
        lifecycle.register(self)  # closed before its group is destroyed, or at exit

    # -- configuration ------------------------------------------------------------------

    def codec(self, plan: Plan) -> Codec:
        """The codec a plan compresses with (built once, cached per algorithm+params)."""
        assert plan.algorithm is not None
        key = (plan.algorithm, plan.params)
        if key not in self._codecs:
            self._codecs[key] = codec(plan.algorithm, target=self.target, seed=self.seed,
                                      **dict(plan.params))
        return self._codecs[key]

    def feedback(self, codec: Codec) -> ErrorFeedback | None:
        on = (not codec.unbiased) if self.error_feedback is None else self.error_feedback
        if not on:
            return None
        return self._feedback.setdefault(repr(codec), ErrorFeedback())

    def link(self, memory: Memory | None) -> Link:
        """How chunks on ``memory`` (None: the host) travel; the first use of each is
        logged (``casync.devices``)."""
        memory = memory if memory is not None else HostMemory()
        link = self._links.get(memory.device)
        if link is None:
            if isinstance(memory, HostMemory) or self.cuda_transport == "staged":
                link = Link(memory, self.transport)
            else:
                link = Link(memory, self._device_wire(), device_wire=True)
            self._links[memory.device] = link
            _log.info("CaSync rank %d: tensors on %s travel %s (%s)", self.rank,
                      memory.device, link.name, _HOW[link.name])
        return link

    def _device_wire(self) -> Transport:
        """The transport of device-resident messages: NCCL, or the one a test gave."""
        if isinstance(self.cuda_transport, Transport):
            return self.cuda_transport
        if self._device_transport is None:
            nccl = NcclTransport(self._nccl_group)
            if (nccl.rank, nccl.size) != (self.rank, self.size):
                raise ConfigError(f"the NCCL group has rank {nccl.rank} of {nccl.size} where "
                                  f"the engine's group has rank {self.rank} of {self.size}; "
                                  "pass nccl_group= over the same ranks")
            self._device_transport = nccl
        return self._device_transport

    def _probe(self) -> Codec:
        return self.codec(Plan(self.topology if self.topology != "none" else "ps",
                               self.algorithm, 1, tuple(sorted(self.params.items()))))

    def codec_params(self) -> dict[str, Any] | None:
        """The algorithm's parameters in force (defaults filled in), or None."""
        return None if self.algorithm is None else self._probe().params

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
        if self._names:
            raise ConfigError(f"{what}() came in the middle of step {self.step}; call it "
                              "after synchronize() (or optimizer.step()) and before the next "
                              "backward")
        self._settle()

    def _check_agreement(self) -> None:
        """Every rank must run the same engine configuration; name the field that differs.
        Settings that mean the same compare equal (``error_feedback=None`` is the codec's
        default)."""
        fields: dict[str, Any] = {
            "hipress version": __version__,
            "payload format version": VERSION,
            "algorithm": self.algorithm,
            "topology": self.topology,
            "plan": "auto" if self._auto else repr(self.planner),
            "seed": self.seed,
            "chunk elements": self.chunk_elems,
            "CUDA transport": self.cuda_transport if isinstance(self.cuda_transport, str)
            else type(self.cuda_transport).__name__,
        }
        if self.algorithm is not None:
            probe = self._probe()
            fields["error feedback"] = self.settings.feedback_for(probe.unbiased)
            fields["algorithm parameters"] = probe.params
            fields["DSL hash"] = f"{algorithm_id(probe.program):08x}"
        agree(fields, self.transport.group, self.rank, self.size, self.timeout)

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
        if name in self._names:
            raise self._twice(name)
        entry = _entry(name, tensor, None)
        memory = entry.memory
        entry.future = _future(self, memory)
        if memory is not None:
            entry.ready = memory.ready_event()
        if not self._names:
            self._start()
        self._names.add(name)
        if self.size == 1:
            _give_back(entry)
            entry.future.set_result(tensor)
            return entry.future
        self._queue([entry])
        return entry.future

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
        if len(set(names)) != len(names) or not self._names.isdisjoint(names):
            seen = set(self._names)
            for name in names:
                if name in seen:
                    raise self._twice(name)
                seen.add(name)
        batch = _Batch(None, [tensor for _, tensor in items])  # its future: below
        entries = [_entry(name, tensor, batch) for name, tensor in items]
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
        future = batch.future = _future(self, *memories.values())
        if items and not self._names:
            self._start()
        self._names.update(names)
        if self.size == 1:
            for entry in entries:
                _give_back(entry)
        else:
            self._queue(entries)
        if self.size == 1 or not items:
            future.set_result(batch.tensors)
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
        self._settle()
        self.health.progress(self.step)

    def _queue(self, entries: list[Entry]) -> None:
        """Chunk ``entries`` and launch the chunks they fill, once all are placed."""
        if self._fit is not None:
            self._seen.extend((entry.name, entry.numel) for entry in entries)
        plan, size = self.planner.plan, self.size
        for chunk in self._chunker.add_many(entries, [plan(e.name, e.numel, size)
                                                      for e in entries]):
            self._launch(chunk)

    def flush(self) -> None:
        """Send the chunks still filling now (DDP's hook does at the end of a bucket)."""
        for chunk in self._chunker.flush():
            self._launch(chunk)

    def synchronize(self) -> None:
        """Finish the step: send the last chunks, wait for every tensor, then advance.

        Raises:
            SyncError: a peer died, stalled past the timeout or sent bad data.
        """
        self.end_step()
        self._settle()

    def end_step(self) -> None:
        """Close the step without waiting: send the last chunks and advance the step.

        For callers that wait on the futures themselves (the DDP comm hook). The next
        step's first ``submit`` makes sure this step's sends have left before their
        buffers are reused.
        """
        self.flush()
        self._chunker.end_step()
        self._previous.extend(self._step_graphs)
        self._step_graphs = []
        self._names.clear()
        self._refit()
        self.step += 1

    def _refit(self) -> None:
        """Plan the whole model once its tensors are known, again if they change (DDP
        rebuilds its buckets after the first step), at most ``_MAX_FITS`` times: a model
        whose tensors change every step keeps its last whole-model plan (tensors it has
        not seen are planned on first sight). Every rank saw the same tensors."""
        seen, self._seen = self._seen, []
        if self._fit is None or not seen or seen == self._fitted \
                or self._fits >= self._MAX_FITS:
            return
        self._fit([Gradient(name, numel) for name, numel in seen], self.size,
                  chunk_elems=self.chunk_elems)
        self._fitted = seen
        self._fits += 1

    def _settle(self) -> None:
        """Wait until earlier steps' graphs finished and their sends completed."""
        graphs, self._previous = self._previous, []
        for graph in graphs:
            graph.finished.wait()
        if self.executor.error is not None:
            raise self.executor.error
        for handle in (h for g in graphs for h in g.sends):
            try:
                self.transport.wait(handle, self.timeout)
            except BaseException as exc:  # noqa: BLE001
                raise SyncError(f"step {self.step - 1}: a send to rank {handle.peer} did not "
                                f"complete within {self.timeout:g} s: {exc}") from exc

    def close(self) -> None:
        """Let the last step's messages leave, then stop the engine's threads (the
        process group stays up). ``dist.destroy_process_group()`` and the interpreter's
        exit call it for engines still open (``casync.lifecycle``)."""
        try:
            if self.executor.error is None:
                self.end_step()
                self._settle()
        finally:
            lifecycle.forget(self)
            self.executor.close()
            self.health.close()
            if self.executor.error is None:
                # The lanes drop their last tasks, and the tensors those reach, now: freed
                # by a lane while the interpreter finalizes, a tensor aborts the process
                # (casync.teardown). A failed engine's lanes may sit in Gloo instead;
                # hipress.distributed cuts its connections before it waits for them.
                self.executor.join(5.0)

    # -- graphs -------------------------------------------------------------------------

    def _launch(self, chunk: Chunk) -> None:
        plan = chunk.plan
        codec = self.codec(plan) if plan.compress else None
        ctx = Context(self.transport, codec, self.feedback(codec) if codec else None,
                      self.step, self._tag, chunk, self._pool, self._rows,
                      self.link(chunk.segments[0].entry.memory if chunk.segments else None))
        self._tag = (self._tag + slots(plan.topology, self.size)) % tag_space
        graph = Graph(lambda: chunk.label, self.step)
        link = ctx.link
        assert link is not None

        def done() -> None:
            finished = []
            with self._done:
                for seg in chunk.segments:
                    entry = seg.entry
                    entry.pending -= 1
                    if entry.pending == 0:
                        finished.append(entry)
            batched: dict[_Batch, int] = {}  # a batch's entries this graph finished
            # On the engine's stream: a write-back copy and the future's event follow the
            # decodes.
            with link.memory.active():
                for entry in finished:
                    _give_back(entry)
                    future = entry.future
                    if type(future) is _Batch:
                        batched[future] = batched.get(future, 0) + 1
                    else:
                        future.set_result(entry.tensor)
                if batched:  # counted after the write-backs: other graphs finish too
                    complete = []
                    with self._done:
                        for batch, count in batched.items():
                            batch.left -= count
                            if batch.left == 0:
                                complete.append(batch)
                    for batch in complete:
                        batch.future.set_result(batch.tensors)

        def failed(error: BaseException) -> None:
            for entry in dict.fromkeys(s.entry for s in chunk.segments):
                if not entry.future.done():
                    entry.future.set_exception(error)

        try:  # building touches the device (its stream, the events): CUDA errors raise here
            with link.memory.active():  # the engine's stream waits for the gradients
                if link.memory.cuda:  # host memory has nothing to wait for
                    for entry in dict.fromkeys(s.entry for s in chunk.segments):
                        link.memory.after(entry.ready)
                BUILDERS[plan.topology](ctx, graph)
        except RuntimeError as exc:  # torch's error type for a backend's failure
            error = self.executor.reject(graph, exc)
            failed(error)
            raise error from exc
        graph.on_done = done
        graph.on_error = failed
        self._step_graphs.append(graph)
        self.executor.add(graph)
