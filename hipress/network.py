"""What a rank needs of the network before its process group starts: a free port for a
group of one, and the interface that routes to the job's master (``hipress.distributed``
and the launcher use them; the test hosts of ``hipress.hosts`` stay off this path)."""

from __future__ import annotations

import os
import socket
from typing import Any

__all__ = ["free_port", "bind_to_master", "interface_to"]


def free_port() -> int:
    """A TCP port on this host that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bind_to_master(env: Any = None) -> str | None:
    """Before a process group starts: bind Gloo and NCCL to the interface that routes to
    ``MASTER_ADDR`` (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) unless the user chose
    one. By default they bind to the hostname's address, often loopback, and a job whose
    nodes' hostnames resolve so (containers, some clusters) never connects. Returns the
    interface set, or None."""
    env = os.environ if env is None else env
    master = env.get("MASTER_ADDR")
    if not master or "GLOO_SOCKET_IFNAME" in env:
        return None
    ifname = interface_to(master)
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
        env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    return ifname


def interface_to(addr: str) -> str | None:
    """The network interface through which this host reaches ``addr`` (the one holding
    the source address its route picks), or None when there is no route or it cannot
    tell: what Gloo and NCCL must bind to when the hostname resolves to loopback."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(addr), 9))  # a UDP connect sends nothing
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                # SIOCGIFADDR: the interface's IPv4 address
                info = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            continue  # no IPv4 address
        if socket.inet_ntoa(info[20:24]) == local:
            return name
    return None
