"""An engine's settings: validated where a user passes them, compared across ranks through
the job's key-value store before anything collective runs.

Every wrapper (the DDP hook's state, ``DistributedOptimizer``, TensorFlow's tape and Keras
optimizer, MXNet's KVStore and trainer) and the ``Synchronizer`` itself build a
``Settings`` from the user's arguments, so a bad value is a ``ConfigError`` at
construction, with the same message everywhere. ``agree`` then compares the ranks'
settings with store keys instead of a collective: a rank whose settings were invalid
leaves its error there (``publish_invalid``), and a rank that never comes is named when
the timeout runs out, so no rank meets a raw Gloo error or waits on the process group's
own half-hour timeout.
"""

from __future__ import annotations

import difflib
import math
import os
import pickle
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from compll import load
from compll.payload import VERSION, algorithm_id
from hipress_base.errors import ConfigError, SyncError
from hipress_base.version import __version__

from .chunks import CHUNK_ELEMS
from .health import default_store
from .links import cuda_transport_of
from .plan import COMPRESSED, DEFAULT_ALGORITHM, HIERARCHICAL, MIN_COMPRESS

__all__ = ["Settings", "EngineConfig", "PLANS", "STRATEGIES", "DEFAULT_ALGORITHM",
           "default_algorithm", "default_timeout", "agree", "publish_invalid"]

#: The topologies a user chooses (``none``, a plain allreduce, is algorithm "none").
STRATEGIES = (*COMPRESSED, HIERARCHICAL)
#: ``static``: a size threshold and one topology; ``auto``: the cost-model planner.
PLANS = ("static", "auto")
_PREFIX = "hipress/settings"
#: Seconds a failing rank 0 keeps the job's store up for the others to read its error.
_LINGER = 10.0


def default_algorithm() -> str:
    """The algorithm of a wrapper given none: ``HIPRESS_ALGORITHM`` (what ``hipress run
    --algorithm`` sets), else ``DEFAULT_ALGORITHM``."""
    return os.environ.get("HIPRESS_ALGORITHM", "").strip() or DEFAULT_ALGORITHM


def default_timeout() -> float:
    """Seconds a peer may stay silent: ``HIPRESS_TIMEOUT``, else 300."""
    raw = os.environ.get("HIPRESS_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"HIPRESS_TIMEOUT={raw!r} is not a number of seconds") from None
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"HIPRESS_TIMEOUT must be a positive number of seconds, not {raw}")
    return value


