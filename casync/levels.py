"""What the hierarchical topology (``casync.hierarchy``) works on: where a rank sits
(``Layout``), the process groups of its levels, its traffic counters, and the packs a
step's tensors are cut into."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError, SyncError

__all__ = ["Layout", "Wire", "Segment", "PackEntry", "Batch", "Pack", "make_groups",
           "reject"]


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: ``nodes`` nodes of ``local_size`` ranks, numbered node by node.

    Attributes:
        nodes: the number of nodes.
        local_size: ranks per node (L).
        node: this rank's node.
        local_rank: this rank's index on its node.
    """

    nodes: int
    local_size: int
    node: int
    local_rank: int

    @classmethod
    def of(cls, rank: int, size: int, ranks_per_node: int | None = None) -> Layout:
        """The layout of ``rank`` in a job of ``size`` ranks.

        Raises:
            ConfigError: no ``ranks_per_node`` and no ``LOCAL_WORLD_SIZE``, or one that
                does not divide the job.
        """
        from_launcher = ranks_per_node is None
        if from_launcher:
            raw = os.environ.get("LOCAL_WORLD_SIZE")
            if raw is None:
                raise ConfigError("the hierarchical topology needs the ranks per node: "
                                  "launch with torchrun or hipress run (LOCAL_WORLD_SIZE), "
                                  "or pass ranks_per_node=")
            try:
                ranks_per_node = int(raw)
            except ValueError:
                raise ConfigError(f"LOCAL_WORLD_SIZE={raw!r} is not a number") from None
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
                or ranks_per_node < 1 or size % ranks_per_node:
            raise ConfigError(f"ranks_per_node must be a positive divisor of the job's "
                              f"{size} ranks, not {ranks_per_node!r}")
        group_rank = os.environ.get("GROUP_RANK")
        node, local = divmod(rank, ranks_per_node)
        if from_launcher and group_rank is not None and group_rank.isdigit() \
                and int(group_rank) != node:
            raise ConfigError(f"rank {rank} is on node {group_rank} (GROUP_RANK), but "
                              f"{ranks_per_node} ranks per node put it on node {node}: the "
                              "hierarchical topology needs ranks numbered node by node, "
                              "as torchrun numbers them")
        return cls(size // ranks_per_node, ranks_per_node, node, local)

    def node_ranks(self, node: int) -> list[int]:
        return [node * self.local_size + j for j in range(self.local_size)]

    def cross_ranks(self, local: int) -> list[int]:
        return [n * self.local_size + local for n in range(self.nodes)]


class Wire:
    """A hierarchical engine's traffic, both levels: the flat engines' it runs across
    nodes (through their ``bytes_sent``) and its own intra-node collectives."""

    def __init__(self, rank: int, size: int, engines: list[Any]) -> None:
        self.rank, self.size = rank, size
        self.engines = engines  # the cross-node engine, and the flat one
        self.intra_bytes = 0
        self.intra_collectives = 0

    @property
    def bytes_sent(self) -> int:
        return self.across_bytes + self.intra_bytes

    @property
    def across_bytes(self) -> int:
        """Bytes sent by the engines whose messages may cross nodes."""
        return sum(int(e.bytes_sent) for e in self.engines)

    @property
    def messages_sent(self) -> int:
        """Messages of the flat engines (this engine built them: it reads their
        transports, which no caller of an engine does)."""
        return sum(int(e.transport.messages_sent) for e in self.engines)

    @property
    def collectives(self) -> int:
        return sum(int(e.transport.collectives) for e in self.engines) + \
            self.intra_collectives


@dataclass
class Segment:
    """Elements [start, stop) of a submitted tensor, cut into one part per local rank:
    part j, elements ``bounds[j]:bounds[j + 1]``, sits at ``offsets[j]`` of the pack's
    region j. The cuts follow the tensor alone (never the order or the buckets it came
    in), so each rank reduces the same elements, and keeps their residuals, every step."""

    entry: PackEntry
    bounds: list[int]
    offsets: list[int]


class PackEntry:
    __slots__ = ("name", "tensor", "flat", "work", "left", "batch")

    def __init__(self, name: str, tensor: Any, batch: Batch) -> None:
        import torch

        if isinstance(tensor, np.ndarray):
            if tensor.dtype.kind != "f":
                raise ConfigError(f"gradients must be floating point, not {tensor.dtype}")
            tensor = torch.from_numpy(tensor)
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(f"submit() takes a torch tensor or NumPy array, not "
                              f"{type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise ConfigError(f"gradients must be floating point, not {tensor.dtype}")
        self.name = name
        self.tensor = tensor.detach()
        # a strided tensor is worked on in a contiguous copy, copied back at the end
        self.work = self.tensor if self.tensor.is_contiguous() else self.tensor.contiguous()
        self.flat = self.work.view(-1)
        self.left = 0  # segments not yet written back
        self.batch = batch


class Batch:
    """A ``submit``/``submit_many``'s future and the tensors it waits for."""

    __slots__ = ("future", "left", "value")

    def __init__(self, future: Any, left: int, value: Any) -> None:
        self.future, self.left, self.value = future, left, value


class Pack:
    """Consecutive segments of a step's tensors, synchronized as one flat buffer."""

    __slots__ = ("number", "segments", "numel", "regions", "slice", "future", "device")

    def __init__(self, number: int, local: int) -> None:
        self.number = number
        self.segments: list[Segment] = []
        self.numel = 0
        self.regions = [0] * local  # elements of each local rank's region so far
        self.slice: Any = None
        self.future: Any = None
        self.device: Any = None


def reject(pack: Pack, error: SyncError) -> None:
    for seg in pack.segments:
        future = seg.entry.batch.future
        if not future.done():
            future.set_exception(error)


def make_groups(layout: Layout, members: list[int], timeout: float) -> dict[Any, Any]:
    """This rank's groups: its node's, twice per backend (reduce-scatter and all-gather
    never share a group, so the two stages' collectives cannot interleave), and its
    cross-node line. Every rank makes every group, in the same order."""
    import torch.distributed as dist

    wait = timedelta(seconds=timeout)
    backends = ["gloo"] + (["nccl"] if "nccl" in str(dist.get_backend()) else [])
    me = members.index(dist.get_rank())
    mine: dict[Any, Any] = {}
    for node in range(layout.nodes):
        ranks = [members[r] for r in layout.node_ranks(node)]
        for backend in backends:
            for level in ("reduce", "gather"):
                made = dist.new_group(ranks, backend=backend, timeout=wait) \
                    if layout.local_size > 1 else None
                if me // layout.local_size == node:
                    mine[(level, "cuda" if backend == "nccl" else "cpu")] = made
    for local in range(layout.local_size):
        ranks = [members[r] for r in layout.cross_ranks(local)]
        made = dist.new_group(ranks, backend="gloo", timeout=wait)
        if me % layout.local_size == local:
            mine["cross"] = made
    return mine
