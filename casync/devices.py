"""Where a chunk's buffers live and how its messages travel: one *link* per device.

A chunk's tensors share a device. Its scratch, payloads and residuals live on that
device (``Memory``), the codec runs there, and a ``Link`` says how the compressed
messages cross to the other ranks:

* ``gloo``: host memory (NumPy arrays, CPU tensors, viewed without a copy) over the
  engine's Gloo group, as it always did;
* ``staged``: CUDA memory; only the *compressed* message is copied to pinned host memory,
  sent over Gloo, and copied back to the GPU before it is decoded (for clusters without
  NCCL between nodes, and for ranks that share a GPU, which NCCL refuses);
* ``nccl``: CUDA memory over an NCCL group (``NcclTransport``). NCCL needs a receive of
  the sender's exact size, so every message travels at its worst-case size, and it
  matches a pair's operations in posting order, so a stage's sends and receives are one
  batch and the stages are posted in one order on every rank (``Sequencer``).

A message on the wire is the payloads' total length (8 bytes) and the payloads. The
length is the one value the path needs on the host: the batched encode returns it (its
CUDA form synchronises the device once per call to learn the payload sizes), a staged
message arrives in host memory, where it is read for free, and an nccl one costs an
8-byte copy to the host per received message.

No path makes a full-precision host copy of a CUDA gradient, except the uncompressed
allreduce of a staged link, which has to move the values themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError, PayloadError

from .transport import Sequencer, Transport

__all__ = ["LENGTH", "Memory", "HostMemory", "TorchMemory", "Message", "Link", "GlooLink",
           "StagedLink", "NcclLink", "link_for", "memory_of",
           "framed_payloads", "numel"]

#: bytes in front of a message's payloads: their total length
LENGTH = 8



_NOTHING = contextlib.nullcontext()


def _torch() -> Any:
    import torch

    return torch


class Memory:
    """Buffers on one device: what the graphs allocate, address and copy."""

    #: ``"cpu"`` or a torch device string (``"cuda:0"``)
    device = "cpu"
    #: whether the codec's CUDA kernels run on these buffers
    cuda = False

    def empty(self, n: int, dtype: Any) -> Any:
        raise NotImplementedError

    def ptr(self, buf: Any) -> int:
        raise NotImplementedError

    def scale(self, buf: Any, factor: float) -> None:
        """``buf *= factor`` in float32, in place."""
        raise NotImplementedError

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` between two buffers of this memory."""
        raise NotImplementedError

    def gather(self, flat: Any, segs: list[Any]) -> None:
        """Copy the segments' elements (``casync.chunks.Segment``) end to end into
        ``flat``."""
        offset = 0
        for s in segs:
            self.copy(flat[offset:offset + s.n], s.view())
            offset += s.n

    def scatter(self, flat: Any, segs: list[Any]) -> None:
        """The reverse of ``gather``: ``flat``'s elements back into the segments."""
        offset = 0
        for s in segs:
            self.copy(s.view(), flat[offset:offset + s.n])
            offset += s.n

    def to_host(self, dst: np.ndarray, src: Any) -> None:
        """Copy ``src`` (this memory) into the host array ``dst`` of the same length."""
        raise NotImplementedError

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        """Copy the host array ``src`` into ``dst`` (this memory) of the same length."""
        raise NotImplementedError

    def host_empty(self, n: int, dtype: Any) -> np.ndarray:
        """A host buffer that copies to and from this memory fast (pinned for CUDA)."""
        return np.empty(max(n, 1), dtype)[:n]

    def active(self) -> contextlib.AbstractContextManager[None]:
        """Make this memory's device and the engine's stream on it current (both are per
        thread in torch: the engine's threads start on device 0's default stream). Host
        memory has neither: one shared no-op context, as this is on every chunk's path."""
        return _NOTHING

    def ready_event(self) -> Any:
        """An event after the calling thread's work so far on this device (a gradient's
        producer: the backward pass), or None where no ordering is needed."""
        return None

    def after(self, event: Any) -> None:
        """Order the engine's later work on this device after ``event``."""

    def put_length(self, buf: Any, value: int) -> None:
        """Write a message's length into its first ``LENGTH`` bytes."""
        buf[:LENGTH].view(np.uint64)[0] = value

    def get_length(self, buf: Any) -> int:
        return int(buf[:LENGTH].view(np.uint64)[0])


