"""``hipress run``: start a job with torchrun's elastic agent plus HiPress defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from .errors import ConfigError
from .hosts import thread_share

__all__ = ["torchrun_command", "run", "run_shaped"]


def torchrun_command(nproc: int, command: Sequence[str], nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None, master_port: int = 29500) -> list[str]:
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        if master_addr is None:
            raise ConfigError("a multi-node job needs --master-addr (the address of node 0)")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank),
                "--master-addr", master_addr, "--master-port", str(master_port)]
    command = list(command)
    if command[0] in ("python", "python3"):
        # The interpreter that runs hipress, not whichever python PATH finds first: a
        # TensorFlow or MXNet job started from .venv-tf or .venv-mx stays in it.
        command[0] = sys.executable
    if not command[0].endswith(".py"):
        cmd.append("--no-python")
    return cmd + command


def run(nproc: int, command: Sequence[str], nnodes: int = 1, node_rank: int = 0,
        master_addr: str | None = None, master_port: int = 29500,
        algorithm: str | None = None, bandwidth: str | None = None,
        timeout: float | None = None) -> int:
    """Run ``command`` under torchrun with HiPress's environment; returns its exit code.

    Sets ``HIPRESS_ALGORITHM``, ``HIPRESS_BANDWIDTH`` (software-paced uplink per rank)
    and ``HIPRESS_TIMEOUT`` when given, and gives each rank an even share of the
    node's cores for kernels (``HIPRESS_THREADS``) unless already set.
    """
    env = dict(os.environ)
    if algorithm:
        env["HIPRESS_ALGORITHM"] = algorithm
    if bandwidth:
        from casync.transport import parse_rate

        parse_rate(bandwidth)
        env["HIPRESS_BANDWIDTH"] = bandwidth
    if timeout is not None:
        env["HIPRESS_TIMEOUT"] = str(timeout)
    share = thread_share(nproc)
    env.setdefault("HIPRESS_THREADS", str(share))
    env.setdefault("OMP_NUM_THREADS", str(share))
    cmd = torchrun_command(nproc, command, nnodes, node_rank, master_addr, master_port)
    try:
        return subprocess.run(cmd, env=env).returncode
    except KeyboardInterrupt:
        return 130


def run_shaped(ranks: int, bandwidth: str, args: list[str]) -> int:
    """Run ``args`` (a script and its options) on ``ranks`` shaped test hosts (root only):
    one torchrun agent per network namespace, as on ``ranks`` one-GPU nodes."""
    import subprocess

    from .hosts import shaped, thread_share

    with shaped(ranks, bandwidth) as hosts:
        procs = []
        for node, host in enumerate(hosts):
            cmd = torchrun_command(1, args, nnodes=ranks, node_rank=node,
                                   master_addr=hosts[0].addr, master_port=29531)
            # The namespaces share this host's cores: split them, or torch's and the
            # kernels' thread pools oversubscribe the CPU.
            share = str(thread_share(ranks))
            env = dict(os.environ, GLOO_SOCKET_IFNAME=host.ifname, HIPRESS_THREADS=share,
                       OMP_NUM_THREADS=share)
            env.pop("HIPRESS_BANDWIDTH", None)
            procs.append(subprocess.Popen([*host.prefix, *cmd], env=env))
        return max(abs(p.wait()) for p in procs)
