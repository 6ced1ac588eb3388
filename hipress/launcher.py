"""Starting jobs: ``hipress run`` (torchrun's elastic agent plus HiPress defaults), and
the ranks of a benchmark or the demo on local test hosts (``run_shaped``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from .errors import ConfigError, SyncError
from .hosts import Host, shaped, thread_share
from .network import free_port, interface_to

__all__ = ["torchrun_command", "run", "run_shaped", "run_on_hosts", "JOIN_TIMEOUT"]

#: Seconds ``hipress run`` waits for every node of a multi-node job before it names the
#: ones that never came (torchrun's own rendezvous would wait many minutes, silently).
JOIN_TIMEOUT = 180.0


def torchrun_command(nproc: int, command: Sequence[str], nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None, master_port: int = 29500,
                     max_restarts: int = 0) -> list[str]:
    """The ``torchrun`` command line that starts ``command`` on ``nproc`` ranks per node.

    A command that is not a ``.py`` script (``python x.py``, a console script) runs
    with ``--no-python``, as torchrun requires.

    Example:
        >>> torchrun_command(2, ["train.py", "--steps", "5"])[-3:]
        ['train.py', '--steps', '5']
    """
    if nproc < 1 or nnodes < 1:
        raise ConfigError("-np and --nnodes must be at least 1")
    if not command:
        raise ConfigError("nothing to run: give a script or command after the options, e.g. "
                          "hipress run -np 4 examples/torch_train.py")
    if max_restarts < 0:
        raise ConfigError("--max-restarts must be at least 0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        if master_addr is None:
            raise ConfigError("a multi-node job needs --master-addr (the address of node 0)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--master-addr", master_addr, "--master-port", str(master_port)]
    command = _this_python(command)
    if not command[0].endswith(".py"):
        cmd.append("--no-python")
    return cmd + command


def _this_python(command: Sequence[str]) -> list[str]:
    """``command`` with ``python`` meaning the interpreter that runs hipress, not whichever
    python PATH finds first: a TensorFlow or MXNet job started from .venv-tf or .venv-mx
    stays in it."""
    command = list(command)
    if command and command[0] in ("python", "python3"):
        command[0] = sys.executable
    return command


def run(nproc: int, command: Sequence[str], nnodes: int = 1, node_rank: int = 0,
        master_addr: str | None = None, master_port: int = 29500,
        algorithm: str | None = None, bandwidth: str | None = None,
        timeout: float | None = None, max_restarts: int = 0,
        join_timeout: float = JOIN_TIMEOUT) -> int:
    """Run ``command`` under torchrun with HiPress's environment; returns its exit code.

    With ``max_restarts``, torchrun's agent restarts every rank when one fails, up to that
    many times (the script resumes from its checkpoint: ``examples/torch_train.py
    --checkpoint DIR``). A multi-node job first waits, at most ``join_timeout`` seconds,
    for every node to check in at node 0 (``master_port + 1``), and names the nodes that
    did not (``SyncError``).

    Sets ``HIPRESS_ALGORITHM``, ``HIPRESS_BANDWIDTH`` (software-paced uplink per rank)
    and ``HIPRESS_TIMEOUT`` when given, and gives each rank's framework an even share of
    the node's cores (``OMP_NUM_THREADS``, as torchrun sets 1) unless already set; the
    kernels follow the framework (``compll.parallelism``). On several nodes
    it binds Gloo and NCCL to the interface that routes to ``master_addr``
    (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) unless the user chose one: by
    default they bind to the hostname's address, which is often loopback.
    """
    from casync.transport import parse_rate

    env = dict(os.environ)
    if algorithm:
        env["HIPRESS_ALGORITHM"] = algorithm
    if bandwidth:
        parse_rate(bandwidth)
        env["HIPRESS_BANDWIDTH"] = bandwidth
    if timeout is not None:
        env["HIPRESS_TIMEOUT"] = str(timeout)
    env.setdefault("OMP_NUM_THREADS", str(thread_share(nproc)))
    if max_restarts:
        # torchrun's agent shares one store between all its rendezvous rounds, so a
        # restarted rank can read the dead attempt's Gloo addresses and fail to connect;
        # a store per round has none.
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    cmd = torchrun_command(nproc, command, nnodes, node_rank, master_addr, master_port,
                           max_restarts)
    if nnodes > 1 and master_addr is not None:
        ifname = interface_to(master_addr)
        if ifname is not None:
            env.setdefault("GLOO_SOCKET_IFNAME", ifname)
            env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    try:
        if nnodes > 1:
            assert master_addr is not None  # torchrun_command checked it
            join(nnodes, node_rank, master_addr, master_port + 1, join_timeout)
        return subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:
        return 130


def join(nnodes: int, node_rank: int, master_addr: str, port: int, timeout: float) -> None:
    """Wait until all ``nnodes`` nodes have checked in at node 0's store on ``port``.

    Raises:
        ConfigError: ``node_rank`` is not below ``nnodes``.
        SyncError: after ``timeout`` seconds, naming the nodes that never came (or node 0,
            when its store never answered).
    """
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} is not a node of a {nnodes}-node job "
                          f"(0 to {nnodes - 1})")
    deadline = time.monotonic() + timeout
    absent = SyncError(f"node 0 ({master_addr}:{port}) did not answer within {timeout:g} s; "
                       "start it, or check --master-addr and --master-port")
    if node_rank != 0:  # wait for node 0's store quietly (the store's client logs each try)
        while not _listening(master_addr, port):
            if time.monotonic() > deadline:
                raise absent
            time.sleep(0.2)
    try:
        store = TCPStore(master_addr, port, nnodes, node_rank == 0,
                         timeout=timedelta(seconds=max(deadline - time.monotonic(), 1.0)),
                         wait_for_workers=False)
    except Exception:  # noqa: BLE001 - the store's own error names no node
        raise absent from None
    store.set(f"hipress/join/{node_rank}", "1")
    keys = [f"hipress/join/{n}" for n in range(nnodes)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [str(n) for n, key in enumerate(keys) if not store.check([key])]
            raise SyncError(f"node(s) {', '.join(missing)} of {nnodes} never joined within "
                            f"{timeout:g} s (waiting at {master_addr}:{port}); start them "
                            "with the same --nnodes, --master-addr and --master-port, or "
                            "raise --join-timeout")
        time.sleep(0.2)
    store.set(f"hipress/seen/{node_rank}", "1")
    if node_rank == 0:  # keep the store up until every node has seen the others
        seen = [f"hipress/seen/{n}" for n in range(nnodes)]
        while not store.check(seen) and time.monotonic() < deadline + 10:
            time.sleep(0.1)


def _listening(addr: str, port: int) -> bool:
    """Whether something accepts connections at ``addr:port`` now."""
    import socket

    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def run_shaped(ranks: int, bandwidth: str, args: list[str], per_node: int = 1) -> int:
    """Run ``args`` (a script and its options) on ``ranks`` shaped test hosts (root only):
    one rank per network namespace, as on one-GPU nodes, or ``per_node`` ranks sharing
    each namespace (``ranks / per_node`` nodes whose links alone are shaped)."""
    command = _this_python(args)
    if command[0].endswith(".py"):
        command.insert(0, sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "HIPRESS_BANDWIDTH"}  # real links
    if ranks % per_node:
        raise ConfigError(f"{ranks} ranks do not fill nodes of {per_node}")
    with shaped(ranks // per_node, bandwidth, per_node=per_node) as hosts:
        return max(abs(code) for code in run_on_hosts(hosts, command, env))


def run_on_hosts(hosts: Sequence[Host], command: Sequence[str],
                 env: Mapping[str, str] | None = None, grace: float = 10.0) -> list[int]:
    """Start ``command`` once per host as the ranks of one job and wait for them all.

    Each process gets the environment torchrun gives a worker (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``...; hosts with the same address are one node) and its
    interface for Gloo, and nothing else: no thread variables, as a job launched one
    process per host has none (a script that shares cores says so itself, with
    ``torch.set_num_threads``). No agents: the test hosts
    share one machine, and torchrun's per-node agents raced each other at exit. As
    torchrun does, when one rank fails the others are stopped (SIGTERM, then SIGKILL
    after ``grace`` seconds). Returns the exit codes in rank order.
    """
    import signal
    import time

    port = str(free_port())
    base = dict(os.environ if env is None else env)
    procs = []
    try:
        nodes = list(dict.fromkeys(h.addr for h in hosts))
        for rank, host in enumerate(hosts):
            node = [h for h in hosts if h.addr == host.addr]
            local_rank = sum(1 for h in hosts[:rank] if h.addr == host.addr)
            worker_env = dict(base, RANK=str(rank), WORLD_SIZE=str(len(hosts)),
                              LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(len(node)),
                              GROUP_RANK=str(nodes.index(host.addr)),
                              MASTER_ADDR=hosts[0].addr, MASTER_PORT=port,
                              GLOO_SOCKET_IFNAME=host.ifname)
            procs.append(subprocess.Popen([*host.prefix, *command], env=worker_env))
        stop_at = None
        while None in (codes := [p.poll() for p in procs]):
            failed = any(code not in (None, 0) for code in codes)
            if failed and stop_at is None:
                stop_at = time.monotonic() + grace
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
            if stop_at is not None and time.monotonic() > stop_at:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    finally:  # Ctrl-C or an error here: no rank outlives the launcher
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [int(p.returncode) for p in procs]
