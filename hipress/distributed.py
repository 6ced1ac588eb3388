"""The core every framework plugin shares: the process group, ranks and broadcasts.

``hipress.torch``, ``hipress.tensorflow`` and ``hipress.mxnet`` bind ``init``, ``rank``,
``size``, ``local_rank`` from here and only adapt their own tensor types; all of them
move data over ``torch.distributed`` (Gloo) through CaSync.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import Any, TypeGuard

import numpy as np

from casync import Engine, engine, lifecycle
from casync.lifecycle import let_gloo_release
from casync.plan import MIN_COMPRESS
from casync.settings import EngineConfig, default_algorithm, publish_invalid
from casync.teardown import Connections

from .errors import ConfigError
from .network import bind_to_master, free_port

__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "local_size",
           "gloo_group", "synchronizer", "EngineOptions", "LazyEngine", "average_arrays",
           "is_live",
           "broadcast_arrays", "broadcast_object", "allgather_object", "shutdown",
           "destroy_process_group"]

_state: dict[str, Any] = {"group": None, "initialized": False, "owns_group": False}
_engines: weakref.WeakSet[Any] = weakref.WeakSet()  # closed by shutdown()
_connections = Connections()  # of the groups init() created: cut after a failure


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def init(backend: str | None = None, timeout: float = 1800.0) -> None:
    """Join the process group that ``torchrun`` or ``hipress run`` described.

    Without launcher variables (``RANK``, ``WORLD_SIZE``) it starts a group of one, so a
    script also runs as a single process. CaSync always talks over Gloo; when the
    default group is NCCL, a Gloo group over the same ranks is created for it.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; by default NCCL when CUDA is available and
            the launcher gave a ``LOCAL_RANK``, else Gloo.
        timeout: seconds the process group's own collectives may block.

    Example:
        >>> import hipress.torch as hp
        >>> hp.init(); print(hp.rank(), hp.size())
    """
    dist = _dist()
    with _connections.watch():
        if not dist.is_initialized():
            if backend is None:
                import torch

                backend = "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ \
                    else "gloo"
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                bind_to_master()  # torchrun's nodes, as hipress run binds them
                dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
            else:
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                        rank=0, world_size=1,
                                        timeout=timedelta(seconds=timeout))
            _state["owns_group"] = True
        _state["group"] = None if dist.get_backend() == "gloo" \
            else dist.new_group(backend="gloo")
    _state["initialized"] = True
    _at_exit()


def is_initialized() -> bool:
    return bool(_state["initialized"])


def _require() -> Any:
    if not _state["initialized"]:
        raise ConfigError("HiPress is not initialized; call hp.init() first (after "
                          "launching with torchrun or hipress run)")
    return _dist()


def rank() -> int:
    """This process's rank in the job."""
    return int(_require().get_rank())


def size() -> int:
    """The number of ranks in the job."""
    return int(_require().get_world_size())


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK`` from the launcher)."""
    _require()
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_size() -> int:
    """Ranks on this node (``LOCAL_WORLD_SIZE`` from the launcher)."""
    _require()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gloo_group() -> Any:
    """The Gloo process group CaSync talks over (``None`` means the default group)."""
    _require()
    return _state["group"]


def synchronizer(config: EngineConfig | str, group: Any = None, **options: Any) -> Engine:
    """A CaSync engine (``casync.engine``) on the plugin's Gloo group, or on ``group`` (a
    Gloo subgroup, as HSDP's replicas), from checked settings or the arguments to check."""
    _require()
    made = engine(config, group=group if group is not None else _state["group"], **options)
    _engines.add(made)
    return made


