"""The pipelined executor: a compute lane and a communication lane over task DAGs.

Each graph (one chunk of a step's tensors, ``casync.chunks``) is a DAG of tasks. Three
kinds:

- ``compute`` tasks (encode, decode, merge) run on the compute thread, lowest
  priority first among those whose inputs are ready;
- ``post`` tasks (an allreduce, the nccl link's stages) run inline as soon as their
  inputs are ready — posting is non-blocking; an allreduce then waits on the comm lane;
- ``inline`` tasks (a small chunk's average after its allreduce) also run on the thread
  that completed their inputs: short host work that never waits, for which a hand-off to
  the compute thread would cost about as much as the work;
- ``p2p`` tasks (a host-wire send or receive) are posted by the p2p thread, lowest
  priority first, and a receive is then waited on the comm lane. A Gloo post takes its
  pair's lock, which the backend's loop thread holds while it reads an incoming
  message: posted from the compute thread a send stalled the next encode, and receives
  posted while building a graph held up the submitting thread.

Priorities are ``(graph, stage, index)``, the same on every rank: graphs are numbered in
the order their chunks close, which every rank shares, and within a graph every send a
receive waits for depends only on tasks of a lower stage. The p2p thread only posts (a
send never waits for its receiver), so every receive, having no inputs, is posted soon
after its graph is added, and every send soon after its inputs. The comm lane's waiter
threads take waits in priority order, so the lowest-priority unfinished wait of every
rank is always being waited on, and the compute thread never blocks: no rank can wait
for a message that waits for it, and the pipeline cannot deadlock. A waiter that runs an
inline task after its wait is busy for that short work and waits on nothing meanwhile,
so it delays the next wait without ever holding it up. Several waiters (a
Gloo receive cannot be polled, only waited on) let later messages complete while an
earlier one is still in flight. While chunk i's messages travel, the compute thread is
already encoding chunk i+1, which started as soon as its tensors arrived.

On the nccl link (``casync.devices``) a stage's sends and receives are one post task
whose handle is waited like a receive, and stages are posted in the order graphs were
built, the same on every rank (``casync.transport.Sequencer``). A stage depends only on
compute tasks, which depend only on earlier stages; posting never blocks, and a posted
operation progresses whether or not a waiter watches it. So by induction over that
order every stage is posted on every rank and completes, and no lane deadlocks.
"""

from __future__ import annotations

import heapq
import itertools
import re
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from hipress_base.errors import HiPressError, SyncError

from .transport import Handle, Posted, Transport

__all__ = ["Lane", "Task", "Graph", "Executor", "describe_failure"]


class Lane(StrEnum):
    """Where a task runs (see the module docstring)."""

    COMPUTE = "compute"  # the compute lane's thread, by priority
    P2P = "p2p"  # posted by the p2p thread, waited on the comm lane
    POST = "post"  # posted by the thread that readied it, waited on the comm lane
    INLINE = "inline"  # run by the thread that readied it (a small average)
    COMM = "comm"  # in traces: a post's or receive's wait, ended by the comm lane


class Task:
    """One node of a graph; ``run`` returns a Handle for operations that must be waited."""

    __slots__ = ("graph", "name", "lane", "prio", "run", "handle", "pending", "children",
                 "done")

    def __init__(self, graph: Graph, name: str, lane: Lane, prio: tuple[int, ...],
                 run: Callable[[], Any] | None, handle: Handle | None = None) -> None:
        self.graph = graph
        self.name = name
        self.lane = lane
        self.prio = prio
        self.run = run
        self.handle = handle
        self.pending = 0
        self.children: list[Task] = []
        self.done = False


class Graph:
    """The task DAG that synchronizes one chunk in one step."""

    def __init__(self, label: str | Callable[[], str], step: int) -> None:
        self._label = label
        self.step = step
        self.seq = -1
        self.tasks: list[Task] = []
        self.sends: list[Handle] = []
        self.remaining = 0
        self.on_done: Callable[[], None] | None = None
        self.on_error: Callable[[BaseException], None] | None = None
        self.finished = threading.Event()  # set when done or failed

    @property
    def label(self) -> str:
        """What it synchronizes, for errors and traces; a callable label is named only
        when asked (naming a chunk of many tensors walks them all, every step)."""
        if callable(self._label):
            self._label = self._label()
        return self._label

    def task(self, name: str, lane: Lane, prio: tuple[int, ...], run: Callable[[], Any] | None,
             deps: tuple[Task | None, ...] = (), handle: Handle | None = None) -> Task:
        """Add a task that runs after ``deps`` (``None`` entries are ignored)."""
        t = Task(self, name, lane, prio, run, handle)
        for dep in deps:
            if dep is not None:
                dep.children.append(t)
                t.pending += 1
        self.tasks.append(t)
        return t


