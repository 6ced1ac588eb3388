"""The hierarchical engine's two levels inside a node (``casync.hierarchy``): a pack's
uncompressed reduce-scatter over the node's ranks before its slices cross nodes, and the
all-gather that gives every rank the whole pack after.

Each level runs on process groups of its own (``levels.make_groups``), so that the two
stage threads' collectives never interleave; a collective that fails names its pack, its
step and the node's ranks.
"""

from __future__ import annotations

from typing import Any

from hipress_base.errors import SyncError

from .levels import Layout, Pack, PackEntry, Wire

__all__ = ["NodeLevels"]


class NodeLevels:
    """The intra-node collectives of one rank's packs.

    Args:
        layout: the nodes and this rank's place among them.
        groups: the levels' process groups, by (level, device type).
        intra_dtype: the torch dtype the levels send in.
        wire: counts the bytes and collectives they send.
    """

    def __init__(self, layout: Layout, groups: dict[Any, Any], intra_dtype: Any,
                 wire: Wire) -> None:
        self.layout = layout
        self.groups = groups
        self.intra_dtype = intra_dtype
        self.wire = wire

    def reduce_scatter(self, pack: Pack, step: int) -> list[tuple[str, Any]]:
        """Reduce-scatter ``pack`` over the node: ``pack.slice`` becomes this rank's part
        of the node's mean (float32); returns its pieces, named, to average across."""
        import torch
        import torch.distributed as dist

        local, me = self.layout.local_size, self.layout.local_rank
        share = max(pack.regions)  # every region padded to the longest
        flat = torch.zeros(share * local, dtype=self.intra_dtype, device=pack.device)
        for seg in pack.segments:
            for j in range(local):
                lo, hi = seg.bounds[j], seg.bounds[j + 1]
                at = j * share + seg.offsets[j]
                flat[at:at + hi - lo].copy_(seg.entry.flat[lo:hi])
        if local > 1:
            mine = torch.empty(share, dtype=self.intra_dtype, device=pack.device)
            self._collective("reduce-scatter", pack, step, lambda: dist.reduce_scatter_single(
                mine, flat, group=self.groups[("reduce", pack.device.type)]))
            self.wire.intra_bytes += (local - 1) * share * flat.element_size()
        else:
            mine = flat
        pack.slice = mine.float() if mine.dtype != torch.float32 else mine
        if local > 1:
            pack.slice.mul_(1.0 / local)
        pieces = []
        for seg in pack.segments:
            lo, hi = seg.bounds[me], seg.bounds[me + 1]
            if lo < hi:
                at = seg.offsets[me]
                pieces.append((f"{seg.entry.name}[{lo}:{hi}]", pack.slice[at:at + hi - lo]))
        return pieces

    def all_gather(self, pack: Pack, step: int) -> list[PackEntry]:
        """All-gather ``pack``'s averaged slices over the node and write them into their
        tensors; returns the entries this pack completed."""
        import torch
        import torch.distributed as dist

        local = self.layout.local_size
        mine = pack.slice if self.intra_dtype == torch.float32 else \
            pack.slice.to(self.intra_dtype)
        if local > 1:
            full = torch.empty(mine.numel() * local, dtype=mine.dtype, device=mine.device)
            self._collective("all-gather", pack, step, lambda: dist.all_gather_single(
                full, mine, group=self.groups[("gather", pack.device.type)]))
            self.wire.intra_bytes += (local - 1) * mine.numel() * mine.element_size()
        else:
            full = mine
        done: list[PackEntry] = []
        share = mine.numel()
        for seg in pack.segments:
            for j in range(local):
                lo, hi = seg.bounds[j], seg.bounds[j + 1]
                at = j * share + seg.offsets[j]
                seg.entry.flat[lo:hi].copy_(full[at:at + hi - lo])
            seg.entry.left -= 1
            if seg.entry.left == 0:
                done.append(seg.entry)
        for entry in done:
            if entry.work is not entry.tensor:
                entry.tensor.copy_(entry.work)
        return done

    def _collective(self, what: str, pack: Pack, step: int, call: Any) -> None:
        self.wire.intra_collectives += 1
        try:
            call()
        except RuntimeError as exc:
            ranks = self.layout.node_ranks(self.layout.node)
            raise SyncError(f"step {step}: the intra-node {what} of pack {pack.number} "
                            f"among ranks {ranks} (node {self.layout.node}) failed: "
                            f"{str(exc).splitlines()[0][:300]}") from exc
