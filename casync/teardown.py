"""Leaving a broken group cleanly: the connections to cut after a failure.

After a ``SyncError`` some of the engine's waiter threads are still blocked in Gloo,
waiting on messages that will never come. Should one of those waits return while the
interpreter finalizes (a peer exits and its connection closes), the thread tries to take
the GIL, CPython ends it with a forced unwind, and the unwind through torch's C++ frames
aborts the process ("terminate called without an active exception"). So before the
process exits, the waits must return: shutting down the group's TCP connections makes
every pending Gloo operation fail at once, as a dead peer's would.

The connections are the sockets that appeared while the group was created
(``Connections.watch``), except those to or from the job's store (``MASTER_PORT``):
only what HiPress itself set up is ever cut, and only after the engine failed.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

__all__ = ["Connections"]


def _sockets() -> dict[int, str]:
    """This process's socket descriptors and their inodes (Linux; empty elsewhere)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(name)] = link
    return found


class Connections:
    """The TCP connections of process groups created under ``watch``."""

    def __init__(self) -> None:
        self._inodes: set[str] = set()

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Remember the sockets that appear while the block runs (a group's creation)."""
        before = set(_sockets().values())
        try:
            yield
        finally:
            self._inodes |= set(_sockets().values()) - before

    def cut(self) -> int:
        """Shut down every remembered connection still open; returns how many."""
        store = int(os.environ.get("MASTER_PORT", "0") or 0)
        cut = 0
        for fd, inode in _sockets().items():
            if inode not in self._inodes:
                continue
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if sock.type != socket.SOCK_STREAM:
                    continue
                peer, local = sock.getpeername(), sock.getsockname()  # listeners raise
                if store and store in (peer[1], local[1]):
                    continue  # the job's store: other ranks may still read diagnoses
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass
            finally:
                sock.close()
        return cut
