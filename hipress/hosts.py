"""Local test hosts for benchmarks and the demo: loopback, or one namespace per rank.

Shaped mode (root only) builds what a small cluster looks like: a network namespace
per node, each joined to one bridge by a veth pair, and each link shaped with
``tc ... tbf`` in both directions (default 1 Gbit/s). A node holds one rank, or
``per_node`` ranks that share its namespace and address, so traffic between them stays
on the node (unshaped, as between the GPUs of one machine) while traffic between nodes
takes the shaped links. Ranks run inside their namespace with ``ip netns exec``.
Everything is removed on exit, also after a failure or Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from casync.transport import parse_rate

from .errors import ConfigError

__all__ = ["Host", "loopback", "shaped", "parse_rate", "thread_share"]


@dataclass(frozen=True)
class Host:
    """Where one rank runs: a command prefix, its address and its interface."""

    prefix: tuple[str, ...]
    addr: str
    ifname: str


def thread_share(ranks: int) -> int:
    """Threads each of ``ranks`` processes on this host gets so the cores are not
    oversubscribed (at least one)."""
    return max(1, (os.cpu_count() or 1) // max(ranks, 1))


@contextmanager
def loopback(n: int) -> Iterator[list[Host]]:
    """n ranks on this host's loopback interface (no shaping)."""
    yield [Host((), "127.0.0.1", "lo")] * n


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _quiet(*args: str) -> None:
    subprocess.run(list(args), capture_output=True, text=True)


@contextmanager
def shaped(n: int, rate: str = "1gbit", tag: str = "hp",
           per_node: int = 1) -> Iterator[list[Host]]:
    """n namespaces (nodes) on a bridge, each link shaped to ``rate`` each way, and
    ``per_node`` hosts (ranks) in each, node by node; needs root."""
    parse_rate(rate)
    if per_node < 1:
        raise ConfigError(f"per_node must be at least 1, not {per_node}")
    if os.geteuid() != 0:
        raise PermissionError("shaped test hosts need root (ip netns, tc); run as root or "
                              "use --network loopback")
    # SIGTERM (timeout, kill) must unwind through the cleanup below, not skip it.
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    prefix = f"{tag}{os.getpid() % 10000}"
    bridge = f"{prefix}br"
    namespaces = [f"{prefix}n{i}" for i in range(n)]
    # The burst must hold a whole GSO segment (64 KiB) or tbf drops it.
    tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        hosts = []
        for i, ns in enumerate(namespaces):
            outer, inner = f"{prefix}v{i}", f"{prefix}e{i}"
            addr = f"10.77.{os.getpid() % 200}.{i + 1}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner,
                            "root", *tbf], check=True, capture_output=True)
            subprocess.run(["tc", "qdisc", "add", "dev", outer, "root", *tbf], check=True,
                           capture_output=True)
            hosts += [Host(("ip", "netns", "exec", ns), addr, inner)] * per_node
        yield hosts
    finally:
        for i, ns in enumerate(namespaces):
            _quiet("ip", "netns", "del", ns)   # takes the veth pair with it
            _quiet("ip", "link", "del", f"{prefix}v{i}")
        _quiet("ip", "link", "del", bridge)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
