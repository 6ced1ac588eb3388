"""Broadcasts of Gluon parameters through the shared core."""

from __future__ import annotations

from typing import Any

import numpy as np

from hipress import distributed as core

__all__ = ["broadcast_parameters"]


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s values of ``params`` (a ``ParameterDict``, a dict
    of name to Parameter or NDArray), in name order.

    Example:
        >>> net.initialize(); net(x)            # shapes known
        >>> hp.broadcast_parameters(net.collect_params(), root_rank=0)
    """
    if not core.is_initialized():
        core.init()
    items = sorted(params.items())
    for _, p in items:
        arrays = p.list_data() if hasattr(p, "list_data") else [p]
        host = np.ascontiguousarray(arrays[0].asnumpy())
        core.broadcast_arrays([host.reshape(-1).view(np.uint8)], root_rank)
        for a in arrays:
            a[:] = host
