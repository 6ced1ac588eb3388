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

from .plan import COMPRESSED, HIERARCHICAL

__all__ = ["Layout", "Wire", "Segment", "PackEntry", "Batch", "Pack", "Packer",
           "make_groups", "reject", "check_levels", "whole_job", "INTRA_DTYPES", "PACK_ELEMS",
           "LEVEL_OPTIONS"]

#: The dtypes the intra-node levels may travel in (the cross-node level is float32).
INTRA_DTYPES = ("float32", "float16", "bfloat16")
#: Elements per pack: a 25 MB DDP bucket makes about three packs, which pipelines the
#: levels without paying a collective's fixed cost per tensor.
PACK_ELEMS = 2 << 20
#: What ``casync.engine`` passes to a hierarchical engine beside its settings.
LEVEL_OPTIONS = ("across", "ranks_per_node", "intra_dtype", "pack_elems", "levels")


def check_levels(across: str, intra_dtype: str, pack_elems: Any, levels: str) -> None:
    """The levels' own settings (the cross-node level's are the engine's settings)."""
    if across not in COMPRESSED:
        raise ConfigError(f"across must be one of {', '.join(COMPRESSED)}, not {across!r}")
    if intra_dtype not in INTRA_DTYPES:
        raise ConfigError(f"intra_dtype must be one of {', '.join(INTRA_DTYPES)}, "
                          f"not {intra_dtype!r}")
    if isinstance(pack_elems, bool) or not isinstance(pack_elems, int) or pack_elems < 1:
        raise ConfigError(f"pack_elems must be an integer >= 1, not {pack_elems!r}")
    if levels not in (HIERARCHICAL, "auto"):
        raise ConfigError(f"levels must be {HIERARCHICAL!r} or 'auto', not {levels!r}")


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
    nodes (through their ``bytes_sent``, as any caller reads an engine) and its own
    intra-node collectives."""

    def __init__(self, engines: list[Any]) -> None:
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


class Packer:
    """Cuts a step's tensors into packs of about ``pack_elems`` elements, in order, each
    tensor at fixed offsets of its own and into one part per local rank (so each rank
    reduces the same elements every step, whatever buckets they came in)."""

    def __init__(self, local: int, pack_elems: int) -> None:
        self.local = local
        self.pack_elems = pack_elems
        self.pack = Pack(0, local)
        self.made = 0

    def place(self, entry: PackEntry, full: list[Pack]) -> None:
        """Add ``entry``'s elements to the packs, in pieces of at most ``pack_elems``; the
        packs that fill go to ``full``."""
        n, local = entry.flat.numel(), self.local
        for start in range(0, n, self.pack_elems):
            stop = min(n, start + self.pack_elems)
            if self.pack.segments and self.pack.device != entry.flat.device:
                full.append(self.close())
            pack = self.pack
            pack.device = entry.flat.device
            bounds = [start + (stop - start) * j // local for j in range(local + 1)]
            pack.segments.append(Segment(entry, bounds, list(pack.regions)))
            for j in range(local):
                pack.regions[j] += bounds[j + 1] - bounds[j]
            entry.left += 1
            pack.numel += stop - start
            if pack.numel >= self.pack_elems:
                full.append(self.close())
        if n:
            entry.batch.left += 1

    def filling(self) -> bool:
        """Whether the pack being filled holds anything."""
        return bool(self.pack.segments)

    def close(self) -> Pack:
        """The pack being filled, and a new one in its place."""
        pack = self.pack
        self.made += 1
        self.pack = Pack(self.made, self.local)
        return pack


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


def whole_job(group: Any, size: int) -> list[int]:
    """The global ranks of ``group``: every rank of the job, in order, or a ConfigError
    (each level's groups are made by every rank)."""
    import torch.distributed as dist

    members = list(range(size)) if group is None else \
        [int(dist.get_global_rank(group, r)) for r in range(size)]
    if members != list(range(dist.get_world_size())):
        raise ConfigError("the hierarchical topology runs on a group of the whole job (its "
                          "node groups are made by every rank)")
    return members
