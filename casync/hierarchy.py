"""The ``hierarchical`` topology: compress only what crosses between nodes.

On a node of L ranks (GPUs with NVLink, or processes sharing a host) the links inside
the node are much faster than the network between nodes, and compressing traffic that
never leaves the node costs kernel time and accuracy for nothing. So a step goes in three
levels, as BytePS, ZeRO++ and Bagua's hierarchical modes do:

1. inside each node, an uncompressed reduce-scatter (float32, or float16/bfloat16 to
   halve its bytes) over the node's ranks: local rank j holds slice j of its node's mean;
2. across nodes, local rank j averages slice j with the local ranks j of the other
   nodes through an ordinary CaSync engine (compressed ps, ring or allgather, with error
   feedback) on the group of those ranks;
3. inside each node again, an all-gather of the slices.

Every rank then holds the same bits: a slice's value comes from one cross-node engine,
whose members agree bit for bit, and the all-gather copies it unchanged. The step's
tensors are packed in order into packs of ``pack_elems`` elements, and the three levels
are pipelined pack by pack on two threads (reduce-scatter and cross-node submit; wait,
all-gather and write-back), each level on process groups of its own so that their
collectives never interleave.

Node membership: torchrun's ``LOCAL_WORLD_SIZE`` (ranks are numbered node by node), or an
explicit ``ranks_per_node``.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from hipress.errors import ConfigError, SyncError

from . import lifecycle, staging
from .plan import COMPRESSED, HIERARCHICAL
from .settings import agree, default_timeout, publish_invalid

__all__ = ["Hierarchical", "Layout", "INTRA_DTYPES", "PACK_ELEMS"]

#: The dtypes the intra-node levels may travel in (the cross-node level is float32).
INTRA_DTYPES = ("float32", "float16", "bfloat16")
#: Elements per pack: a 25 MB DDP bucket makes about three packs, which pipelines the
#: levels without paying a collective's fixed cost per tensor.
PACK_ELEMS = 2 << 20
_END = None  # a step's end on the stage queues
_STATE_FORMAT = 1


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


class _Wire:
    """The engine's traffic, both levels (what ``Synchronizer.transport`` reports)."""

    def __init__(self, group: Any, rank: int, size: int, inner: Any) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.inner = inner
        self.intra_bytes = 0
        self.intra_collectives = 0

    @property
    def bytes_sent(self) -> int:
        return int(self.inner.bytes_sent) + self.intra_bytes

    @property
    def across_bytes(self) -> int:
        """Bytes sent to other nodes."""
        return int(self.inner.bytes_sent)

    @property
    def messages_sent(self) -> int:
        return int(self.inner.messages_sent)

    @property
    def collectives(self) -> int:
        return int(self.inner.collectives) + self.intra_collectives


@dataclass
class _Segment:
    """Elements [start, stop) of a submitted tensor, cut into one part per local rank:
    part j, elements ``bounds[j]:bounds[j + 1]``, sits at ``offsets[j]`` of the pack's
    region j. The cuts follow the tensor alone (never the order or the buckets it came
    in), so each rank reduces the same elements, and keeps their residuals, every step."""

    entry: _Entry
    bounds: list[int]
    offsets: list[int]


class _Entry:
    __slots__ = ("name", "tensor", "flat", "work", "left", "batch")

    def __init__(self, name: str, tensor: Any, batch: _Batch) -> None:
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


class _Batch:
    """A ``submit``/``submit_many``'s future and the tensors it waits for."""

    __slots__ = ("future", "left", "value")

    def __init__(self, future: Any, left: int, value: Any) -> None:
        self.future, self.left, self.value = future, left, value


class _Pack:
    """Consecutive segments of a step's tensors, synchronized as one flat buffer."""

    __slots__ = ("number", "segments", "numel", "regions", "slice", "future", "device")

    def __init__(self, number: int, local: int) -> None:
        self.number = number
        self.segments: list[_Segment] = []
        self.numel = 0
        self.regions = [0] * local  # elements of each local rank's region so far
        self.slice: Any = None
        self.future: Any = None
        self.device: Any = None


