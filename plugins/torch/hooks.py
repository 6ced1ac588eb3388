"""The DDP communication hook: ``ddp.register_comm_hook(HookState(...), comm_hook)``."""

# No "from __future__ import annotations": DDP checks the hook's real annotations.

from typing import Any

import hipress
import torch
import torch.distributed as dist
from hipress import distributed as core

__all__ = ["HookState", "comm_hook"]

PLANS = ("static",)


class HookState:
    """What ``comm_hook`` compresses with, and the engine it runs on.

    Args:
        algorithm: a CompLL algorithm (``hipress.algorithms()``) or ``"none"``.
        plan: ``"static"``: compress buffers of at least ``min_compress`` elements.
        topology: ``ps``, ``ring`` or ``allgather``.
        error_feedback: ``None`` = on for biased algorithms.
        min_compress: smaller buckets go through a plain allreduce.
        timeout: seconds before a silent peer raises ``SyncError``.
        **codec_params: the algorithm's parameters (e.g. ``ratio=0.001`` for dgc).

    Example:
        >>> ddp.register_comm_hook(hp.HookState(algorithm="dgc", ratio=0.01), hp.comm_hook)
    """

    def __init__(self, algorithm: str = "onebit", plan: str = "static", topology: str = "ps",
                 error_feedback: bool | None = None, min_compress: int = 16384,
                 timeout: float | None = None, **codec_params: Any) -> None:
        # user knobs
        if algorithm != "none" and algorithm not in hipress.algorithms():
            raise ValueError(f"unknown algorithm {algorithm!r}; choose 'none' or one of "
                             f"{', '.join(hipress.algorithms())}")
        if plan not in PLANS:
            raise ValueError(f"plan={plan!r} is not available: this version plans statically "
                             "(plan='static'); the cost-model planner is not built yet")
        if topology not in ("ps", "ring", "allgather"):
            raise ValueError(f"topology must be ps, ring or allgather, not {topology!r}")
        if min_compress < 0:
            raise ValueError(f"min_compress must be >= 0, not {min_compress}")
        self.algorithm = algorithm
        self.plan = plan
        self.topology = topology
        self.error_feedback = error_feedback
        self.min_compress = min_compress
        self.timeout = timeout
        self.codec_params = codec_params
        # internal state, created on the first bucket (the process group exists by then)
        self.sync: Any = None
        # statistics
        self.steps = 0

    def synchronizer(self) -> Any:
        if self.sync is None:
            from casync import StaticPlanner

            if not core.is_initialized():
                core.init()
            planner = StaticPlanner(self.algorithm, self.topology,
                                    min_compress=self.min_compress, **self.codec_params)
            self.sync = core.synchronizer(self.algorithm, topology=self.topology,
                                          planner=planner, error_feedback=self.error_feedback,
                                          timeout=self.timeout, **self.codec_params)
        return self.sync

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent through the hook so far."""
        return 0 if self.sync is None else int(self.sync.transport.bytes_sent)

    def __getstate__(self) -> dict[str, Any]:
        # Engines and process groups do not travel in pickles.
        return {k: v for k, v in self.__dict__.items() if k != "sync"} | {"sync": None}


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average a DDP gradient bucket with CaSync; the future resolves to the bucket buffer.

    Follows DDP's hook contract: returns at once and decodes in place. Each parameter's
    gradient is compressed on its own (codecs such as onebit keep one scale per tensor,
    and one scale for a whole bucket loses accuracy); gradients too small to compress
    are batched and go through a plain allreduce.
    """
    sync = state.synchronizer()
    buffer = bucket.buffer()
    grads = _views_into(buffer, bucket.gradients())
    if grads is None:
        future = sync.submit(f"bucket{bucket.index()}", buffer)
    else:
        parts = [sync.submit(f"bucket{bucket.index()}.{i}", g) for i, g in enumerate(grads)]

        def whole(done: torch.futures.Future[list[torch.futures.Future[Any]]]) -> torch.Tensor:
            for part in done.value():
                part.value()  # re-raises a SyncError
            return buffer

        future = torch.futures.collect_all(parts).then(whole)
    if bucket.is_last():
        sync.end_step()
        state.steps += 1
    return future


def _views_into(buffer: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The bucket's gradients as flat views of ``buffer``, or None if they are copies."""
    start, itemsize = buffer.data_ptr(), buffer.element_size()
    views, offset = [], 0
    for g in grads:
        if g.data_ptr() != start + offset * itemsize or not g.is_contiguous():
            return None
        views.append(buffer[offset:offset + g.numel()])
        offset += g.numel()
    return views if offset == buffer.numel() else None
