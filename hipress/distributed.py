"""The core every framework plugin shares: the process group, ranks and broadcasts.

``hipress.torch``, ``hipress.tensorflow`` and ``hipress.mxnet`` bind ``init``, ``rank``,
``size``, ``local_rank`` from here and only adapt their own tensor types; all of them
move data over ``torch.distributed`` (Gloo) through CaSync.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from typing import Any

import numpy as np

from .errors import ConfigError
from .hosts import free_port

__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "local_size",
           "gloo_group", "synchronizer", "broadcast_arrays", "broadcast_object", "shutdown"]

_state: dict[str, Any] = {"group": None, "initialized": False, "owns_group": False}
_engines: weakref.WeakSet[Any] = weakref.WeakSet()  # closed by shutdown()


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def init(backend: str | None = None, timeout: float = 1800.0) -> None:
    """Join the process group that ``torchrun`` or ``hipress run`` described.

    Without launcher variables (``RANK``, ``WORLD_SIZE``) it starts a group of one, so a
    script also runs as a single process. CaSync always talks over Gloo; when the
    default group is NCCL, a Gloo group over the same ranks is created for it.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; by default NCCL when CUDA is available and
            the launcher gave a ``LOCAL_RANK``, else Gloo.
        timeout: seconds the process group's own collectives may block.

    Example:
        >>> import hipress.torch as hp
        >>> hp.init(); print(hp.rank(), hp.size())
    """
    dist = _dist()
    if not dist.is_initialized():
        if backend is None:
            import torch

            backend = "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ \
                else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1, timeout=timedelta(seconds=timeout))
        _state["owns_group"] = True
    _state["group"] = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    _state["initialized"] = True


def is_initialized() -> bool:
    return bool(_state["initialized"])


def _require() -> Any:
    if not _state["initialized"]:
        raise ConfigError("HiPress is not initialized; call hp.init() first (after "
                          "launching with torchrun or hipress run)")
    return _dist()


def rank() -> int:
    """This process's rank in the job."""
    return int(_require().get_rank())


def size() -> int:
    """The number of ranks in the job."""
    return int(_require().get_world_size())


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK`` from the launcher)."""
    _require()
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_size() -> int:
    """Ranks on this node (``LOCAL_WORLD_SIZE`` from the launcher)."""
    _require()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def gloo_group() -> Any:
    """The Gloo process group CaSync talks over (``None`` means the default group)."""
    _require()
    return _state["group"]


def synchronizer(algorithm: str, **options: Any) -> Any:
    """A CaSync ``Synchronizer`` on the plugin's Gloo group (see ``casync.Synchronizer``)."""
    from casync import Synchronizer

    _require()
    engine = Synchronizer(algorithm, group=_state["group"], **options)
    _engines.add(engine)
    return engine


def broadcast_arrays(arrays: list[np.ndarray], root_rank: int = 0) -> None:
    """Overwrite each contiguous NumPy array with ``root_rank``'s, in order."""
    import torch

    dist = _require()
    for arr in arrays:
        if not arr.flags.c_contiguous:
            raise ConfigError("broadcast_arrays needs contiguous arrays")
        if arr.size:
            dist.broadcast(torch.from_numpy(arr), _global(root_rank), group=_state["group"])


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """``root_rank``'s picklable ``obj`` on every rank."""
    dist = _require()
    box = [obj]
    dist.broadcast_object_list(box, src=_global(root_rank), group=_state["group"])
    return box[0]


def _global(group_rank: int) -> int:
    group = _state["group"]
    if group is None:
        return group_rank
    return int(_dist().get_global_rank(group, group_rank))


def shutdown() -> None:
    """Finish the engines' last messages and leave the process group if ``init`` made it."""
    for engine in list(_engines):
        engine.close()
    _engines.clear()
    dist = _dist()
    if _state["owns_group"] and dist.is_initialized():
        dist.destroy_process_group()
    _state.update(group=None, initialized=False, owns_group=False)
