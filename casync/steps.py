"""An engine's steps: the tensors of the step in progress, the chunks they fill, the
graphs that synchronize them, and how each finished graph resolves its tensors'
futures."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

from hipress_base.errors import SyncError

from .chunks import Chunk, Chunker, Entry
from .codecs import Codecs
from .executor import Executor, Graph
from .graphs import BUILDERS, Context, slots
from .guard import Guard, PlanDump, dumping
from .links import Links
from .plan import SCATTER, Learner, Plan, Planner
from .staging import Completion, give_back
from .transport import tag_space

__all__ = ["Steps"]


class Steps:
    """The step in progress and the graphs of earlier steps still in flight.

    Args:
        transport: the engine's transport.
        planner: plans each tensor (the engine replaces it when a state loads).
        codecs: the engine's codecs and residuals.
        links: how chunks travel, by memory.
        executor: runs the graphs.
        chunk_elems: a chunk is sent once it holds this many elements.
        timeout: seconds a send of an earlier step may take to complete.
        guard: the rules applied on top of the planner's plans (``casync.guard``), or None.
    """

    def __init__(self, transport: Any, planner: Planner, codecs: Codecs, links: Links,
                 executor: Executor, chunk_elems: int, timeout: float,
                 guard: Guard | None = None) -> None:
        # -- what the steps run on (the engine's, shared)
        self.transport = transport
        self.planner = planner  # a property: see below
        self.codecs = codecs
        self.links = links
        self.executor = executor
        self.timeout = timeout
        self.guard = guard
        self._dump = PlanDump(transport.rank) if dumping() else None
        # -- the step in progress
        self.number = 0
        self.names: set[str] = set()  # submitted this step
        self.chunker = Chunker(transport.size, chunk_elems)
        self.tag = 0  # the first message tag of the next graph
        self.graphs: list[Graph] = []
        # -- earlier steps: closed, their sends possibly still in flight
        self.previous: list[Graph] = []
        # -- kept across steps for the graphs (``casync.context.Context``): buffers, batch rows
        self.pool: dict[Hashable, Any] = {}
        self.rows: dict[Hashable, Any] = {}
        # Graphs finish on the executor's threads; entries and completions they share
        # are counted down under this lock.
        self._lock = threading.Lock()

    @property
    def planner(self) -> Planner:
        return self._planner

    @planner.setter
    def planner(self, planner: Planner) -> None:
        self._planner = planner
        # Asked once here, not per submit: a protocol check costs microseconds.
        self._learner = planner if isinstance(planner, Learner) else None

    def queue(self, entries: list[Entry]) -> None:
        """Chunk ``entries`` and launch the chunks they fill, once all are placed."""
        size = self.transport.size
        if self._learner is not None:
            self._learner.observe([(entry.name, entry.numel) for entry in entries])
        plan = self._planner.plan
        plans = [plan(e.name, e.numel, size) for e in entries]
        if self.guard is not None or self._dump is not None:
            plans = self._ruled(entries, plans)
        for chunk in self.chunker.add_many(entries, plans):
            self.launch(chunk)

    def _ruled(self, entries: list[Entry], plans: list[Plan]) -> list[Plan]:
        """The guard's rules applied to the planner's ``plans``, dumped if asked."""
        names = [e.name for e in entries]
        why: list[str | None] = [None] * len(plans)
        if self.guard is not None:
            plans, why = self.guard.adjust(self.number, names, plans)
        if self._dump is not None:
            self._dump.show(self.number, names, [e.numel for e in entries], plans, why)
        return plans

    def flush(self) -> None:
        """Send the chunks still filling."""
        for chunk in self.chunker.flush():
            self.launch(chunk)

    def end(self) -> None:
        """Close the step without waiting: send its last chunks, let the planner learn
        the model, and advance."""
        self.flush()
        self.chunker.end_step()
        self.previous.extend(self.graphs)
        self.graphs = []
        self.names.clear()
        if self._learner is not None:
            self._learner.end_step(self.transport.size, self.chunker.chunk_elems)
        self.number += 1

    def settle(self) -> None:
        """Wait until earlier steps' graphs finished and their sends completed.

        Raises:
            SyncError: a graph failed, or a send did not complete within the timeout.
        """
        timeout = self.timeout
        graphs, self.previous = self.previous, []
        for graph in graphs:
            graph.finished.wait()
        if self.executor.error is not None:
            raise self.executor.error
        for handle in (h for g in graphs for h in g.sends):
            try:
                self.transport.wait(handle, timeout)
            except BaseException as exc:  # noqa: BLE001
                raise SyncError(f"step {self.number - 1}: a send to rank {handle.peer} did "
                                f"not complete within {timeout:g} s: {exc}") from exc

    def launch(self, chunk: Chunk) -> None:
        """Build the graph that synchronizes ``chunk`` and hand it to the executor."""
        plan = chunk.plan
        codec = self.codecs.of(plan) if plan.compress else None
        link = self.links.of(chunk.segments[0].entry.memory if chunk.segments else None)
        ctx = Context(self.transport, codec, self.codecs.feedback(codec) if codec else None,
                      self.number, self.tag, chunk, self.pool, self.rows, link)
        self.tag = (self.tag + slots(plan.topology, self.transport.size)) % tag_space
        graph = Graph(lambda: chunk.label, self.number)
        try:  # building touches the device (its stream, the events): CUDA errors raise here
            with link.memory.active():  # the engine's stream waits for the gradients
                if link.memory.cuda:  # host memory has nothing to wait for
                    for entry in _entries(chunk):
                        link.memory.after(entry.ready)
                BUILDERS[plan.topology](ctx, graph)
        except RuntimeError as exc:  # torch's error type for a backend's failure
            error = self.executor.reject(graph, exc)
            _fail(chunk, error)
            raise error from exc
        step = self.number
        graph.on_done = lambda: self._finish(chunk, link, step)
        graph.on_error = lambda error: _fail(chunk, error)
        self.graphs.append(graph)
        self.executor.add(graph)

    def _finish(self, chunk: Chunk, link: Any, step: int) -> None:
        """``chunk``'s graph (of ``step``) is done: give back the tensors it completed and
        resolve the futures all of whose tensors are now complete."""
        with self._lock:
            finished = [seg.entry for seg in chunk.segments if seg.entry.segment_done()]
        if self.guard is not None and self.guard.watching(step) \
                and chunk.plan.topology != SCATTER:
            with link.memory.active():  # on a GPU, after the engine's decodes
                for entry in finished:  # the average, the same bits on every rank
                    self.guard.inspect(entry.name, entry.buf)
        counts: dict[Completion, int] = {}
        # On the engine's stream: a write-back copy and the future's event follow the
        # decodes.
        with link.memory.active():
            for entry in finished:
                give_back(entry)
                counts[entry.future] = counts.get(entry.future, 0) + 1
            # Counted after the write-backs: other graphs finish tensors of the same batch.
            with self._lock:
                complete = [c for c, count in counts.items() if c.finished(count)]
            for completion in complete:
                completion.resolve()


def _entries(chunk: Chunk) -> list[Entry]:
    """The chunk's tensors, once each (a tensor cut in pieces has several segments)."""
    return list(dict.fromkeys(s.entry for s in chunk.segments))


def _fail(chunk: Chunk, error: BaseException) -> None:
    # Worked out only on failure: a healthy step never needs the chunk's tensor list.
    for entry in _entries(chunk):
        if not entry.future.done():
            entry.future.set_exception(error)