def _release(graph: Graph) -> None:
    """Unlink a finished graph's tasks from each other, their work and their handles.

    A graph and its tasks point at each other, and a decode's work at the receive it
    reads: cycles that would leave a step's graphs, chunks and entries to Python's cyclic
    collector. Left there, a step's few hundred objects of each kind set off a full
    collection of the process (with torch loaded, about 0.1 s) every 150-odd steps.
    The handles go too: a lane thread still holds its last task when ``close`` wakes it,
    and a backend work freed by that thread while the interpreter finalizes aborts the
    process (``casync.teardown``)."""
    for task in graph.tasks:
        task.children = []
        task.run = None
        task.handle = None
    graph.tasks = []


def describe_failure(graph: Graph, handle: Handle | None, cause: BaseException,
                     timeout: float) -> SyncError:
    """A SyncError naming the tensor, step and peer of a failed wait."""
    where = f"step {graph.step}, {graph.label}"
    text = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    # Gloo's messages start with a source location and end with generic advice.
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
    if isinstance(cause, HiPressError) and not isinstance(cause, SyncError):
        return SyncError(f"{where}: {type(cause).__name__}: {cause}")
    if handle is None:
        return SyncError(f"{where}: {type(cause).__name__}: {text}")
    timed_out = "timed out" in text.lower() or "timeout" in text.lower()
    if handle.kind is Posted.ALLREDUCE:
        peer = "a peer of the allreduce"
    else:
        peer = f"rank {handle.peer}"
    if timed_out:
        return SyncError(f"{where}: no {handle.kind} progress with {peer} within {timeout:g} s; "
                         f"it died or stalled (raise HIPRESS_TIMEOUT if it is just slow)")
    return SyncError(f"{where}: lost {peer} during {handle.kind}: {text}")


