"""The naive baseline: compression bolted onto collectives, tensor by tensor.

What compression usually looks like when added to a training loop by hand (GRACE-style
compress-and-allgather): per tensor, encode, all-gather the payload sizes, all-gather the
payloads padded to the longest, decode every rank's payload and average, one tensor
after another: no pipelining, no coalescing. ``hipress bench sync`` measures it beside
the engine, the profiler times its per-tensor cost, and the simulator models it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["naive_step"]


def naive_step(dist: Any, codec: Any, tensors: Sequence[Any], group: Any = None) -> None:
    """Average ``tensors`` (float32 CPU torch tensors, in place) over ``group`` the naive
    way. Every rank calls it with the same tensor sizes."""
    import torch

    world = dist.get_world_size(group)
    for t in tensors:
        payload = torch.from_numpy(codec.encode(t))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group)
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:payload.numel()] = payload
        got = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(got, mine, group=group)
        acc = np.zeros(t.numel(), np.float32)
        for buf, size in zip(got, sizes, strict=True):
            codec.decode(buf[:int(size.item())].numpy(), t.numel(), out=acc, accumulate=True)
        t.copy_(torch.from_numpy(acc / world))
