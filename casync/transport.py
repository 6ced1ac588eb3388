"""Asynchronous point-to-point and allreduce over a ``torch.distributed`` process group.

Payloads have variable sizes. Rather than sending a size message first, a receiver
posts its buffer at the payload's worst-case size and reads the real length from the
payload header (Gloo accepts a message shorter than the posted buffer). That keeps
every transfer to one message; ``bench sync --probe`` measures it against a size
exchange. Large worst-case buffers cost nothing until written: the pages are untouched.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import numpy as np

from hipress.errors import ConfigError

__all__ = ["Handle", "Transport", "tag_space"]

#: Tags are 31-bit; the engine allots consecutive tags per graph and wraps around.
tag_space = 1 << 31


class Handle:
    """One posted operation: what to wait on, with whom, and its buffer."""

    __slots__ = ("work", "peer", "kind", "buffer", "posted")

    def __init__(self, work: Any, peer: int, kind: str, buffer: np.ndarray) -> None:
        self.work = work
        self.peer = peer
        self.kind = kind
        self.buffer = buffer
        self.posted = time.perf_counter()


def _torch_view(arr: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(arr)


class Transport:
    """Posts sends, receives and allreduces of host buffers on a Gloo process group.

    Subclass and override ``isend``/``irecv``/``wait`` to instrument or pace traffic.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialized; launch with torchrun "
                              "(or hipress run) and call init_process_group first")
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        backend = dist.get_backend(group)
        if backend != "gloo":
            raise ConfigError(f"CaSync moves host buffers and needs a Gloo group, not "
                              f"{backend!r}; create one with dist.new_group(backend='gloo')")
        self.bytes_sent = 0
        self.messages_sent = 0

    def _global(self, peer: int) -> int:
        if self.group is None:
            return peer
        return int(self.dist.get_global_rank(self.group, peer))

    def isend(self, payload: np.ndarray, dst: int, tag: int) -> Handle:
        """Post a send of ``payload`` (contiguous uint8) to group rank ``dst``."""
        work = self.dist.isend(_torch_view(payload), self._global(dst), self.group, tag)
        self.bytes_sent += payload.nbytes
        self.messages_sent += 1
        return Handle(work, dst, "send", payload)

    def irecv(self, capacity: int, src: int, tag: int,
              buffer: np.ndarray | None = None) -> Handle:
        """Post a receive of at most ``capacity`` bytes from group rank ``src``, into
        ``buffer`` (uint8, at least ``capacity`` long) or a new one."""
        if buffer is None or buffer.size < capacity:
            buffer = np.empty(max(capacity, 1), dtype=np.uint8)
        work = self.dist.irecv(_torch_view(buffer), self._global(src), self.group, tag)
        return Handle(work, src, "recv", buffer)

    def allreduce(self, data: np.ndarray) -> Handle:
        """Post an in-place sum of a contiguous float32 buffer over the group."""
        work = self.dist.all_reduce(_torch_view(data), group=self.group, async_op=True)
        self.bytes_sent += 2 * data.nbytes * (self.size - 1) // max(self.size, 1)
        return Handle(work, -1, "allreduce", data)

    def wait(self, handle: Handle, timeout: float) -> None:
        """Block until ``handle`` completes; raises the backend's error on failure."""
        handle.work.wait(timedelta(seconds=max(timeout, 0.001)))
