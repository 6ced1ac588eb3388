"""MXNet NDArrays as host buffers the engine can average in place (DLPack, no copy)."""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

__all__ = ["host_view", "local_sum", "stage", "write_back"]


def host_view(array: mx.nd.NDArray) -> Any:
    """A writable torch view of a CPU float32 NDArray's memory (zero copy), or a float32
    NumPy copy of any other array; returns ``(buffer, needs_copy_back)``.

    Waits for the pending MXNet operations that write ``array`` first.
    """
    import torch.utils.dlpack

    array.wait_to_read()
    if array.context.device_type == "cpu" and array.dtype == np.float32 \
            and array.stype == "default":
        return torch.utils.dlpack.from_dlpack(array.to_dlpack_for_write()).view(-1), False
    return array.asnumpy().astype(np.float32).reshape(-1), True


def local_sum(values: list[mx.nd.NDArray]) -> mx.nd.NDArray:
    """The sum of one gradient's copies on this worker's devices (on the first's)."""
    if len(values) == 1:
        return values[0]
    ctx = values[0].context
    total = values[0].copy()
    for v in values[1:]:
        total += v.as_in_context(ctx)
    return total


def stage(values: list[mx.nd.NDArray], outs: list[mx.nd.NDArray]) -> tuple[Any, list[Any]]:
    """A host buffer holding the sum of one gradient's per-device ``values``, and the
    arrays of ``outs`` that must receive the result (none when the buffer is the only
    one's own memory)."""
    buf, copied = host_view(local_sum(values))
    in_place = not copied and len(values) == 1 and len(outs) == 1 and outs[0] is values[0]
    return buf, [] if in_place else outs


def write_back(buf: Any, targets: list[mx.nd.NDArray]) -> None:
    """Copy a synchronized host buffer into ``targets``."""
    data = buf.numpy() if hasattr(buf, "numpy") else buf
    for t in targets:
        t[:] = data.reshape(t.shape)