class EngineOptions:
    """What every plugin's wrappers take (``algorithm=..., plan=..., ...``), validated
    where the user passes them, turned into an engine on first use.

    Args:
        algorithm: a CompLL algorithm (``hipress.algorithms()``), a ``.cll`` path, or
            ``"none"``; default ``HIPRESS_ALGORITHM`` if set (``hipress run
            --algorithm``), else ``casync.plan.DEFAULT_ALGORITHM``.
        plan: ``"static"``: compress tensors of at least ``min_compress`` elements over
            ``topology``; ``"auto"``: the cost-model planner on costs profiled on this
            group at start-up.
        topology: ``ps``, ``ring``, ``allgather`` (static plans), or ``hierarchical``
            (uncompressed inside each node, compressed across; ``casync.hierarchy``).
        min_compress: smaller tensors go through a plain allreduce (static plans).
        error_feedback: ``None`` = on for biased algorithms.
        timeout: seconds before a silent peer raises ``SyncError``.
        trace: the engine records its tasks (``hipress.breakdown``).
        group: the Gloo group the engine runs on; None: the plugin's, every rank.
        guard: the engine's rules on top of the plan (``casync.guard``): the first steps
            uncompressed, tensors whose averaged gradient was mostly exact zeros then
            (embeddings) never compressed. ``False`` compresses what the plan says from
            the first step.
        **params: the algorithm's parameters (``ratio=0.001`` for dgc).

    Raises:
        ConfigError: a bad value (``casync.settings.Settings.of`` says which and why). In
            a job that has joined its process group, the other ranks learn it too: their
            engines fail at their settings check with this rank's message.
    """

    def __init__(self, algorithm: str | None = None, plan: str = "static",
                 topology: str = "ps", min_compress: int = MIN_COMPRESS,
                 error_feedback: bool | None = None, timeout: float | None = None,
                 trace: bool = False, guard: bool = True, group: Any = None,
                 **params: Any) -> None:
        self.trace = bool(trace)  # the engine records its tasks (not a setting ranks share)
        #: the Gloo group the engine runs on (None: the plugin's, every rank): HSDP's
        #: replicas, DiLoCo's
        self.group = group
        try:
            algorithm = default_algorithm() if algorithm is None else algorithm
            #: checked once, here; the engine is built from it as it is
            self.config = EngineConfig.of(algorithm, topology, plan=plan,
                                          min_compress=min_compress,
                                          error_feedback=error_feedback, timeout=timeout,
                                          guard=guard, **params)
        except ConfigError as exc:
            publish_invalid(exc)  # when the job has joined its process group
            raise
        self.algorithm = algorithm
        self.guard = guard
        self.plan = plan
        self.topology = topology
        self.min_compress = min_compress
        self.error_feedback = error_feedback
        self.timeout = timeout
        self.params = params

    @property
    def key(self) -> tuple[Any, ...]:
        """Equal for equal options (to share one engine between short-lived wrappers)."""
        return (self.algorithm, self.plan, self.topology, self.min_compress,
                self.error_feedback, self.timeout, self.guard,
                tuple(sorted(self.params.items())))

    @property
    def settings(self) -> Any:
        """The user's settings, checked (``casync.settings.Settings``)."""
        return self.config.settings

    def engine(self, planner: Any = None) -> Engine:
        """An engine with these settings on ``group`` (joins the job first); ``planner``:
        a ``Planner`` object of the wrapper's own (FSDP2's reduce-scatter plans)."""
        if not is_initialized():
            init()
        return synchronizer(self.config, group=self.group, planner=planner, trace=self.trace)


