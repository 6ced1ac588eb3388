"""Engines end before their process group does, whatever a script calls last.

A training script may end with ``dist.destroy_process_group()`` (as PyTorch's DDP
tutorial does), with ``hp.shutdown()``, with both in either order, or with neither. An
engine still running then has sends of its last step in flight and threads that hold
tensors; destroying the group under them, or finalizing the interpreter while a lane
frees a tensor, aborts the process ("terminate called without an active exception") and
the launcher reports the job failed. So, once the first engine starts:

- ``torch.distributed.destroy_process_group`` first closes the engines on the group it
  destroys (every engine, for the default group), lets Gloo's workers drop what they
  finished, and is a no-op when the default group is already gone (``hp.shutdown()``
  destroyed it);
- at interpreter exit, before threads are joined, every engine still open is closed,
  and Gloo's workers get the GIL once more (``let_gloo_release``).

Closing a healthy engine lets its last messages leave and joins its threads
(``Synchronizer.close``); a failed engine's threads are handled by its owner
(``hipress.distributed`` cuts its connections).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["register", "forget", "on_destroy", "close_engines", "GLOO_RELEASE_S",
           "let_gloo_release"]

#: How long the main thread lets go of the GIL before the interpreter may finalize.
GLOO_RELEASE_S = 0.05

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_callbacks: list[Callable[[Any], None]] = []
_lock = threading.Lock()
_installed = False


def let_gloo_release() -> None:
    """Give Gloo's worker threads the GIL to drop the work they finished.

    A Gloo worker frees a finished collective's tensors after the caller has woken,
    and freeing a tensor Python has seen takes the GIL. If the process exits before the
    worker gets it, CPython ends that thread mid-destructor and the process aborts
    (pytorch/pytorch#179291). Those workers are already queued on the GIL, so one short
    sleep lets them through.
    """
    time.sleep(GLOO_RELEASE_S)


def register(engine: Any) -> None:
    """Track ``engine`` (a ``Synchronizer``) until it closes; install the hooks once."""
    _install()
    _live.add(engine)


def forget(engine: Any) -> None:
    """``engine`` closed: nothing is left to do for it."""
    _live.discard(engine)


def on_destroy(callback: Callable[[Any], None]) -> None:
    """Call ``callback(group)`` whenever a process group is destroyed (after the engines
    on it closed), for layers that keep state of their own (``hipress.distributed``)."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def close_engines(group: Any = None) -> None:
    """Close the open engines on ``group`` (None: every engine)."""
    for engine in list(_live):
        if group is not None and engine.transport.group is not group:
            continue
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - a failed engine re-raises nothing new here
            pass
        _live.discard(engine)


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        close_engines(group)
        for callback in list(_callbacks):
            callback(group)
        if group is None and not dist.is_initialized():
            return  # destroyed already: hp.shutdown() owned the group
        original(group)
        let_gloo_release()

    distributed_c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    register_exit = getattr(threading, "_register_atexit", None)  # before threads are reaped
    if register_exit is None:  # pragma: no cover - CPython has had it since 3.9
        import atexit

        register_exit = atexit.register
    register_exit(_at_exit)


def _at_exit() -> None:
    """Interpreter exit: close the engines still open, then, while a process group is
    still up (no one destroyed it) or an engine just closed, let Gloo's workers drop
    what they finished before the interpreter finalizes."""
    closing = bool(_live)
    close_engines()
    import torch.distributed as dist

    if closing or (dist.is_available() and dist.is_initialized()):
        let_gloo_release()
