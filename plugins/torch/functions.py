"""Broadcasts of model and optimizer state from one rank to all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hipress import distributed as core


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, Any]],
                         root_rank: int = 0) -> None:
    """Overwrite every tensor with ``root_rank``'s values, in place.

    Args:
        params: ``model.state_dict()`` or ``model.named_parameters()``.
        root_rank: the rank whose values win.

    Example:
        >>> hp.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    items = params.items() if isinstance(params, Mapping) else params
    for _, tensor in items:
        t = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        if t.device.type == "cpu" and t.is_contiguous():
            core.broadcast_arrays([_numpy_view(t)], root_rank)
            continue
        host = t.detach().to("cpu").contiguous()
        core.broadcast_arrays([_numpy_view(host)], root_rank)
        t.copy_(host)


def _numpy_view(t: torch.Tensor) -> Any:
    # Gloo broadcasts bytes: view any dtype (bf16 included) as uint8.
    return t.detach().view(-1).view(torch.uint8).numpy()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state (momenta, step counts, lr).

    Example:
        >>> hp.broadcast_optimizer_state(opt, root_rank=0)
    """
    # The optimizer's own state only: a DistributedOptimizer's HiPress state is per rank.
    mine = torch.optim.Optimizer.state_dict(optimizer) if core.rank() == root_rank else None
    state = core.broadcast_object(mine, root_rank)
    if core.rank() != root_rank:
        torch.optim.Optimizer.load_state_dict(optimizer, state)