class HostMemory(Memory):
    """NumPy arrays: CPU tensors are viewed, never copied."""

    def empty(self, n: int, dtype: Any) -> np.ndarray:
        return np.empty(max(n, 1), dtype)[:n]

    def ptr(self, buf: np.ndarray) -> int:
        return int(buf.ctypes.data)

    def scale(self, buf: np.ndarray, factor: float) -> None:
        np.multiply(buf, np.float32(factor), out=buf)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    # A chunk of a step's small tensors has hundreds of segments, mostly whole tensors:
    # their buffers are used as they are, sliced only where a segment is part of one,
    # since a slice per segment would cost more than the segment's copy.
    @staticmethod
    def _views(segs: list[Any]) -> list[np.ndarray]:
        return [s.entry.buf if s.lo == 0 and s.hi == s.entry.numel else s.view()
                for s in segs]

    def gather(self, flat: np.ndarray, segs: list[Any]) -> None:
        if segs:
            np.concatenate(self._views(segs), out=flat)

    def scatter(self, flat: np.ndarray, segs: list[Any]) -> None:
        at = 0
        for view in self._views(segs):
            view[...] = flat[at:at + view.size]
            at += view.size

    def to_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    def from_host(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src


class TorchMemory(Memory):
    """Torch tensors on one device: a GPU's, or the CPU when a test stands it in for one
    (the same code path, with the CPU kernels)."""

    def __init__(self, device: Any) -> None:
        torch = _torch()
        self._device = torch.device(device)
        self.device = str(self._device)
        self.cuda = self._device.type == "cuda"
        self._types = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32}
        #: the engine's stream on this device: its kernels and copies run there, ordered
        #: after each gradient's producer by events, not by synchronizing the device
        self.stream = torch.cuda.Stream(self._device) if self.cuda else None

    def empty(self, n: int, dtype: Any) -> Any:
        torch = _torch()
        return torch.empty(max(n, 1), dtype=self._types[np.dtype(dtype)],
                           device=self._device)[:n]

    def ptr(self, buf: Any) -> int:
        return int(buf.data_ptr())

    def scale(self, buf: Any, factor: float) -> None:
        buf.mul_(float(np.float32(factor)))

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def to_host(self, dst: np.ndarray, src: Any) -> None:
        if dst.size:
            _torch().from_numpy(dst).copy_(src)

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        if src.size:
            dst.copy_(_torch().from_numpy(src))

    def host_empty(self, n: int, dtype: Any) -> np.ndarray:
        if not self.cuda:
            return super().host_empty(n, dtype)
        torch = _torch()
        pinned = torch.empty(max(n, 1), dtype=self._types[np.dtype(dtype)], pin_memory=True)
        return pinned.numpy()[:n]

    def active(self) -> contextlib.AbstractContextManager[None]:
        return self._on_device() if self.cuda else _NOTHING

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        torch = _torch()
        with torch.cuda.device(self._device), torch.cuda.stream(self.stream):
            yield

    def ready_event(self) -> Any:
        if not self.cuda:
            return None
        torch = _torch()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def after(self, event: Any) -> None:
        if event is not None and self.stream is not None:
            self.stream.wait_event(event)

    def put_length(self, buf: Any, value: int) -> None:
        header = np.array([value], np.uint64).view(np.uint8)
        buf[:LENGTH].copy_(_torch().from_numpy(header))

    def get_length(self, buf: Any) -> int:
        # The one device-to-host read of the nccl link: it waits for the receive.
        return int(buf[:LENGTH].cpu().numpy().view(np.uint64)[0])


_HOST = HostMemory()
_memories: dict[str, TorchMemory] = {}


def memory_of(buf: Any) -> Memory:
    """The memory a staged gradient buffer lives in: the host for NumPy arrays (CPU
    tensors are staged as NumPy views), the tensor's device for tensors."""
    if isinstance(buf, np.ndarray):
        return _HOST
    device = str(buf.device)
    if device not in _memories:
        _memories[device] = TorchMemory(buf.device)
    return _memories[device]


def numel(buf: Any) -> int:
    """Elements of a NumPy array or a tensor."""
    return int(buf.size) if isinstance(buf, np.ndarray) else int(buf.numel())


