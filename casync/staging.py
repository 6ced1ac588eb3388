"""How a submitted tensor becomes an ``Entry`` the engine works on, and how it is given
back: its flat float32 buffer, the future its caller waits on, the copy back."""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError

from .chunks import Entry
from .devices import Memory, memory_of

__all__ = ["DEVICE_TYPES", "Completion", "entry", "future", "give_back", "stage"]

#: tensors of these device types stay where they are and take the device path (torch
#: buffers, staged messages); tests add "cpu" to run that path on CPU tensors
DEVICE_TYPES = {"cuda"}


class Completion:
    """The future of a ``submit`` or a ``submit_many``, shared by its entries: it resolves
    to ``value`` (the tensor, or the batch's list of tensors) once the last of its
    ``left`` entries holds the average."""

    __slots__ = ("future", "left", "value")

    def __init__(self, future: Any, left: int, value: Any) -> None:
        self.future = future
        self.left = left
        self.value = value

    def done(self) -> bool:
        return bool(self.future.done())

    def set_exception(self, error: BaseException) -> None:
        self.future.set_exception(error)

    def finished(self, count: int) -> bool:
        """``count`` more entries hold their average; True once all do. Callers hold
        the engine's completion lock: graphs finish on several threads."""
        self.left -= count
        return self.left == 0

    def resolve(self) -> None:
        self.future.set_result(self.value)


@functools.cache
def _pending_class() -> type:
    """The future class, made on first use: NumPy-only callers never import torch."""
    import torch

    class Pending(torch.futures.Future):
        """A ``torch.futures.Future`` whose ``wait()`` first sends its chunk."""

        _engine: Any = None

        def wait(self) -> Any:
            engine = self._engine() if self._engine is not None else None
            if engine is not None and not self.done():
                engine.flush()
            return super().wait()

    return Pending


def future(engine: Any, *memories: Memory | None) -> Any:
    """A future for tensors on ``memories`` that sends its chunk when waited on: a tensor
    waits in a chunk still filling until more tensors come or the step ends, and a
    caller that waits first would wait forever. The send happens at the wait, a point of
    the program every rank reaches in the same order, so the ranks' chunks stay equal.
    CUDA-aware on GPUs (torch refuses CUDA values in a CPU future; this one makes its
    waiters' streams wait for the engine's)."""
    import torch

    pending = _pending_class()
    devices = [torch.device(m.device) for m in memories if m is not None and m.cuda]
    made = pending(devices=devices) if devices else pending()
    made._engine = weakref.ref(engine)  # no cycle through the engine's entries
    return made


def stage(tensor: Any) -> tuple[Any, bool, int, Memory | None]:
    """The flat float32 buffer the engine works on for ``tensor``, whether results must be
    copied back, the buffer's address and its memory (None: the host).

    Host float32 data is used in place (NumPy arrays and CPU tensors, as NumPy views). A
    CUDA tensor stays on its GPU: float32 in place, fp16/bf16/f64 upcast there."""
    if isinstance(tensor, np.ndarray):
        if tensor.dtype == np.float32 and tensor.flags.c_contiguous \
                and tensor.flags.writeable:
            flat = tensor.reshape(-1)
            return flat, False, flat.ctypes.data, None
        if tensor.dtype.kind != "f":
            raise ConfigError(f"gradients must be floating point, not {tensor.dtype}")
        flat = np.ascontiguousarray(tensor, dtype=np.float32).reshape(-1)
        return flat, True, flat.ctypes.data, None
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"submit() takes a torch tensor or NumPy array, not "
                          f"{type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ConfigError(f"gradients must be floating point, not {tensor.dtype}")
    t = tensor.detach()
    same = t.dtype == torch.float32 and t.is_contiguous()
    if t.device.type == "cpu" and "cpu" not in DEVICE_TYPES:
        if same:
            return t.view(-1).numpy(), False, t.data_ptr(), None
        host = t.to(dtype=torch.float32).contiguous().view(-1)
        return host.numpy(), True, host.data_ptr(), None
    if t.device.type not in DEVICE_TYPES:
        raise ConfigError(f"CaSync takes CPU and CUDA tensors, not {t.device.type}")
    on_gpu = t.view(-1) if same else t.to(dtype=torch.float32).contiguous().view(-1)
    return on_gpu, not same, on_gpu.data_ptr(), memory_of(on_gpu)


def entry(name: str, tensor: Any, completion: Completion | None) -> Entry:
    """``tensor`` staged (``stage``) as the ``Entry`` of ``name`` that ``completion``
    resolves."""
    # The common case first, in a few attribute reads and no tuple: an entry per tensor
    # per step makes this the engine's hottest Python. A torch tensor means torch is
    # loaded, so its module is looked up, never imported, here.
    torch = sys.modules.get("torch")
    if (torch is not None and type(tensor) is torch.Tensor
            and tensor.dtype is torch.float32 and tensor.is_cpu
            and not tensor.requires_grad and tensor.is_contiguous()
            and "cpu" not in DEVICE_TYPES):
        flat = tensor.numpy()
        return Entry(name, tensor, flat if flat.ndim == 1 else flat.reshape(-1),
                     write_back=False, future=completion, ptr=tensor.data_ptr())
    buf, write_back, ptr, memory = stage(tensor)
    return Entry(name, tensor, buf, write_back=write_back, future=completion, ptr=ptr,
                 memory=memory)


def give_back(entry: Entry) -> None:
    """Copy the average into the submitted tensor where the engine worked on a copy."""
    if not entry.write_back:
        return
    if isinstance(entry.tensor, np.ndarray):
        entry.tensor[...] = entry.buf.reshape(entry.tensor.shape)
        return
    import torch

    values = entry.buf if isinstance(entry.buf, torch.Tensor) else torch.from_numpy(entry.buf)
    entry.tensor.detach().copy_(values.view(entry.tensor.shape))
