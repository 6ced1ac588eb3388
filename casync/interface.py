"""The one interface every engine offers (``Engine``), and the factory that builds one.

``engine(...)`` takes the settings once checked (an ``EngineConfig``, as the plugins build
it) or the arguments to check, and returns a flat ``Synchronizer``, or a
``Hierarchical`` engine (``casync.hierarchy``) for ``topology="hierarchical"`` and for
``plan="auto"`` on a job of several nodes. Callers use only what ``Engine`` names; the
hierarchical engine composes flat ones through the same interface.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

from hipress_base.errors import ConfigError

from .hierarchy import LEVEL_OPTIONS, Hierarchical
from .plan import DEFAULT_ALGORITHM, HIERARCHICAL
from .settings import EngineConfig, publish_invalid
from .synchronizer import Synchronizer
from .transport import Transport

__all__ = ["Engine", "engine"]


@runtime_checkable
class Engine(Protocol):
    """What a caller of an engine may use: a step's tensors in, their averages out, its
    health, its traffic and its state."""

    def submit(self, name: str, tensor: Any) -> Any:
        """Queue ``tensor`` to be averaged in place; a future resolving to it."""

    def submit_many(self, tensors: Iterable[tuple[str, Any]]) -> Any:
        """Queue ``(name, tensor)`` pairs; one future resolving to the tensors."""

    def flush(self) -> None:
        """Send what is queued now (a DDP bucket ended)."""

    def end_step(self) -> None:
        """Close the step without waiting (its futures are waited on by the caller)."""

    def synchronize(self) -> None:
        """Finish the step: every tensor holds its average."""

    @property
    def error(self) -> BaseException | None:
        """What broke the engine, or None."""

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent."""

    @property
    def group(self) -> Any:
        """The process group the engine runs on."""

    def take_trace(self) -> list[Any] | None:
        """The tasks run since the last call; None without ``trace``."""

    def state_dict(self) -> dict[str, Any]:
        """What the engine carries between steps, to checkpoint."""

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()`` of the same rank."""

    def close(self, wait: float | None = None) -> None:
        """Finish the last step and stop the engine's threads."""


def engine(algorithm: EngineConfig | str | None = DEFAULT_ALGORITHM, topology: str = "ps", *,
           group: Any = None, planner: Any = None, transport: Transport | None = None,
           nccl_group: Any = None, trace: bool = False, **options: Any) -> Engine:
    """An engine on ``group``.

    Args:
        algorithm: the settings, checked (an ``EngineConfig``, as the plugins pass it);
            or the algorithm, with ``topology`` and ``options`` as ``casync.Synchronizer``
            takes them, checked here. ``topology="hierarchical"`` also takes ``across``,
            ``ranks_per_node``, ``intra_dtype``, ``pack_elems``
            (``casync.hierarchy.Hierarchical``).
        group: the Gloo process group (default the world).
        planner: a ``Planner`` object deciding per tensor (tests, FSDP2's reduce-scatter).
        transport, nccl_group, trace: as ``casync.Synchronizer`` takes them.

    Raises:
        ConfigError: a bad setting (the other ranks learn it at their settings check).

    Example:
        >>> sync = casync.engine("onebit", "ring", group=group)
        >>> sync.submit_many(model.named_gradients()); sync.synchronize()
    """
    levels = {k: options.pop(k) for k in LEVEL_OPTIONS if k in options}
    try:
        config = EngineConfig.resolve(algorithm, topology, planner, options)
        hierarchical = config.settings.topology == HIERARCHICAL
        if levels and not hierarchical:
            raise ConfigError(f"{', '.join(sorted(levels))} apply to topology "
                              f"{HIERARCHICAL!r} only, not {config.settings.topology!r}")
    except ConfigError as exc:
        publish_invalid(exc, transport.group if transport is not None else group)
        raise
    if hierarchical:
        return Hierarchical(config, group=group, planner=planner, trace=trace, **levels)
    if transport is None and _on_nodes(config, group):  # config.auto: no Planner given
        # plan="auto" on several nodes: each tensor flat or through the levels
        return Hierarchical(config, group=group, trace=trace,
                            across=config.settings.topology, levels="auto")
    return Synchronizer(config, planner=planner, group=group, transport=transport,
                        nccl_group=nccl_group, trace=trace)


def _on_nodes(config: EngineConfig, group: Any) -> bool:
    """``plan="auto"`` on the whole job of several nodes of several ranks (torchrun's
    ``LOCAL_WORLD_SIZE``): the planner then also chooses flat or hierarchical."""
    if not config.auto:
        return False
    import torch.distributed as dist

    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if not local.isdigit() or not dist.is_initialized():
        return False
    world = dist.get_world_size()
    whole = group is None or dist.get_world_size(group) == world
    return whole and 1 < int(local) < world and world % int(local) == 0
