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

import queue
import threading
from typing import Any

from hipress_base.errors import ConfigError, SyncError

from . import lifecycle, staging
from .levels import (
    INTRA_DTYPES,
    LEVEL_OPTIONS,
    PACK_ELEMS,
    Batch,
    Layout,
    Pack,
    PackEntry,
    Packer,
    Wire,
    check_levels,
    make_groups,
    reject,
    whole_job,
)
from .nodelevels import NodeLevels
from .plan import HIERARCHICAL
from .settings import EngineConfig, agree, publish_invalid

__all__ = ["Hierarchical", "Layout", "INTRA_DTYPES", "PACK_ELEMS", "LEVEL_OPTIONS"]

_END = None  # a step's end on the stage queues
_STATE_FORMAT = 1


class Hierarchical:
    """An engine over nodes: uncompressed inside a node, compressed across.

    Made by ``casync.engine(algorithm, "hierarchical", ...)``; it offers the same calls
    (``casync.Engine``) and runs flat ``Synchronizer``s across nodes through them.

    Args:
        config: the checked settings (``casync.settings.EngineConfig``): the algorithm,
            plan, timeout and parameters of the cross-node level.
        across: the topology across nodes: ``ps``, ``ring`` or ``allgather``.
        ranks_per_node: ranks per node (default ``LOCAL_WORLD_SIZE``).
        levels: ``hierarchical``, or ``auto``: with ``plan="auto"`` on several nodes,
            each tensor goes flat (a ``Synchronizer`` over every rank) or through the
            levels, as ``casync.model.planner.LevelChooser`` predicts faster (what
            ``casync.engine(..., plan="auto")`` makes on a job of several nodes).
        intra_dtype: what the intra-node levels send: ``float32``, ``float16`` or
            ``bfloat16`` (the values are rounded to it once, on every rank alike).
        pack_elems: elements per pipelined pack.
        group: the job's group (default the world); its ranks must be numbered node by
            node.
        planner: the cross-node engine's ``Planner`` object, if the caller has one.
        trace: the cross-node engine records its tasks.

    Raises:
        ConfigError: a bad setting, or ranks that disagree on the layout.
        SyncError: a rank did not reach the settings check within the timeout.
    """

    def __init__(self, config: EngineConfig, *, across: str = "ps",
                 ranks_per_node: int | None = None, intra_dtype: str = "float32",
                 pack_elems: int = PACK_ELEMS, group: Any = None, levels: str = HIERARCHICAL,
                 planner: Any = None, trace: bool = False) -> None:
        import torch
        import torch.distributed as dist

        seconds = config.settings.timeout
        try:
            check_levels(across, intra_dtype, pack_elems, levels)
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            self.layout = Layout.of(self.rank, self.size, ranks_per_node)
            members = whole_job(group, self.size)
        except ConfigError as exc:
            publish_invalid(exc, group)
            raise
        layout = self.layout
        # The layout first: ranks that disagree would otherwise make different groups.
        agree({"hierarchical layout": (layout.nodes, layout.local_size),
               "intra-node dtype": intra_dtype, "pack elements": pack_elems,
               "topology across nodes": across}, group, self.rank, self.size, seconds)
        self.intra_dtype = getattr(torch, intra_dtype)
        self.timeout = seconds
        self._group = group
        self._groups = make_groups(layout, members, seconds)
        self.flat: Any = None
        self.chooser: Any = None
        self._engines(config.across(across), group, levels, planner, trace)
        self.config = self.inner.config
        self.wire = Wire([e for e in (self.inner, self.flat) if e is not None])
        self.nodes = NodeLevels(layout, self._groups, self.intra_dtype, self.wire)
        self._flat_futures: list[Any] = []  # the step in progress's, from the flat engine
        self._flat_waiting: list[Any] = []
        # -- the step in progress (the caller's thread)
        self.step = 0
        self.names: set[str] = set()
        self._packer = Packer(self.layout.local_size, pack_elems)
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

    def _engines(self, config: EngineConfig, group: Any, levels: str, planner: Any,
                 trace: bool) -> None:
        """The cross-node engine, and with ``levels="auto"`` the flat one; with
        ``plan="auto"`` both plan on one profile of the whole job that fitted the two
        links apart (measured once, then cached)."""
        from .model.planner import CostPlanner, LevelChooser
        from .model.profiler import cached
        from .synchronizer import Synchronizer
        from .transport import Transport

        layout = self.layout
        cross = self._groups["cross"]
        algorithm = config.settings.algorithm
        if not (config.auto and layout.nodes > 1 and layout.local_size > 1):
            self.inner = Synchronizer(config, group=cross, trace=trace, planner=planner)
            lifecycle.forget(self.inner)  # closed by this engine, after its own threads
            return
        assert algorithm is not None
        cost = cached(Transport(group), (algorithm,), config.target,
                      steps=Synchronizer.time_steps, per_node=layout.local_size)
        planned = config.planned_by_caller()
        self.inner = Synchronizer(planned, group=cross, trace=trace,
                                  planner=CostPlanner(cost.cross(layout.nodes), (algorithm,)))
        lifecycle.forget(self.inner)
        if levels == "auto":
            self.flat = Synchronizer(planned, group=group, trace=trace,
                                     planner=CostPlanner(cost.flat(), (algorithm,)))
            lifecycle.forget(self.flat)
            self.chooser = LevelChooser(cost, layout.nodes, (algorithm,))

    # -- what every engine reports (casync.Engine) -------------------------------

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent, both levels."""
        return self.wire.bytes_sent

    @property
    def group(self) -> Any:
        return self._group

    def take_trace(self) -> list[Any] | None:
        """The cross-node engine's tasks since the last call (``Synchronizer``'s)."""
        return self.inner.take_trace()

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
        batch = Batch(staging.future(self._waiter), 0, value)
        entries = [PackEntry(name, tensor, batch) for name, tensor in items]
        flat: list[PackEntry] = []
        if self.chooser is not None:  # plan="auto": each tensor flat or through the levels
            hierarchical = self.chooser.hierarchical
            flat = [e for e in entries if not hierarchical(e.flat.numel())]
            entries = [e for e in entries if hierarchical(e.flat.numel())]
        if not self.names and items:
            with self._lock:
                self._open_steps += 1
        self.names.update(name for name, _ in items)
        full: list[Pack] = []
        for entry in entries:
            self._packer.place(entry, full)
        if flat:
            batch.left += 1
            future = self.flat.submit_many((e.name, e.tensor) for e in flat)
            self._flat_futures.append(future)
            future.then(lambda done: self._flat_done(batch, done))
        elif batch.left == 0:
            batch.future.set_result(value)
        # Sent once every count is final: the gather stage counts them down.
        for pack in full:
            self._send(pack)
        return batch.future

    def _flat_done(self, batch: Batch, done: Any) -> None:
        """The flat engine finished a batch's flat tensors (on its thread)."""
        try:
            done.value()
        except BaseException as exc:  # noqa: BLE001 - the engine's error fails ours
            self._fail(exc)
            if not batch.future.done():
                batch.future.set_exception(self.error)
            return
        self._count_down(batch)

    def _count_down(self, batch: Batch) -> None:
        with self._lock:  # the gather stage and the flat engine both count
            batch.left -= 1
            last = batch.left == 0
        if last and not batch.future.done():
            batch.future.set_result(batch.value)

    def _send(self, pack: Pack) -> None:
        self._reduce.put(pack)

    def flush(self) -> None:
        """Send the flat engine's chunks. Packs are cut by size alone (and at the step's
        end), not where a caller's buckets end, so that each rank's slice covers the
        same elements, and its residuals follow them, whatever the buckets are from one
        run to the next."""
        if self.flat is not None:
            self.flat.flush()

    def _send_partial(self) -> None:
        """Send the pack still filling: a future is waited on before the step ends."""
        if self._packer.filling():
            self._send(self._packer.close())

    def end_step(self) -> None:
        """Close the step without waiting: send its last pack and advance."""
        if not self.names:
            return
        self._send_partial()
        self._reduce.put(_END)
        if self._flat_futures:  # every rank routed alike: the flat engine has a step too
            self.flat.end_step()
        # what synchronize() waits for: this step's (a DDP hook waits on its own futures)
        self._flat_waiting, self._flat_futures = self._flat_futures, []
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
        futures, self._flat_waiting = self._flat_waiting, []
        for future in futures:
            try:
                future.wait()
            except BaseException as exc:  # noqa: BLE001 - raised below as the engine's
                self._fail(exc)
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
                reject(item, self.error)
            if not last:
                self._gather.put(item)
            elif item is _END:
                self._ended.release()

    def _scatter(self, pack: Pack | None) -> None:
        """Reduce-scatter ``pack`` inside the node, then send this rank's slice across."""
        if pack is None:  # the step's end
            self.inner.end_step()
            return
        pack.future = self.inner.submit_many(self.nodes.reduce_scatter(pack, self.step))
        self.inner.flush()

    def _collect(self, pack: Pack | None) -> None:
        """Wait for ``pack``'s slice across nodes, all-gather it, write it back."""
        import torch

        if pack is None:
            return
        # Not the future's own wait, which would flush the engine from this thread.
        torch.futures.Future.wait(pack.future)
        for entry in self.nodes.all_gather(pack, self.step):
            self._count_down(entry.batch)

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
                "step": self.step, "engine": self.inner.state_dict(),
                "flat": None if self.flat is None else self.flat.state_dict()}

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
        if self.flat is not None and state.get("flat"):
            self.flat.load_state_dict(state["flat"], reset_residuals)
        self.step = int(state["step"])

    def _layout_fields(self) -> dict[str, Any]:
        return {"nodes": self.layout.nodes, "ranks per node": self.layout.local_size,
                "intra dtype": str(self.intra_dtype).removeprefix("torch.")}

    def _between_steps(self, what: str) -> None:
        if self.names:
            raise ConfigError(f"{what}() came in the middle of step {self.step}; call it "
                              "after synchronize() and before the next backward")
        self._settle()

    def close(self, wait: float | None = None) -> None:
        """Finish the last step, stop the stages, close the cross-node engine (``wait``
        as ``Synchronizer.close`` takes it)."""
        try:
            if self.error is None:
                self.end_step()
                self._settle()
        finally:
            lifecycle.forget(self)
            for q in (self._reduce, self._gather):
                q.put(_STOP)
            own = (5.0 if self.error is None else 0.0) if wait is None else wait
            for thread in self._threads if own > 0 else ():
                thread.join(own)
            self.inner.close(wait)  # each flat engine's default follows its own health
            if self.flat is not None:
                self.flat.close(wait)


_STOP = object()


class _Waiter:
    """What a future flushes when waited on before its step ends (``staging.future``)."""

    def __init__(self, engine: Hierarchical) -> None:
        self.engine = engine

    def flush(self) -> None:
        self.engine._send_partial()


