"""Asynchronous point-to-point and allreduce over a ``torch.distributed`` process group.

Payloads have variable sizes. Rather than sending a size message first, a receiver
posts its buffer at the payload's worst-case size and reads the real length from the
payload header (Gloo accepts a message shorter than the posted buffer). That keeps
every transfer to one message; ``bench sync --probe`` measures it against a size
exchange. Large worst-case buffers cost nothing until written: the pages are untouched.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from enum import StrEnum
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError

__all__ = ["Posted", "Handle", "Transport", "NcclTransport", "Sequencer", "tag_space", "parse_rate",
           "Pacer"]

#: Tags are 31-bit; the engine allots consecutive tags per graph and wraps around.
tag_space = 1 << 31


def parse_rate(text: str) -> float:
    """Bits per second of a tc-style rate such as ``1gbit``, ``500mbit`` or ``10gbit``.

    Example:
        >>> parse_rate("1gbit")
        1000000000.0
    """
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    low = text.strip().lower()
    for unit, scale in units.items():
        if low.endswith(unit):
            try:
                value = float(low[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * scale
    raise ConfigError(f"rate {text!r} is not a positive number ending in bit, kbit, mbit or "
                      "gbit (e.g. 1gbit)")


class Posted(StrEnum):
    """What a ``Handle`` waits on."""

    SEND = "send"
    RECV = "recv"
    ALLREDUCE = "allreduce"
    EXCHANGE = "exchange"  # an all-gather of sizes, then of payloads (device links)


class Handle:
    """One posted operation: what to wait on, with whom, and its buffer."""

    __slots__ = ("work", "peer", "kind", "buffer", "ready", "error")

    def __init__(self, work: Any, peer: int, kind: Posted, buffer: Any,
                 ready: threading.Event | None = None) -> None:
        self.work = work  # a backend Work, or a list of them (an exchange)
        self.peer = peer
        self.kind = kind
        self.buffer = buffer
        self.ready = ready  # set once a paced or sequenced operation is actually posted
        self.error: BaseException | None = None  # raised by wait: a deferred post failed


class Pacer:
    """Software emulation of one rank's uplink at ``rate`` bits/s.

    An operation of B bytes reserves the link for B/rate seconds after the previous
    reservation and is posted when its last byte would have left, so peers receive it
    when a real link of that rate would have delivered it. This is emulation (no
    queueing or packet loss); ``hipress bench sync --network shaped`` uses real links.
    """

    def __init__(self, rate_bps: float) -> None:
        self.rate = rate_bps / 8.0
        self.free_at = 0.0
        self._queue: deque[tuple[float, Callable[[], None]]] = deque()
        self._cv = threading.Condition()
        threading.Thread(target=self._run, name="casync-pacer", daemon=True).start()

    def later(self, nbytes: int, post: Callable[[], None]) -> None:
        """Run ``post`` when ``nbytes`` more bytes would have crossed the link."""
        with self._cv:
            start = max(time.monotonic(), self.free_at)
            self.free_at = start + nbytes / self.rate
            self._queue.append((self.free_at, post))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                due, post = self._queue[0]
                delay = due - time.monotonic()
                if delay > 0:
                    self._cv.wait(delay)
                    continue
                self._queue.popleft()
            post()


def _torch_view(arr: Any) -> Any:
    """What torch.distributed posts: a NumPy buffer viewed as a tensor, a tensor as is."""
    if not isinstance(arr, np.ndarray):
        return arr
    import torch

    return torch.from_numpy(arr)


class Transport:
    """Posts sends, receives and allreduces of host buffers on a Gloo process group.

    Subclass and override ``isend``/``irecv``/``wait`` to instrument or pace traffic.
    """

    #: the process group's backend this transport posts on
    backend = "gloo"

    def __init__(self, group: Any = None, bandwidth: str | None = None) -> None:
        """Args:
            group: a Gloo process group (default: the world).
            bandwidth: emulate an uplink of this rate (``"1gbit"``); default
                ``HIPRESS_BANDWIDTH`` if set, else no pacing.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized; launch with torchrun "
                              "(or hipress run) and call init_process_group first")
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        if backend != self.backend:
            raise ConfigError(self._wrong_backend(backend))
        self.bytes_sent = 0
        self.messages_sent = 0  # point-to-point sends
        self.collectives = 0  # allreduces
        bandwidth = bandwidth or os.environ.get("HIPRESS_BANDWIDTH") or None
        self.pacer = Pacer(parse_rate(bandwidth)) if bandwidth else None

    def _wrong_backend(self, backend: str) -> str:
        return (f"CaSync moves host buffers and needs a Gloo group, not {backend!r}; create "
                "one with dist.new_group(backend='gloo')")

    def _paced(self, nbytes: int, post: Callable[[], Any], peer: int, kind: Posted,
               buffer: np.ndarray) -> Handle:
        if self.pacer is None:
            return Handle(post(), peer, kind, buffer)
        handle = Handle(None, peer, kind, buffer, threading.Event())

        def run() -> None:
            handle.work = post()
            assert handle.ready is not None
            handle.ready.set()

        self.pacer.later(nbytes, run)
        return handle

    def _global(self, peer: int) -> int:
        if self.group is None:
            return peer
        return int(self.dist.get_global_rank(self.group, peer))

    def isend(self, payload: np.ndarray, dst: int, tag: int) -> Handle:
        """Post a send of ``payload`` (contiguous uint8) to group rank ``dst``."""
        self.bytes_sent += payload.nbytes
        self.messages_sent += 1
        return self._paced(payload.nbytes, lambda: self.dist.isend(
            _torch_view(payload), self._global(dst), self.group, tag), dst, Posted.SEND, payload)

    def irecv(self, capacity: int, src: int, tag: int,
              buffer: np.ndarray | None = None) -> Handle:
        """Post a receive of at most ``capacity`` bytes from group rank ``src``, into
        ``buffer`` (uint8, at least ``capacity`` long) or a new one."""
        if buffer is None or buffer.size < capacity:
            buffer = np.empty(max(capacity, 1), dtype=np.uint8)
        work = self.dist.irecv(_torch_view(buffer), self._global(src), self.group, tag)
        return Handle(work, src, Posted.RECV, buffer)

    def allreduce(self, data: np.ndarray) -> Handle:
        """Post an in-place sum of a contiguous float32 buffer over the group."""
        nbytes = 2 * data.nbytes * (self.size - 1) // max(self.size, 1)
        self.bytes_sent += nbytes
        self.collectives += 1
        return self._paced(nbytes, lambda: self.dist.all_reduce(
            _torch_view(data), group=self.group, async_op=True), -1, Posted.ALLREDUCE, data)

    def exchange(self, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]],
                 tag: int) -> list[Any]:
        """Post a stage's sends and receives (``(buffer, group rank)`` each) as one batch
        (``batch_isend_irecv``: one NCCL group, so a pair's send and receive cannot wait
        on each other); returns the backend's works."""
        ops = [self.dist.P2POp(self.dist.isend, _torch_view(b), self._global(peer),
                               self.group, tag) for b, peer in sends]
        ops += [self.dist.P2POp(self.dist.irecv, _torch_view(b), self._global(peer),
                                self.group, tag) for b, peer in recvs]
        for buf, _ in sends:
            self.bytes_sent += int(buf.nbytes)
            self.messages_sent += 1
        return list(self.dist.batch_isend_irecv(ops)) if ops else []

    def allreduce_device(self, data: Any) -> Any:
        """Post an in-place sum of a tensor over the group; returns the backend's work."""
        self.bytes_sent += 2 * int(data.nbytes) * (self.size - 1) // max(self.size, 1)
        self.collectives += 1
        return self.dist.all_reduce(data, group=self.group, async_op=True)

    def max_over_ranks(self, values: list[float]) -> list[float]:
        """Each value's maximum over the group's ranks (a blocking collective): what the
        slowest rank measured, as every rank waits for it."""
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        if self.size > 1:
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return [float(v) for v in t]

    def wait(self, handle: Handle, timeout: float) -> None:
        """Block until ``handle`` completes; raises the backend's error on failure."""
        deadline = time.monotonic() + timeout
        if handle.ready is not None and not handle.ready.wait(timeout):
            raise TimeoutError(f"a deferred {handle.kind} was not posted within {timeout:g} s "
                               "(timed out)")
        if handle.error is not None:
            raise handle.error
        for work in handle.work if isinstance(handle.work, list) else [handle.work]:
            self._wait_work(work, deadline)

    def _wait_work(self, work: Any, deadline: float) -> None:
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))