def framed_payloads(message: Any, memory: Memory | None = None) -> Any:
    """The payloads of a message (or of a receive buffer holding one at its front) on
    ``memory`` (default the host), after checking the length it starts with."""
    size = numel(message)
    if size < LENGTH:
        raise PayloadError(f"a message of {size} bytes has no length")
    length = (memory or _HOST).get_length(message)
    if length > size - LENGTH:
        raise PayloadError(f"a message declares {length} bytes of payloads but only "
                           f"{size - LENGTH} arrived")
    return message[LENGTH:LENGTH + length]


@dataclass
class Message:
    """A message of a chunk: what the transport sends (``wire``), and the payloads on the
    chunk's memory once known (an encode has them; a receive computes them on first use,
    ``Link.payloads``)."""

    wire: Any
    payloads: Any = None


class Link:
    """How the messages of one memory's chunks travel (see the module docstring): one
    subclass per way, made by ``link_for``.

    Attributes:
        memory: where the chunks' buffers live.
        transport: posts the sends and receives: the engine's Gloo transport, or for the
            nccl link an ``NcclTransport`` (the tests run that protocol over Gloo).
        sequencer: the nccl link's posting order (None on the others).
    """

    #: the link's name, as the engine logs it
    name = ""
    #: messages stay in device memory (the nccl link): each travels at its worst-case
    #: size, and a stage's sends and receives are posted as one batch in one order on
    #: every rank (``sequencer``)
    device_wire = False

    def __init__(self, memory: Memory, transport: Transport) -> None:
        self.memory = memory
        self.transport = transport
        self.sequencer: Sequencer | None = None

    def __repr__(self) -> str:
        return f"Link({self.name!r}, {self.memory.device})"

    def outgoing(self, buf: Any, total: int, host: Any) -> Message:
        """The message of an encode: ``buf`` (this memory) holds ``LENGTH`` spare bytes
        and then ``total`` bytes of payloads, in a buffer of the worst-case size;
        ``host(size)`` gives a host buffer to stage into."""
        self.memory.put_length(buf, total)
        return Message(buf[:LENGTH + total], buf[LENGTH:LENGTH + total])

    def payloads(self, message: Message, device: Any) -> Any:
        """The payloads of a received message on this memory; ``device(size)`` gives a
        buffer of this memory to copy a staged message into."""
        if message.payloads is None:
            message.payloads = framed_payloads(message.wire)
        return message.payloads


class GlooLink(Link):
    """Host memory over the engine's Gloo group: messages are the buffers themselves."""

    name = "gloo"


class StagedLink(Link):
    """Device memory whose compressed messages are staged through host memory and sent
    over Gloo."""

    name = "staged"

    def outgoing(self, buf: Any, total: int, host: Any) -> Message:
        payloads = buf[LENGTH:LENGTH + total]
        staged = host(LENGTH + total)
        _HOST.put_length(staged, total)
        self.memory.to_host(staged[LENGTH:], payloads)
        return Message(staged, payloads)

    def payloads(self, message: Message, device: Any) -> Any:
        if message.payloads is None:
            host = framed_payloads(message.wire)
            message.payloads = device(host.size)
            self.memory.from_host(message.payloads, host)
        return message.payloads


class NcclLink(Link):
    """Device memory over an NCCL group: whole worst-case buffers, posted in one order."""

    name = "nccl"
    device_wire = True

    def __init__(self, memory: Memory, transport: Transport) -> None:
        if isinstance(memory, HostMemory):
            raise ConfigError("the nccl link carries device memory, not host arrays")
        super().__init__(memory, transport)
        self.sequencer = Sequencer()

    def outgoing(self, buf: Any, total: int, host: Any) -> Message:
        self.memory.put_length(buf, total)
        return Message(buf, buf[LENGTH:LENGTH + total])  # the size its receiver posts

    def payloads(self, message: Message, device: Any) -> Any:
        if message.payloads is None:
            message.payloads = framed_payloads(message.wire, self.memory)
        return message.payloads


def link_for(memory: Memory, transport: Transport, device_wire: bool = False) -> Link:
    """The link of ``memory``: gloo for host memory; for device memory nccl with
    ``device_wire`` (``transport`` then an ``NcclTransport``), staged otherwise."""
    if device_wire:
        return NcclLink(memory, transport)
    return GlooLink(memory, transport) if isinstance(memory, HostMemory) \
        else StagedLink(memory, transport)

