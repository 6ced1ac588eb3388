"""How many threads the CPU kernels run, chosen each time a kernel runs.

The count follows what the process was given, in this order:

1. ``HIPRESS_THREADS``, if set (the user's explicit choice, taken as it is);
2. else the framework's intra-op setting, read now rather than once at import: the one a
   plugin follows (``follow``; ``hipress.tensorflow`` and ``hipress.mxnet`` register
   theirs), else ``torch.get_num_threads()`` when torch is imported;
3. never more than the cores of the process's affinity mask divided by the ranks on its
   node (``LOCAL_WORLD_SIZE`` from torchrun, ``SLURM_NTASKS_PER_NODE``,
   ``OMPI_COMM_WORLD_LOCAL_SIZE``), and the whole share when no framework says.

A script that calls ``torch.set_num_threads(1)`` so that its ranks share the cores gets
kernels on one thread as well, however it was launched; a rank alone on a node with
eight cores and torch's default threads gets eight. The kernels' idle threads sleep
(``templates/cpu_pool.h``), so they take no core from the framework between calls.

Example:
    >>> import compll.parallelism
    >>> str(compll.parallelism.threads())
    '1: torch.get_num_threads() = 1 (cap: 2 cores / 1 rank per node)'
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hipress_base.errors import ConfigError

__all__ = ["Threads", "threads", "count", "follow", "RANKS_PER_NODE"]

#: The launchers' variables for the ranks on this node, in the order they are read.
RANKS_PER_NODE = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")

#: The framework the kernels follow: its name and a function giving its intra-op threads
#: (None or 0: not set, take the whole share).
_followed: list[tuple[str, Callable[[], int | None]]] = []


@dataclass(frozen=True)
class Threads:
    """The kernels' thread count and why.

    Attributes:
        count: threads a kernel call runs on.
        source: where the count came from: ``HIPRESS_THREADS``, the framework's setting
            (``torch.get_num_threads()``...), or ``cores`` (the cap itself).
        requested: what that source asked for (before the cap).
        cores: cores in the process's affinity mask.
        ranks_per_node: ranks sharing them, and the variable that said so (``None``: one).
    """

    count: int
    source: str
    requested: int
    cores: int
    ranks_per_node: int
    ranks_from: str | None

    @property
    def cap(self) -> int:
        """The share of the node's cores of one rank."""
        return max(1, self.cores // self.ranks_per_node)

    def __str__(self) -> str:
        ranks = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node > 1 else ''} per node"
        if self.ranks_from:
            ranks += f" ({self.ranks_from})"
        share = f"cap: {self.cores} cores / {ranks}"
        if self.source == "cores":
            return f"{self.count}: the cores' share ({share})"
        return f"{self.count}: {self.source} = {self.requested} ({share})"


def follow(name: str, intra_op: Callable[[], int | None]) -> None:
    """Make the kernels follow a framework's intra-op thread setting: ``intra_op()`` is
    called each time a count is chosen (a plugin registers its framework at import).

    Example:
        >>> follow("tf.config.threading.get_intra_op_parallelism_threads()",
        ...        tf.config.threading.get_intra_op_parallelism_threads)
    """
    _followed[:] = [(name, intra_op)]


def _framework() -> tuple[str, int | None] | None:
    if _followed:
        name, intra_op = _followed[0]
        return name, intra_op()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        return "torch.get_num_threads()", int(torch.get_num_threads())
    return None


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity masks on this platform
        return max(1, os.cpu_count() or 1)


def _ranks_per_node() -> tuple[int, str | None]:
    for name in RANKS_PER_NODE:
        raw = os.environ.get(name, "")
        # Slurm writes heterogeneous layouts as "2(x3),1": the first node's count
        digits = raw.split("(")[0].split(",")[0].strip()
        if digits.isdigit() and int(digits) > 0:
            return int(digits), name
    return 1, None


def _explicit() -> int | None:
    raw = os.environ.get("HIPRESS_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"HIPRESS_THREADS={raw!r} must be a whole number of threads >= 1 "
                          "(or unset: the framework's setting)")
    return int(raw)


def threads() -> Threads:
    """The thread count a CPU kernel call takes now, with where it came from.

    Raises:
        ConfigError: ``HIPRESS_THREADS`` is set to something other than a count >= 1.
    """
    cores = _cores()
    ranks, ranks_from = _ranks_per_node()
    cap = max(1, cores // ranks)
    explicit = _explicit()
    if explicit is not None:
        return Threads(explicit, "HIPRESS_THREADS", explicit, cores, ranks, ranks_from)
    name, wanted = _framework() or ("", None)
    if wanted:
        return Threads(min(int(wanted), cap), name, int(wanted), cores, ranks, ranks_from)
    return Threads(cap, "cores", cap, cores, ranks, ranks_from)


def count() -> int:
    """``threads().count``: what a kernel call sets before it runs."""
    return threads().count