class LazyEngine:
    """The engine of one wrapper (a DDP hook's state, a tape, a KVStore), created on first
    use, when the process group exists; a state loaded before that is applied then.

    Example:
        >>> engine = LazyEngine(EngineOptions("onebit"))
        >>> engine.load_state_dict(saved)     # before the first step: kept until then
        >>> engine.get().submit(name, grad)   # creates it, loads the state
    """

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.engine: Engine | None = None
        self._pending: tuple[dict[str, Any], bool] | None = None

    def get(self) -> Engine:
        """The live engine (a new one after ``shutdown()``)."""
        if not is_live(self.engine):
            self.engine = self.options.engine()
            if self._pending is not None:
                state, reset = self._pending
                self._pending = None
                self.engine.load_state_dict(state, reset)
        return self.engine

    def state_dict(self) -> dict[str, Any]:
        """The engine's state (``casync.Synchronizer.state_dict``); before it ever ran,
        the state it will start from ({} for a fresh one)."""
        if is_live(self.engine):
            return dict(self.engine.state_dict())
        return dict(self._pending[0]) if self._pending is not None else {}

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state``: now if the engine runs, else when it starts."""
        if not state:
            return  # saved before the engine ever ran: nothing to continue
        if is_live(self.engine):
            self.engine.load_state_dict(state, reset_residuals)
        else:
            self._pending = (dict(state), reset_residuals)


def is_live(engine: Engine | None) -> TypeGuard[Engine]:
    """Whether ``engine`` is still usable (``shutdown()`` closes every engine)."""
    return engine is not None and engine in _engines


def average_arrays(engine: Any, named: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
    """Average named gradients across ranks in one step of ``engine``.

    Each array comes back as float32 holding the average: the same array when it was
    writable, contiguous float32 (no copy), else a new one. Names must be the same,
    in the same order, on every rank.

    Raises:
        SyncError: a peer died or stalled past the timeout.
    """
    out = []
    for _, arr in named:
        if not (arr.dtype == np.float32 and arr.flags.c_contiguous and arr.flags.writeable):
            arr = np.array(arr, dtype=np.float32, order="C")
        out.append(arr)
    engine.submit_many(zip((name for name, _ in named), out, strict=True))
    engine.synchronize()
    return out


def broadcast_arrays(arrays: list[np.ndarray], root_rank: int = 0) -> None:
    """Overwrite each contiguous NumPy array with ``root_rank``'s, in order."""
    import torch

    dist = _require()
    for arr in arrays:
        if not arr.flags.c_contiguous:
            raise ConfigError("broadcast_arrays needs contiguous arrays")
        if arr.size:
            dist.broadcast(torch.from_numpy(arr), _global(root_rank), group=_state["group"])


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s picklable ``obj`` on every rank."""
    dist = _require()
    box = [obj]
    dist.broadcast_object_list(box, src=_global(root_rank), group=_state["group"])
    return box[0]


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (checks, small metadata)."""
    dist = _require()
    out: list[Any] = [None] * int(dist.get_world_size(_state["group"]))
    dist.all_gather_object(out, obj, group=_state["group"])
    return out


def _global(group_rank: int) -> int:
    group = _state["group"]
    if group is None:
        return group_rank
    return int(_dist().get_global_rank(group, group_rank))


def shutdown() -> None:
    """Finish the engines' last messages and leave the process group if ``init`` made it.

    After a ``SyncError`` the group is broken: its connections are cut first, so every
    pending operation ends at once, and the process can exit with the user's exit code.
    """
    engines = list(_engines)
    broken = _release(engines)
    _engines.clear()
    if _state["owns_group"] and not broken:
        destroy_process_group()
    else:
        let_gloo_release()
    _state.update(group=None, initialized=False, owns_group=False)


def _release(engines: list[Any]) -> bool:
    """Close ``engines``; when one failed, cut the group's connections and wait (bounded)
    for their threads to leave Gloo. Whether one had failed."""
    broken = any(e.error is not None for e in engines)
    if broken:
        _connections.cut()  # the failed engines' threads leave Gloo, and close waits
    for each in engines:
        try:
            each.close(5.0 if broken else None)
        except Exception:  # noqa: BLE001 - a failed engine's close re-raises nothing new
            pass
    return broken


_hooked = False


def _at_exit() -> None:
    """At interpreter exit, release a broken group's engines before finalization starts
    (see ``casync.teardown``), for scripts that exit without ``shutdown()``."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    import threading

    register = getattr(threading, "_register_atexit", None)  # before threads are reaped
    if register is None:
        import atexit

        register = atexit.register

    def release() -> None:
        engines = [e for e in list(_engines) if e.error is not None]
        if engines:
            _release(engines)

    register(release)


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group`` that is safe as a script's last step."""
    dist = _dist()
    if dist.is_initialized():
        dist.destroy_process_group()
    let_gloo_release()


def _group_destroyed(group: Any) -> None:
    """A process group was destroyed (by the user or by ``shutdown``); casync closed the
    engines on it: forget them, and the group if it was ours or the default one."""
    if group is None or group is _state["group"]:
        for engine in [e for e in list(_engines) if group is None
                       or e.group is group]:
            _engines.discard(engine)
        _state.update(group=None, initialized=False, owns_group=False)


lifecycle.on_destroy(_group_destroyed)