class Sequencer:
    """Posts operations in the order they were numbered, whatever order they become ready.

    NCCL matches a pair's point-to-point operations in the order each side posts them,
    and collectives in the order of the group. The engine numbers a link's exchanges and
    collectives as it builds its graphs — chunk by chunk, stage by stage, the same on
    every rank — and an operation that is ready early waits (its handle not ``ready``)
    until every lower number was posted. Posting does not block, so a waiting operation
    is posted by the thread that posted the one before it.
    """

    def __init__(self) -> None:
        self._count = 0
        self._next = 0
        self._queued: dict[int, tuple[Callable[[], Any], Handle]] = {}
        self._lock = threading.Lock()

    def number(self) -> int:
        """The next operation's place (when its graph is built)."""
        n, self._count = self._count, self._count + 1
        return n

    def post(self, n: int, post: Callable[[], Any], handle: Handle) -> Handle:
        """Post ``post()`` as operation ``n`` into ``handle.work``, now or once every
        lower number was posted; a failure is raised by the handle's wait."""
        handle.ready = handle.ready or threading.Event()
        with self._lock:  # posts run under the lock: two threads cannot reorder them
            self._queued[n] = (post, handle)
            while self._next in self._queued:
                run, h = self._queued.pop(self._next)
                self._next += 1
                try:
                    h.work = run()
                except BaseException as exc:  # noqa: BLE001 - the waiter raises it
                    h.error = exc
                assert h.ready is not None
                h.ready.set()
        return handle


class NcclTransport(Transport):
    """Posts CUDA tensors over an NCCL group: the ``nccl`` link of ``casync.devices``.

    A receive must be posted at the sender's exact size and a pair's operations are
    matched in posting order, so the link sends every message at its worst-case size and
    posts a stage's sends and receives as one batch, in one order on every rank
    (``Sequencer``). Waits poll the work (an NCCL wait would only order the streams), so a
    silent peer still raises within the timeout.
    """

    backend = "nccl"

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()
                and torch.cuda.is_available()):
            raise ConfigError("cuda_transport='nccl' needs torch with NCCL and a CUDA "
                              "device; this one has none (cuda_transport='staged' sends the "
                              "compressed payloads over Gloo)")
        super().__init__(group, None)

    def _wrong_backend(self, backend: str) -> str:
        return (f"cuda_transport='nccl' needs an NCCL process group, not {backend!r}; "
                "initialise the default group with backend='nccl' or pass nccl_group=")

    def _wait_work(self, work: Any, deadline: float) -> None:
        pause = 20e-6
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("an NCCL operation did not complete (timed out)")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        work.wait()  # raises the backend's error, if any