class Hierarchical:
    """A ``Synchronizer`` over nodes: uncompressed inside a node, compressed across.

    Made by ``Synchronizer(algorithm, "hierarchical", ...)``; it takes the same calls
    (``submit``, ``submit_many``, ``flush``, ``synchronize``, ``end_step``, ``close``,
    ``state_dict``, ``load_state_dict``).

    Args:
        algorithm: the CompLL algorithm across nodes, or ``"none"``.
        across: the topology across nodes: ``ps``, ``ring`` or ``allgather``.
        ranks_per_node: ranks per node (default ``LOCAL_WORLD_SIZE``).
        intra_dtype: what the intra-node levels send: ``float32``, ``float16`` or
            ``bfloat16`` (the values are rounded to it once, on every rank alike).
        pack_elems: elements per pipelined pack.
        group: the job's group (default the world); its ranks must be numbered node by
            node.
        timeout: seconds before a silent peer raises ``SyncError``.
        **options: the cross-node engine's (``plan``, ``min_compress`` — compared with
            the slice each rank sends across, ``error_feedback``, ``seed``, ...) and the
            algorithm's parameters.

    Raises:
        ConfigError: a bad setting, or ranks that disagree on the layout.
        SyncError: a rank did not reach the settings check within ``timeout``.
    """

    def __init__(self, algorithm: str | None = "onebit", topology: str = HIERARCHICAL, *,
                 across: str = "ps", ranks_per_node: int | None = None,
                 intra_dtype: str = "float32", pack_elems: int = PACK_ELEMS,
                 group: Any = None, timeout: float | None = None, **options: Any) -> None:
        import torch
        import torch.distributed as dist

        from .synchronizer import Synchronizer

        try:
            if topology != HIERARCHICAL:
                raise ConfigError(f"Hierarchical runs topology {HIERARCHICAL!r}, not "
                                  f"{topology!r}")
            if across not in COMPRESSED:
                raise ConfigError(f"across must be one of {', '.join(COMPRESSED)}, not "
                                  f"{across!r}")
            if intra_dtype not in INTRA_DTYPES:
                raise ConfigError(f"intra_dtype must be one of {', '.join(INTRA_DTYPES)}, "
                                  f"not {intra_dtype!r}")
            if isinstance(pack_elems, bool) or not isinstance(pack_elems, int) \
                    or pack_elems < 1:
                raise ConfigError(f"pack_elems must be an integer >= 1, not {pack_elems!r}")
            seconds = default_timeout() if timeout is None else float(timeout)
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.layout = Layout.of(self.rank, self.size, ranks_per_node)
        except ConfigError as exc:
            publish_invalid(exc, group)
            raise
        layout = self.layout
        members = list(range(self.size)) if group is None else \
            [int(dist.get_global_rank(group, r)) for r in range(self.size)]
        if members != list(range(dist.get_world_size())):
            error = ConfigError("the hierarchical topology runs on a group of the whole "
                                "job (its node groups are made by every rank)")
            publish_invalid(error, group)
            raise error
        # The layout first: ranks that disagree would otherwise make different groups.
        agree({"hierarchical layout": (layout.nodes, layout.local_size),
               "intra-node dtype": intra_dtype, "pack elements": pack_elems,
               "topology across nodes": across}, group, self.rank, self.size, seconds)
        self.intra_dtype = getattr(torch, intra_dtype)
        self.pack_elems = pack_elems
        self.timeout = seconds
        self._groups = _make_groups(layout, members, seconds)
        self.inner = Synchronizer(algorithm, across, group=self._groups["cross"],
                                  timeout=seconds, **options)
        lifecycle.forget(self.inner)  # closed by this engine, after its own threads
        self.config = self.inner.config
        self.transport = _Wire(group, self.rank, self.size, self.inner.transport)
        self.executor = self.inner.executor
        # -- the step in progress (the caller's thread)
        self.step = 0
        self.names: set[str] = set()
        self._pack = _Pack(0, self.layout.local_size)
        self._packs = 0
        self._waiter = _Waiter(self)
        # -- the pipeline: two stages, each a thread fed in order
        self.error: SyncError | None = None
        self._reduce: queue.Queue[Any] = queue.Queue()
        self._gather: queue.Queue[Any] = queue.Queue()
        self._ended = threading.Semaphore(0)  # a step's last pack is back
        self._open_steps = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._stage, args=(q, work, last), daemon=True,
                             name=f"hipress-{name}")
            for name, q, work, last in (("intra-reduce", self._reduce, self._scatter, False),
                                        ("intra-gather", self._gather, self._collect, True))]
        for thread in self._threads:
            thread.start()
        lifecycle.register(self)

    # -- what the plugins and the benchmarks read -------------------------------------

    @property
    def planner(self) -> Any:
        return self.inner.planner

    def codec_params(self) -> dict[str, Any] | None:
        return self.inner.codec_params()

    # -- the step ---------------------------------------------------------------------

    def submit(self, name: str, tensor: Any) -> Any:
        """Queue ``tensor`` to be averaged in place (``Synchronizer.submit``); the future
        resolves to it."""
        return self._queue([(name, tensor)], tensor)

    def submit_many(self, tensors: Any) -> Any:
        """Queue ``(name, tensor)`` pairs, in order, with one future for them all
        (``Synchronizer.submit_many``); it resolves to the list of the tensors."""
        items = list(tensors)
        return self._queue(items, [t for _, t in items])

    def _queue(self, items: list[tuple[str, Any]], value: Any) -> Any:
        self._check_usable()
        seen = set(self.names)
        for name, _ in items:
            if name in seen:
                raise ConfigError(f"tensor {name!r} was already submitted in step "
                                  f"{self.step}; call synchronize() to finish the step first")
            seen.add(name)
        batch = _Batch(staging.future(self._waiter), 0, value)
        entries = [_Entry(name, tensor, batch) for name, tensor in items]
        if not self.names and entries:
            with self._lock:
                self._open_steps += 1
        self.names.update(name for name, _ in items)
        full: list[_Pack] = []
        for entry in entries:
            self._place(entry, full)
        if batch.left == 0:
            batch.future.set_result(value)
        # Sent once every count is final: the gather stage counts them down.
        for pack in full:
            self._send(pack)
        return batch.future

    def _place(self, entry: _Entry, full: list[_Pack]) -> None:
        """Add ``entry``'s elements to the packs, in pieces of at most ``pack_elems`` cut
        at fixed offsets of the tensor; the packs that fill go to ``full``."""
        n, local = entry.flat.numel(), self.layout.local_size
        for start in range(0, n, self.pack_elems):
            stop = min(n, start + self.pack_elems)
            pack = self._pack
            if pack.segments and pack.device != entry.flat.device:
                full.append(self._next_pack())
                pack = self._pack
            pack.device = entry.flat.device
            bounds = [start + (stop - start) * j // local for j in range(local + 1)]
            pack.segments.append(_Segment(entry, bounds, list(pack.regions)))
            for j in range(local):
                pack.regions[j] += bounds[j + 1] - bounds[j]
            entry.left += 1
            pack.numel += stop - start
            if pack.numel >= self.pack_elems:
                full.append(self._next_pack())
        if n:
            entry.batch.left += 1

    def _next_pack(self) -> _Pack:
        pack = self._pack
        self._packs += 1
        self._pack = _Pack(self._packs, self.layout.local_size)
        return pack

    def _send(self, pack: _Pack) -> None:
        self._reduce.put(pack)

    def flush(self) -> None:
        """Nothing: packs are cut by size alone (and at the step's end), not where a
        caller's buckets end, so that each rank's slice covers the same elements, and
        its residuals follow them, whatever the buckets are from one run to the next."""

    def _send_partial(self) -> None:
        """Send the pack still filling: a future is waited on before the step ends."""
        if self._pack.segments:
            self._send(self._next_pack())

    def end_step(self) -> None:
        """Close the step without waiting: send its last pack and advance."""
        if not self.names:
            return
        self._send_partial()
        self._reduce.put(_END)
        self.names.clear()
        self.step += 1

    def synchronize(self) -> None:
        """Finish the step: every tensor holds the average once it returns.

        Raises:
            SyncError: a peer died, stalled past the timeout or sent bad data.
        """
        self.end_step()
        self._settle()

    def _settle(self) -> None:
        while True:
            with self._lock:
                if self._open_steps == 0:
                    break
            if not self._ended.acquire(timeout=self.timeout * 3):
                raise SyncError(f"step {self.step - 1} did not finish within "
                                f"{self.timeout * 3:g} s")
            with self._lock:
                self._open_steps -= 1
        if self.error is not None:
            raise self.error

    def _check_usable(self) -> None:
        if self.error is not None:
            raise SyncError(f"the synchronizer failed earlier ({self.error}); restart the "
                            "job")

    # -- the two stages (their threads) -----------------------------------------------

    def _stage(self, source: queue.Queue[Any], work: Any, last: bool) -> None:
        """Run ``work`` on each item of ``source`` in order; hand it on to the gather
        stage (``last`` False); after a failure, fail the packs' futures instead."""
        while True:
            item = source.get()
            if item is _STOP:
                return
            if self.error is None:
                try:
                    work(item)
                except BaseException as exc:  # noqa: BLE001 - any failure fails the step
                    self._fail(exc)
            if self.error is not None and item is not _END:
                _reject(item, self.error)
            if not last:
                self._gather.put(item)
            elif item is _END:
                self._ended.release()

    def _scatter(self, pack: _Pack | None) -> None:
        """Reduce-scatter ``pack`` inside the node, then send this rank's slice across."""
        import torch
        import torch.distributed as dist

        if pack is None:  # the step's end
            self.inner.end_step()
            return
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
            self._collective("reduce-scatter", pack, lambda: dist.reduce_scatter_single(
                mine, flat, group=self._groups[("reduce", pack.device.type)]))
            self.transport.intra_bytes += (local - 1) * share * flat.element_size()
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
        pack.future = self.inner.submit_many(pieces)
        self.inner.flush()

    def _collect(self, pack: _Pack | None) -> None:
        """Wait for ``pack``'s slice across nodes, all-gather it, write it back."""
        import torch
        import torch.distributed as dist

        if pack is None:
            return
        # Not the future's own wait, which would flush the engine from this thread.
        torch.futures.Future.wait(pack.future)
        local = self.layout.local_size
        mine = pack.slice if self.intra_dtype == torch.float32 else \
            pack.slice.to(self.intra_dtype)
        if local > 1:
            full = torch.empty(mine.numel() * local, dtype=mine.dtype, device=mine.device)
            self._collective("all-gather", pack, lambda: dist.all_gather_single(
                full, mine, group=self._groups[("gather", pack.device.type)]))
            self.transport.intra_bytes += (local - 1) * mine.numel() * mine.element_size()
        else:
            full = mine
        done: list[_Entry] = []
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
            batch = entry.batch
            batch.left -= 1
            if batch.left == 0:
                batch.future.set_result(batch.value)

    def _collective(self, what: str, pack: _Pack, call: Any) -> None:
        self.transport.intra_collectives += 1
        try:
            call()
        except RuntimeError as exc:
            ranks = self.layout.node_ranks(self.layout.node)
            raise SyncError(f"step {self.step}: the intra-node {what} of pack {pack.number} "
                            f"among ranks {ranks} (node {self.layout.node}) failed: "
                            f"{str(exc).splitlines()[0][:300]}") from exc

    def _fail(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = exc if isinstance(exc, SyncError) else \
            SyncError(f"the hierarchical step failed: {exc!r}")

    # -- between steps ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cross-node engine's state and this layout (``Synchronizer.state_dict``)."""
        self._between_steps("state_dict")
        return {"hierarchical": _STATE_FORMAT, "layout": self._layout_fields(),
                "step": self.step, "engine": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from a ``state_dict`` of the same rank and layout.

        Raises:
            ConfigError: the state is not a hierarchical engine's, or of another layout.
        """
        self._between_steps("load_state_dict")
        if not isinstance(state, dict) or state.get("hierarchical") != _STATE_FORMAT:
            raise ConfigError("not a hierarchical engine's state; save one with "
                              "state_dict() of an engine with topology 'hierarchical'")
        if state["layout"] != self._layout_fields() and not reset_residuals:
            raise ConfigError(f"the state was saved with layout {state['layout']}, this "
                              f"engine has {self._layout_fields()} (field 'layout'): load "
                              "it into a job of the same nodes and ranks per node")
        self.inner.load_state_dict(state["engine"], reset_residuals)
        self.step = int(state["step"])

    def _layout_fields(self) -> dict[str, Any]:
        return {"nodes": self.layout.nodes, "ranks per node": self.layout.local_size,
                "intra dtype": str(self.intra_dtype).removeprefix("torch.")}

    def _between_steps(self, what: str) -> None:
        if self.names:
            raise ConfigError(f"{what}() came in the middle of step {self.step}; call it "
                              "after synchronize() and before the next backward")
        self._settle()

    def close(self) -> None:
        """Finish the last step, stop the stages, close the cross-node engine."""
        try:
            if self.error is None:
                self.end_step()
                self._settle()
        finally:
            lifecycle.forget(self)
            for q in (self._reduce, self._gather):
                q.put(_STOP)
            if self.error is None:
                for thread in self._threads:
                    thread.join(5.0)
            self.inner.close()


_STOP = object()


class _Waiter:
    """What a future flushes when waited on before its step ends (``staging.future``)."""

    def __init__(self, engine: Hierarchical) -> None:
        self.engine = engine

    def flush(self) -> None:
        self.engine._send_partial()


def _failed(future: Any, result: Any) -> bool:
    try:
        future.value()
    except BaseException as exc:  # noqa: BLE001
        result.set_exception(exc)
        return True
    return False


def _reject(pack: _Pack, error: SyncError) -> None:
    for seg in pack.segments:
        future = seg.entry.batch.future
        if not future.done():
            future.set_exception(error)


def _make_groups(layout: Layout, members: list[int], timeout: float) -> dict[Any, Any]:
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