class Executor:
    """Runs graphs on one compute thread, one p2p (posting) thread and a few
    communication (waiter) threads.

    Args:
        transport: where sends, receives and allreduces are posted.
        timeout: seconds a single wait may take before the peer counts as dead.
        trace: record ``(lane, task, graph, start, end)`` for every task (tests, profiling),
            and each compute or inline task's work in ``ran``, in the order it ran
            (``bench sync`` times them again alone: the critical path of the engine's own
            graphs).
        waiters: threads on the communication lane. Gloo cannot poll a receive, so each
            waits on one; several keep a ps worker that waits for one result from
            holding up the uploads it must aggregate meanwhile (a convoy across ranks).
    """

    def __init__(self, transport: Transport, timeout: float, trace: bool = False,
                 waiters: int = 4) -> None:
        self.transport = transport
        self.timeout = float(timeout)
        self.trace: list[tuple[str, str, str, float, float]] | None = [] if trace else None
        self.ran: list[Callable[[], Any]] = []
        self.error: SyncError | None = None
        #: turns a failure into the error every waiter sees (adds the diagnosis)
        self.explain: Callable[[SyncError, int], SyncError] | None = None
        # One lock, a condition per lane: a pushed task wakes one thread of its lane, not
        # every thread (on two cores the herd of woken waiters cost more than the work).
        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # the comm lane's waiters
        self._work = threading.Condition(lock)  # the compute thread
        self._failing = threading.Lock()
        self._compute: list[tuple[tuple[int, ...], int, Task]] = []
        self._waits: list[tuple[tuple[int, ...], int, Task]] = []
        self._p2p: list[tuple[tuple[int, ...], int, Task]] = []
        self._poster = threading.Condition(lock)  # the p2p thread
        self._order = itertools.count()
        self._graphs = itertools.count()
        self._live: set[Graph] = set()
        self._closed = False
        self._p2p_thread = threading.Thread(target=self._p2p_loop, name="casync-p2p",
                                            daemon=True)
        self._threads = [
            threading.Thread(target=self._compute_loop, name="casync-compute", daemon=True),
            self._p2p_thread,
            *(threading.Thread(target=self._comm_loop, name=f"casync-comm{i}", daemon=True)
              for i in range(waiters)),
        ]
        for thread in self._threads:
            thread.start()

    # -- submission ---------------------------------------------------------------------

    def add(self, graph: Graph) -> None:
        """Schedule a graph: its ready tasks (its receives among them) start now."""
        if self.error is not None:
            raise self.error
        graph.seq = next(self._graphs)
        graph.remaining = len(graph.tasks)
        ready = []
        with self._cv:
            self._live.add(graph)
            for task in graph.tasks:
                task.prio = (graph.seq, *task.prio)
                if task.pending == 0:
                    ready.append(task)
        if not graph.tasks:
            self._finish(graph)
        self._dispatch(ready)

    def reject(self, graph: Graph, cause: BaseException) -> SyncError:
        """Fail the step of a graph that could not be built (a backend call raised);
        returns the error every waiter now sees."""
        self._fail(describe_failure(graph, None, cause, self.timeout), graph.step)
        assert self.error is not None
        return self.error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            self._work.notify_all()
            self._poster.notify_all()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lanes' threads to end (after ``close``);
        whether they all did."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in self._threads)

    # -- completion ---------------------------------------------------------------------

    def _dispatch(self, ready: list[Task]) -> None:
        """Start ready tasks: compute and p2p go to their lanes, posts and inline tasks
        run here (neither blocks)."""
        ready = ready[::-1]  # post in graph order: collectives must match across ranks
        while ready:
            task = ready.pop()
            if task.lane is Lane.COMPUTE:
                with self._cv:
                    heapq.heappush(self._compute, (task.prio, next(self._order), task))
                    self._work.notify()
                continue
            if task.lane is Lane.P2P and threading.current_thread() is not self._p2p_thread:
                with self._cv:
                    heapq.heappush(self._p2p, (task.prio, next(self._order), task))
                    self._poster.notify()
                continue
            try:
                start = time.perf_counter()
                handle = task.run() if task.run is not None else None
                self._record(task.lane, task, start)
                if task.lane is Lane.INLINE and self.trace is not None and task.run:
                    self.ran.append(task.run)
            except BaseException as exc:  # noqa: BLE001 - reported through the futures
                self._fail(describe_failure(task.graph, None, exc, self.timeout),
                           task.graph.step)
                return
            if isinstance(handle, Handle) and handle.kind is not Posted.SEND:
                task.handle = handle
                with self._cv:
                    heapq.heappush(self._waits, (task.prio, next(self._order), task))
                    self._cv.notify()
                continue
            if isinstance(handle, Handle):
                task.graph.sends.append(handle)
            ready.extend(self._complete(task)[::-1])

    def _complete(self, task: Task) -> list[Task]:
        ready = []
        with self._cv:  # both lanes complete tasks; counts change under the lock
            task.done = True
            for child in task.children:
                child.pending -= 1
                if child.pending == 0:
                    ready.append(child)
            graph = task.graph
            graph.remaining -= 1
            finished = graph.remaining == 0
        if finished:
            self._finish(graph)
        return ready

    def _finish(self, graph: Graph) -> None:
        try:
            if graph.on_done is not None:
                graph.on_done()
        except BaseException as exc:  # noqa: BLE001
            self._fail(describe_failure(graph, None, exc, self.timeout), graph.step)
            return
        with self._cv:
            self._live.discard(graph)
        _release(graph)
        graph.finished.set()

    def _fail(self, error: SyncError, step: int) -> None:
        # Several waiters can fail at once (one dead peer breaks many messages): the
        # first explains, alone — the diagnosis talks to the job's store, one client.
        with self._failing:
            if self.error is None and self.explain is not None:
                error = self.explain(error, step)
            with self._cv:
                if self.error is None:
                    self.error = error
        with self._cv:
            live = list(self._live)
            self._live.clear()
            self._cv.notify_all()
            self._work.notify_all()
            self._poster.notify_all()
        for graph in live:
            if graph.on_error is not None:
                graph.on_error(self.error)
            graph.finished.set()

    def _record(self, lane: Lane, task: Task, start: float) -> None:
        if self.trace is not None:
            self.trace.append((lane, task.name, task.graph.label, start, time.perf_counter()))

    # -- lanes --------------------------------------------------------------------------

    def _next(self, heap: list[tuple[tuple[int, ...], int, Task]],
              cv: threading.Condition) -> Task | None:
        with cv:
            cv.wait_for(lambda: heap or self._closed or self.error is not None)
            if self._closed or self.error is not None:
                return None
            return heapq.heappop(heap)[2]

    def _compute_loop(self) -> None:
        while (task := self._next(self._compute, self._work)) is not None:
            try:
                start = time.perf_counter()
                assert task.run is not None
                task.run()
                self._record(Lane.COMPUTE, task, start)
                if self.trace is not None:
                    self.ran.append(task.run)
            except BaseException as exc:  # noqa: BLE001
                self._fail(describe_failure(task.graph, None, exc, self.timeout),
                           task.graph.step)
                continue
            self._dispatch(self._complete(task))

    def _p2p_loop(self) -> None:
        while (task := self._next(self._p2p, self._poster)) is not None:
            self._dispatch([task])

    def _comm_loop(self) -> None:
        while (task := self._next(self._waits, self._cv)) is not None:
            assert task.handle is not None
            try:
                start = time.perf_counter()
                self.transport.wait(task.handle, self.timeout)
                self._record(Lane.COMM, task, start)
            except BaseException as exc:  # noqa: BLE001
                self._fail(describe_failure(task.graph, task.handle, exc, self.timeout),
                           task.graph.step)
                continue
            self._dispatch(self._complete(task))
