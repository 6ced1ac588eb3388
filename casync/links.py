"""How an engine's chunks travel: one ``Link`` per memory, chosen on first use."""

from __future__ import annotations

import logging
import os
from typing import Any

from hipress_base.errors import ConfigError

from .devices import HostMemory, Link, Memory, link_for
from .transport import NcclTransport, Transport

__all__ = ["Links", "cuda_transport_of"]

_log = logging.getLogger("hipress")
_HOW = {"gloo": "host buffers over Gloo",
        "staged": "compressed on the GPU, the payloads staged through pinned host memory "
                  "over Gloo",
        "nccl": "compressed on the GPU, the payloads over NCCL at their worst-case sizes"}


def cuda_transport_of(choice: str | Transport | None) -> str | Transport:
    """``staged`` or ``nccl`` (or a test's transport): the argument, else
    ``HIPRESS_CUDA_TRANSPORT``, else ``auto``, which is ``nccl`` when the default process
    group is NCCL (one GPU per rank, as ``hp.init`` sets up) and ``staged`` otherwise."""
    if isinstance(choice, Transport):
        return choice
    raw = choice or os.environ.get("HIPRESS_CUDA_TRANSPORT") or "auto"
    if raw not in ("auto", "staged", "nccl"):
        raise ConfigError(f"cuda_transport={raw!r}: give 'auto', 'staged' or 'nccl'")
    if raw != "auto":
        return raw
    import torch.distributed as dist

    nccl = dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    return "nccl" if nccl else "staged"


class Links:
    """The links of an engine's chunks (``casync.devices``): host buffers over its
    transport; CUDA buffers ``staged`` over the same transport or over NCCL.

    Args:
        transport: the engine's (Gloo) transport.
        cuda_transport: ``staged``, ``nccl`` or a test's transport (``cuda_transport_of``).
        nccl_group: the NCCL group over the same ranks (default the world).
    """

    def __init__(self, transport: Transport, cuda_transport: str | Transport,
                 nccl_group: Any = None) -> None:
        self.transport = transport
        self.cuda_transport = cuda_transport
        self._nccl_group = nccl_group
        #: the links made so far, by device
        self.made: dict[str, Link] = {}
        self._device_transport: Transport | None = None

    def of(self, memory: Memory | None) -> Link:
        """How chunks on ``memory`` (None: the host) travel; the first use of each is
        logged."""
        memory = memory if memory is not None else HostMemory()
        link = self.made.get(memory.device)
        if link is None:
            if isinstance(memory, HostMemory) or self.cuda_transport == "staged":
                link = link_for(memory, self.transport)
            else:
                link = link_for(memory, self._device_wire(), device_wire=True)
            self.made[memory.device] = link
            _log.info("CaSync rank %d: tensors on %s travel %s (%s)", self.transport.rank,
                      memory.device, link.name, _HOW[link.name])
        return link

    def _device_wire(self) -> Transport:
        """The transport of device-resident messages: NCCL, or the one a test gave."""
        if isinstance(self.cuda_transport, Transport):
            return self.cuda_transport
        if self._device_transport is None:
            nccl = NcclTransport(self._nccl_group)
            mine = (self.transport.rank, self.transport.size)
            if (nccl.rank, nccl.size) != mine:
                raise ConfigError(f"the NCCL group has rank {nccl.rank} of {nccl.size} where "
                                  f"the engine's group has rank {mine[0]} of {mine[1]}; "
                                  "pass nccl_group= over the same ranks")
            self._device_transport = nccl
        return self._device_transport
