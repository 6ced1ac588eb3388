"""Per-tensor plans: whether to compress, with which algorithm, topology and partitions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from compll import MAX_ELEMENTS
from hipress_base.errors import ConfigError

__all__ = ["TOPOLOGIES", "COMPRESSED", "SCATTER", "HIERARCHICAL", "OWNED", "MIN_COMPRESS",
           "DEFAULT_ALGORITHM", "Plan", "Planner", "Learner", "Greedy", "StaticPlanner",
           "StepTimer"]

#: The topologies that compress an allreduce, each a graph builder of ``casync.graphs``,
#: in the order planners list them (the first is the default).
COMPRESSED = ("ps", "ring", "allgather")
#: A compressed reduce-scatter (sharded data parallelism): rank j receives shard j of
#: every rank's tensor and leaves their mean in its own shard only.
SCATTER = "scatter"
#: Uncompressed inside a node, compressed across nodes (``casync.hierarchy``): an
#: engine of its own over per-node and cross-node groups, not a graph of one chunk.
HIERARCHICAL = "hierarchical"
#: Every topology the engine can execute: ``none`` is a plain allreduce.
TOPOLOGIES = (*COMPRESSED, SCATTER, "none")
#: Topologies whose segments each have an owner rank that reduces them.
OWNED = ("ps", "ring", SCATTER)

#: Elements below which a static plan does not compress (256 KB of float32). BytePS
#: stops at 64 KB; we go higher because a codec's few scales for a small layer cost
#: accuracy while its bytes cost little: on the digits example (4 ranks, 2 epochs)
#: compressing the 28,960-element output layer with onebit cost 12 points.
MIN_COMPRESS = 65536

#: What the engine and the plugins' wrappers compress with when the user names no
#: algorithm: a quantizer, which keeps magnitudes (docs/casync.md, "What no codec is
#: given").
DEFAULT_ALGORITHM = "cgx"


@dataclass(frozen=True)
class Plan:
    """What the engine does with one tensor (or one bucket of fused small tensors).

    Attributes:
        topology: ``ps``, ``ring``, ``allgather``, ``scatter`` (a reduce-scatter: each
            rank keeps only its shard's mean) or ``none`` (uncompressed allreduce).
        algorithm: the CompLL algorithm; ``None`` exactly when ``topology == "none"``.
        partitions: K, the number of pieces the tensor is cut into and pipelined.
        params: algorithm parameter overrides.
    """

    topology: str
    algorithm: str | None = None
    partitions: int = 1
    params: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ConfigError(f"unknown topology {self.topology!r}; "
                              f"choose one of {', '.join(TOPOLOGIES)}")
        if (self.algorithm is None) != (self.topology == "none"):
            raise ConfigError("a plan compresses (algorithm set, topology "
                              "ps|ring|allgather|scatter) or does not (algorithm None, "
                              "topology 'none')")
        if self.partitions < 1:
            raise ConfigError(f"partitions must be at least 1, not {self.partitions}")

    @property
    def compress(self) -> bool:
        return self.algorithm is not None

    def partitions_for(self, numel: int) -> int:
        """K for a tensor of ``numel`` elements: the plan's, at most one per element, and
        enough that each compressed partition fits one codec call (``MAX_ELEMENTS``)."""
        k = max(1, min(self.partitions, numel))
        return max(k, -(-numel // MAX_ELEMENTS)) if self.compress else k


class Planner(Protocol):
    """Anything that maps a tensor to a plan; the same on every rank for the same input."""

    def plan(self, name: str, numel: int, world_size: int) -> Plan: ...


@runtime_checkable
class Learner(Protocol):
    """A planner that learns the model from the engine's steps: the engine reports each
    step's tensors as it queues them and the end of every step
    (``casync.model.planner.CostPlanner`` plans the whole model then)."""

    def plan(self, name: str, numel: int, world_size: int) -> Plan: ...

    def observe(self, tensors: list[tuple[str, int]]) -> None: ...

    def end_step(self, world: int, chunk_elems: int) -> None: ...


class StepTimer(Protocol):
    """Times the engine's own steps for the profiler (``Synchronizer.time_steps``): the
    median seconds of ``reps`` steps of ``count`` tensors of ``size`` floats on
    ``transport``'s group, planned by ``planner``, in chunks of ``chunk_elems``."""

    def __call__(self, transport: Any, planner: Planner, algorithm: str, chunk_elems: int,
                 count: int, size: int, reps: int) -> float: ...


@runtime_checkable
class Greedy(Protocol):
    """A planner that chooses each tensor's plan on the lanes of a simulated iteration,
    and may follow a whole-model plan it fitted (``casync.model.planner.CostPlanner``)."""

    lanes: Any
    fitted: Planner | None

    def plan(self, name: str, numel: int, world_size: int) -> Plan: ...

    def choose(self, name: str, numel: int, world: int, ready: float = 0.0) -> Any: ...


class StaticPlanner:
    """A fixed strategy with a size threshold, like BytePS's min-compress-bytes.

    Buffers below ``min_compress`` elements go uncompressed; larger ones use
    ``algorithm`` over ``topology``, cut into ``ceil(bytes / partition_bytes)`` pieces,
    at most one per rank (so ps spreads a tensor over every aggregator).

    Example:
        >>> StaticPlanner("onebit", "ring").plan("fc.weight", 4_000_000, 4)
        Plan(topology='ring', algorithm='onebit', partitions=4, params=())
    """

    def __init__(self, algorithm: str | None = DEFAULT_ALGORITHM, topology: str = "ps",
                 min_compress: int = MIN_COMPRESS, partition_bytes: int = 4 << 20,
                 **params: Any) -> None:
        if topology not in TOPOLOGIES:
            raise ConfigError(f"unknown topology {topology!r}; choose one of "
                              f"{', '.join(TOPOLOGIES)}")
        if algorithm in (None, "none") or topology == "none":
            algorithm, topology = None, "none"
        if min_compress < 0 or partition_bytes < 1:
            raise ConfigError("min_compress must be >= 0 and partition_bytes >= 1")
        self.algorithm = algorithm
        self.topology = topology
        self.min_compress = int(min_compress)
        self.partition_bytes = int(partition_bytes)
        self.params = tuple(sorted(params.items()))
        self._plans: dict[tuple[bool, int], Plan] = {}
        self._by_size: dict[tuple[int, int], Plan] = {}

    def plan(self, name: str, numel: int, world_size: int) -> Plan:
        plan = self._by_size.get((numel, world_size))  # asked per tensor per step
        if plan is not None:
            return plan
        k = max(1, min(world_size, math.ceil(numel * 4 / self.partition_bytes)))
        raw = self.algorithm is None or numel < self.min_compress or world_size == 1
        plan = self._plans.get((raw, k))
        if plan is None:
            plan = self._plans[(raw, k)] = Plan("none", None, k) if raw else \
                Plan(self.topology, self.algorithm, k, self.params)
        if len(self._by_size) < 4096:  # a model has far fewer distinct sizes
            self._by_size[(numel, world_size)] = plan
        return plan

    def __repr__(self) -> str:
        return (f"StaticPlanner({self.algorithm!r}, {self.topology!r}, "
                f"min_compress={self.min_compress}, partition_bytes={self.partition_bytes})")