def _choice(what: str, value: Any, allowed: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in allowed:
        return value
    close = difflib.get_close_matches(value, allowed, 1) if isinstance(value, str) else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{what} must be one of {', '.join(allowed)}, not {value!r}{hint}")


def _number(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Settings:
    """What an engine runs with, checked and normalised.

    Attributes:
        algorithm: a CompLL algorithm name or ``.cll`` path; None for plain allreduces.
        topology: ``ps``, ``ring``, ``allgather`` or ``hierarchical`` (``none`` when
            ``algorithm`` is None, except ``hierarchical``, which still has two levels).
        plan: ``static`` or ``auto``.
        min_compress: static plans allreduce tensors below this many elements.
        error_feedback: None (on for biased algorithms), True or False.
        timeout: seconds a peer may stay silent.
        params: the algorithm's parameter overrides, sorted by name.
        guard: the engine's rules on top of the plan (``casync.guard``): the first steps
            uncompressed, row-sparse gradients never compressed.
    """

    algorithm: str | None
    topology: str
    plan: str
    min_compress: int
    error_feedback: bool | None
    timeout: float
    params: tuple[tuple[str, Any], ...]
    guard: bool = False

    @classmethod
    def of(cls, algorithm: str | None = DEFAULT_ALGORITHM, topology: str = "ps",
           plan: str = "static", min_compress: int = MIN_COMPRESS,
           error_feedback: bool | None = None, timeout: float | None = None,
           guard: bool = False, **params: Any) -> Settings:
        """Check every argument; the parameters against the algorithm's own declarations
        (types, ranges, names, with a "did you mean" for a misspelled one).

        Raises:
            ConfigError: the first bad value, and why.
            CompileError: ``algorithm`` is a ``.cll`` file that does not compile.
        """
        if algorithm is not None and not isinstance(algorithm, str):
            raise ConfigError(f"algorithm must be a name or a .cll path, not {algorithm!r}")
        algo = None if algorithm in (None, "none") else algorithm
        topo = _choice("topology", topology, STRATEGIES)
        chosen = _choice("plan", plan, PLANS)
        if isinstance(min_compress, bool) or not isinstance(min_compress, int) \
                or min_compress < 0:
            raise ConfigError(f"min_compress must be an integer >= 0, not {min_compress!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ConfigError(f"error_feedback must be True, False or None, not "
                              f"{error_feedback!r}")
        if not isinstance(guard, bool):
            raise ConfigError(f"guard must be True or False, not {guard!r}")
        if timeout is None:
            seconds = default_timeout()
        else:
            seconds = _number("timeout", timeout)
            if not seconds > 0 or math.isinf(seconds):
                raise ConfigError(f"timeout must be a positive number of seconds, not "
                                  f"{timeout!r}")
        if algo is None:
            if params:
                raise ConfigError(f"algorithm='none' takes no parameters, got "
                                  f"{', '.join(sorted(params))}")
            topo = topo if topo == HIERARCHICAL else "none"
        else:
            load(algo, **params)  # the algorithm's own checks: names, types, requires
        return cls(algo, topo, chosen, int(min_compress), error_feedback, seconds,
                   tuple(sorted(params.items())), guard)

    def feedback_for(self, unbiased: bool) -> bool:
        """Whether residuals are kept for a codec: the setting, or biased codecs only."""
        return (not unbiased) if self.error_feedback is None else self.error_feedback


@dataclass(frozen=True)
class EngineConfig:
    """What a ``Synchronizer`` runs with, checked: its settings and the engine's own
    arguments. Every rank must run the same (``agreement``).

    Attributes:
        settings: the user's settings (``Settings``).
        custom_planner: the caller gave a ``Planner`` object instead of a plan name.
        chunk_elems: a chunk is sent once it holds this many elements.
        seed: the RNG seed of stochastic algorithms.
        target: where the kernels run (``compll.codec``'s ``target``).
        cuda_transport: how CUDA tensors' messages travel: ``staged``, ``nccl`` or a
            test's transport (``casync.links.cuda_transport_of``).
    """

    settings: Settings
    custom_planner: bool
    chunk_elems: int
    seed: int
    target: str
    cuda_transport: Any

    @classmethod
    def of(cls, algorithm: str | None = DEFAULT_ALGORITHM, topology: str = "ps",
           planner: Any = None, *, plan: str | None = None, min_compress: int | None = None,
           error_feedback: bool | None = None, timeout: float | None = None,
           chunk_elems: Any = CHUNK_ELEMS, seed: int = 0, target: str = "auto",
           cuda_transport: Any = None, guard: bool = False, **params: Any) -> EngineConfig:
        """An engine's arguments, checked: the one place they are (``planner`` a
        ``Planner`` object, or a plan name as the wrappers' ``plan=`` takes; the rest as
        ``casync.Synchronizer`` documents them).

        Raises:
            ConfigError: the first bad value, and why.
            CompileError: ``algorithm`` is a ``.cll`` file that does not compile.
        """
        custom = planner is not None and not isinstance(planner, str)
        if custom:
            if plan is not None or min_compress is not None:
                raise ConfigError("pass a Planner as planner= or plan=/min_compress=, "
                                  "not both")
            chosen = "static"
        else:
            if planner is not None and plan is not None and planner != plan:
                raise ConfigError(f"planner={planner!r} and plan={plan!r} disagree; pass one")
            chosen = plan if plan is not None else (planner if planner is not None
                                                    else "static")
        settings = Settings.of(algorithm, topology, chosen,
                               MIN_COMPRESS if min_compress is None else min_compress,
                               error_feedback, timeout, guard, **params)
        if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, int) \
                or chunk_elems < 1:
            raise ConfigError(f"chunk_elems must be an integer >= 1, not {chunk_elems!r}")
        return cls(settings, custom, int(chunk_elems), int(seed), target,
                   cuda_transport_of(cuda_transport))

    @classmethod
    def resolve(cls, algorithm: str | None | EngineConfig, topology: str, planner: Any,
                options: dict[str, Any]) -> EngineConfig:
        """An engine's settings: ``algorithm`` when it is already an ``EngineConfig``
        (``casync.engine`` and the plugins check once and pass it down; a ``Planner``
        object then makes its plan the caller's), else the arguments checked now.

        Raises:
            ConfigError: checked settings given with more settings, or a bad value.
        """
        if not isinstance(algorithm, EngineConfig):
            return cls.of(algorithm, topology, planner, **options)
        if options:
            raise ConfigError(f"an engine takes checked settings or the arguments to "
                              f"check, not both ({', '.join(sorted(options))})")
        custom = planner is not None and not isinstance(planner, str)
        return algorithm.planned_by_caller() if custom else algorithm

    def planned_by_caller(self) -> EngineConfig:
        """These settings for an engine given its ``Planner`` object (a static plan)."""
        return replace(self, custom_planner=True,
                       settings=replace(self.settings, plan="static"))

    def across(self, topology: str) -> EngineConfig:
        """These settings with ``topology`` (a hierarchical engine's cross-node level)."""
        return replace(self, settings=replace(self.settings, topology=topology))

    @property
    def auto(self) -> bool:
        """The engine plans with a ``CostPlanner`` on its group's measured costs."""
        return (self.settings.plan == "auto" and self.settings.algorithm is not None
                and not self.custom_planner)

    def agreement(self, planner: Any, probe: Any) -> dict[str, Any]:
        """The fields every rank must share, named as a disagreement names them; settings
        that mean the same compare equal (``error_feedback=None`` is the codec's
        default). ``probe`` is the codec of the engine's algorithm (None without one)."""
        settings = self.settings
        fields: dict[str, Any] = {
            "hipress version": __version__,
            "payload format version": VERSION,
            "algorithm": settings.algorithm,
            "topology": settings.topology,
            "plan": "auto" if self.auto else repr(planner),
            "seed": self.seed,
            "chunk elements": self.chunk_elems,
            "guard": settings.guard,
            "CUDA transport": self.cuda_transport if isinstance(self.cuda_transport, str)
            else type(self.cuda_transport).__name__,
        }
        if probe is not None:
            fields["error feedback"] = settings.feedback_for(probe.unbiased)
            fields["algorithm parameters"] = probe.params
            fields["DSL hash"] = f"{algorithm_id(probe.program):08x}"
        return fields


# -- agreement through the store ---------------------------------------------------------

_slots = [0]  # the settings checks this process has made, in order
_slots_lock = threading.Lock()


def _next_slot() -> int:
    """The number of this settings check: every rank counts its engines (and its invalid
    settings) in the same order, so equal numbers meet in the store."""
    with _slots_lock:
        _slots[0] += 1
        return _slots[0] - 1


def _world_store() -> Any:
    """The default group's store: one namespace whichever group an engine runs on (a
    plugin's Gloo group may not exist yet when a rank's settings fail)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return default_store(None)


def _members(group: Any, size: int) -> list[int]:
    """The global ranks of ``group``'s members, in group rank order."""
    import torch.distributed as dist

    if group is None:
        return list(range(size))
    return [int(dist.get_global_rank(group, r)) for r in range(size)]


def publish_invalid(error: Exception, group: Any = None) -> None:
    """Tell the other ranks that this rank's settings were invalid (the error's text), in
    the slot of the settings check it will not make; nothing without a process group.
    Rank 0, which hosts the job's store, keeps it up a little for them to read it."""
    try:
        import torch.distributed as dist

        store = _world_store()
        if store is None or dist.get_world_size() == 1:
            return
        rank, size = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no group, no store: the others time out instead
        return
    slot = _next_slot()
    try:
        store.set(f"{_PREFIX}/{slot}/{rank}", pickle.dumps({"invalid": str(error)}))
    except Exception:  # noqa: BLE001 - best effort: the others then time out
        return
    _linger(store, slot, rank, list(range(size)))


def agree(fields: dict[str, Any], group: Any, rank: int, size: int, timeout: float) -> None:
    """Compare ``fields`` with every other rank's, within ``timeout`` seconds.

    Raises:
        ConfigError: a field differs (named, with both values), or a rank's settings were
            invalid (its message).
        SyncError: a rank did not come within ``timeout``, or the store went away.
    """
    if size == 1:
        return
    store = _world_store()
    if store is None:  # a group without a store we can reach: compare over the group
        _agree_by_collective(fields, group, size)
        return
    members = _members(group, size)
    me = members[rank]
    slot = _next_slot()
    keys = [f"{_PREFIX}/{slot}/{m}" for m in members]
    try:
        store.set(keys[rank], pickle.dumps(fields))
        gathered = _gather(store, keys, members, timeout)
    except ConfigError:  # a rank's settings were invalid
        _read(store, slot, me)
        _linger(store, slot, me, members)
        raise
    except SyncError:
        _read(store, slot, me)
        raise
    except Exception as exc:  # noqa: BLE001 - the store's host (rank 0) is gone
        raise SyncError(f"the job's store (on rank 0) stopped answering while the ranks "
                        f"compared settings: {exc}") from None
    _read(store, slot, me)
    try:
        _compare(gathered, members)
    except ConfigError:
        _linger(store, slot, me, members)
        raise


def _read(store: Any, slot: int, me: int) -> None:
    """Note that this rank has read (or given up on) ``slot``: rank 0 may stop hosting."""
    try:
        store.set(f"{_PREFIX}/{slot}/read/{me}", b"1")
    except Exception:  # noqa: BLE001 - best effort
        pass


def _gather(store: Any, keys: list[str], members: list[int],
            timeout: float) -> list[dict[str, Any]]:
    seen: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        for r, key in enumerate(keys):
            if r not in seen and store.check([key]):
                seen[r] = pickle.loads(store.get(key))
                if "invalid" in seen[r]:
                    raise ConfigError(f"rank {members[r]}'s settings are invalid: "
                                      f"{seen[r]['invalid']}")
        if len(seen) == len(keys):
            return [seen[r] for r in range(len(keys))]
        if time.monotonic() > deadline:
            missing = [str(members[r]) for r in range(len(keys)) if r not in seen]
            raise SyncError(f"rank(s) {', '.join(missing)} did not reach HiPress's settings "
                            f"check within {timeout:g} s (they failed before it, or create "
                            "their engines in another order)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _compare(gathered: list[dict[str, Any]], members: list[int]) -> None:
    reference = gathered[0]
    for index, other in enumerate(gathered):
        for name in reference:
            if other.get(name) != reference[name]:
                raise ConfigError(
                    f"ranks disagree on {name}: rank {members[0]} has {reference[name]!r}, "
                    f"rank {members[index]} has {other.get(name)!r}; start every rank with "
                    "the same HiPress version, algorithm and settings")


def _agree_by_collective(fields: dict[str, Any], group: Any, size: int) -> None:
    import torch.distributed as dist

    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, fields, group=group)
    _compare(gathered, list(range(size)))


def _linger(store: Any, slot: int, me: int, members: list[int]) -> None:
    """On global rank 0, which hosts the job's store: keep it up until every other member
    has read ``slot``, for at most ``_LINGER`` seconds."""
    if me != 0:
        return
    deadline = time.monotonic() + _LINGER
    others = [f"{_PREFIX}/{slot}/read/{m}" for m in members if m != me]
    while time.monotonic() < deadline:
        try:
            if store.check(others):
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.05)
