"""Who failed: ranks post their progress and fault reports in the job's key-value store.

When a wait fails, the neighbour a rank was waiting on is often not the culprit (it
may itself be waiting on the dead rank). Before raising, a rank reads the others'
reports and progress from the c10d store so its ``SyncError`` names the rank that
actually died or stalled. Every store access is best effort and bounded in time: the
store may live on the dead rank.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["Health", "default_store"]

_PREFIX = "hipress/health"
#: Seconds between two progress posts at least: a post per step would tax a short step
#: with the store's round trip and the poster's wake-up.
POST_EVERY = 0.05
#: Seconds a failing rank waits before it reads the others' progress: several
#: ``POST_EVERY``, for posters slowed down by a busy host.
SETTLE = 0.25


def default_store(group: Any) -> Any:
    """The c10d key-value store of ``group`` (None: the default group), or None."""
    try:  # not public API; without it the diagnosis is simply skipped
        from torch.distributed import distributed_c10d

        if group is None:
            return distributed_c10d._get_default_store()
        return distributed_c10d._get_process_group_store(group)
    except Exception:  # noqa: BLE001
        return None


def _bounded(fn: Any, seconds: float) -> Any:
    """Run ``fn`` in a helper thread; None if it fails or takes longer than ``seconds``."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else None


class Health:
    """Progress and fault reports of one rank, and the diagnosis of a failure."""

    def __init__(self, group: Any, rank: int, size: int, store: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.store = store if store is not None else default_store(group)
        self._cv = threading.Condition()
        self._step = -1
        self._closed = False
        self._idle = False  # the poster waits for a new step (not between two posts)
        self._poster: threading.Thread | None = None

    def progress(self, step: int) -> None:
        """Record that this rank started ``step``.

        A helper thread posts it: the step does not wait for the store's round trip, and
        a dead store holds up only that thread. Only the newest step is posted, at most
        once per ``POST_EVERY`` seconds; a failing rank reads it ``SETTLE`` seconds after
        its failure (``diagnose``)."""
        if self.store is None:
            return
        with self._cv:
            self._step = step
            if self._poster is None:
                self._poster = threading.Thread(target=self._post, name="hipress-health",
                                                daemon=True)
                self._poster.start()
            if self._idle:  # a poster between posts is not woken: it looks when it is due
                self._cv.notify()

    def _post(self) -> None:
        posted = -1
        while True:
            with self._cv:
                self._idle = True
                while self._step == posted and not self._closed:
                    self._cv.wait()
                self._idle = False
                if self._closed:
                    return
                posted = self._step
            try:
                self.store.set(f"{_PREFIX}/step/{self.rank}", str(posted))
            except Exception:  # noqa: BLE001 - best effort, as every store access here
                pass
            with self._cv:
                self._cv.wait_for(lambda: self._closed, POST_EVERY)

    def close(self) -> None:
        """Stop the posting thread (a post in flight finishes on its own)."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def report(self, message: str) -> None:
        """Tell the other ranks what this rank saw fail, and the step it is in."""
        if self.store is None:
            return

        def post() -> None:
            self.store.set(f"{_PREFIX}/step/{self.rank}", str(self._step))
            self.store.set(f"{_PREFIX}/fault/{self.rank}", message)

        _bounded(post, 2.0)

    def diagnose(self, step: int) -> str:
        """What the other ranks reported, and which ranks never reached ``step``.

        Reads the store ``SETTLE`` seconds from now: a live rank's newest step is posted
        within ``POST_EVERY`` of its start, so by then a rank seen behind ``step`` is one
        that never started it, not one whose post had not gone out yet."""
        if self.store is None:
            return ""
        time.sleep(SETTLE)

        def read() -> str:
            notes, behind = [], []
            for other in range(self.size):
                if other == self.rank:
                    continue
                if self.store.check([f"{_PREFIX}/fault/{other}"]):
                    text = self.store.get(f"{_PREFIX}/fault/{other}").decode()
                    notes.append(f"rank {other} reported: {text}")
                key = f"{_PREFIX}/step/{other}"
                seen = int(self.store.get(key)) if self.store.check([key]) else -1
                if seen < step:
                    behind.append(f"rank {other} never started step {step}"
                                  + (f" (last seen in step {seen})" if seen >= 0 else ""))
            return "; ".join(behind + notes)

        found = _bounded(read, 3.0)
        _bounded(lambda: self.store.set(f"{_PREFIX}/done/{self.rank}", str(step)), 2.0)
        return f" [{found}]" if found else ""

    def linger(self, step: int, seconds: float = 5.0) -> None:
        """On rank 0, which hosts the job's store: keep it up until every rank that
        reached ``step`` has read its diagnosis, or ``seconds`` pass. A rank 0 that
        raised and exited at once would take the store, and the others' diagnosis
        of who failed, with it."""
        if self.store is None or self.rank != 0:
            return

        def waiting() -> list[int]:
            out = []
            for other in range(1, self.size):
                key = f"{_PREFIX}/step/{other}"
                seen = int(self.store.get(key)) if self.store.check([key]) else -1
                if seen >= step and not self.store.check([f"{_PREFIX}/done/{other}"]):
                    out.append(other)
            return out

        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if _bounded(waiting, 2.0) == []:
                return
            time.sleep(0.05)
