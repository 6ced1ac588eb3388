"""Load built kernel libraries and call them on NumPy arrays, CPU or CUDA tensors.

Both targets export the same C ABI (see ``templates/cpu_kernel.cpp.j2``):

    int64_t hp_encode(const float* g, float* r,         // if r: r += g, encode r
                      uint64_t n, uint32_t seed, uint32_t step,
                      uint8_t* out, uint64_t cap);      // payload size; writes if it fits
    int     hp_decode(const uint8_t* p, uint64_t size, uint64_t n, float* out,
                      int accumulate, float scale,           // out (+)= scale * v
                      int feedback,                          // out += scale * v, non-finite
                                                             //   results set to 0
                      char* err, uint64_t errcap);           // 0 or an error

    int64_t hp_encode_batch(EncItem* items, uint64_t count, uint32_t seed, int compact);
    int64_t hp_decode_batch(DecItem* items, uint64_t count, int accumulate, float scale,
                            int feedback, int chained, char* err, uint64_t errcap);
    int64_t hp_merge_encode_batch(EncItem* items, uint64_t count, uint32_t seed,
                                  int compact, const uint8_t* msg, uint64_t size,
                                  char* err, uint64_t errcap, int64_t* bad);

The batched calls take arrays of ``ENCODE_ITEM`` / ``DECODE_ITEM`` (``hp::EncItem`` and
``hp::DecItem`` in ``templates/host.h``): a chunk's segments in one native call, each
with its own payload. ``hp_merge_encode_batch`` is an aggregator's last merge and its
re-encode in one call: ``msg`` holds one payload per item, each added to the item's ``g``
before ``g`` is encoded (on the CPU in one pass over ``g``). On the CPU the pointers are
host memory (zero-copy views of NumPy arrays or CPU tensors); on the GPU they are device
pointers of CUDA tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np

from hipress_base.errors import ConfigError, HiPressError, PayloadError

from . import ir, parallelism
from .build import Artifact, build
from .constants import FEEDBACK, SCALE_SUM
from .ir import LengthKind, TypeKind
from .payload import algorithm_id, fixed_count, header_size, size_rule
from .reference import RefKernel

__all__ = ["Kernel", "CpuKernel", "CudaKernel", "EmuKernel", "load_kernel", "payload_size_hint",
           "ENCODE_ITEM", "DECODE_ITEM", "FEEDBACK", "SCALE_SUM"]

_ERRCAP = 512

#: one segment of ``hp_encode_batch``: input, residual (0: none), element count, payload
#: buffer and its capacity, the payload size (written by the call), RNG step, flags, and
#: the buffer of a deferred residual update (0: none; see ``hp::EncItem``)
ENCODE_ITEM = np.dtype([("g", "<u8"), ("r", "<u8"), ("n", "<u8"), ("out", "<u8"),
                        ("cap", "<u8"), ("size", "<i8"), ("step", "<u4"), ("flags", "<u4"),
                        ("keep", "<u8")])
#: one segment of ``hp_decode_batch``: payload and its size, element count, output
DECODE_ITEM = np.dtype([("p", "<u8"), ("size", "<u8"), ("n", "<u8"), ("out", "<u8")])


def payload_size_hint(program: ir.Program, n: int, dynamic_elems: int) -> int:
    """Payload bytes for ``n`` elements, counting run-time-length sections as
    ``dynamic_elems`` elements (exact when the layout has no such section)."""
    total = header_size(len(program.layout))
    for section in program.layout:
        ty = section.ty
        count = 1
        if ty.kind is not TypeKind.SCALAR:
            assert ty.length is not None
            fixed = fixed_count(ty.length, n)
            count = dynamic_elems if fixed is None else fixed
        total += (size_rule(ty).bytes(count) + 7) // 8 * 8
    return total


def _dynamic(program: ir.Program) -> bool:
    return any(s.ty.length is not None and s.ty.length.kind is LengthKind.SYM
               for s in program.layout)


class Kernel:
    """A loaded library with the CompLL ABI. Subclasses adapt the memory kind."""

    target = ""

    def __init__(self, program: ir.Program, artifact: Artifact) -> None:
        self.program = program
        self.artifact = artifact
        lib = ctypes.CDLL(str(artifact.library))
        lib.hp_encode.restype = ctypes.c_int64
        lib.hp_encode.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                                  ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                                  ctypes.c_uint64]
        lib.hp_decode.restype = ctypes.c_int
        lib.hp_decode.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                  ctypes.c_int, ctypes.c_char_p, ctypes.c_uint64]
        lib.hp_encode_batch.restype = ctypes.c_int64
        lib.hp_encode_batch.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                                        ctypes.c_int]
        lib.hp_decode_batch.restype = ctypes.c_int64
        lib.hp_decode_batch.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int,
                                        ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_char_p, ctypes.c_uint64]
        lib.hp_merge_encode_batch.restype = ctypes.c_int64
        lib.hp_merge_encode_batch.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                                              ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.c_uint64, ctypes.c_char_p,
                                              ctypes.c_uint64,
                                              ctypes.POINTER(ctypes.c_int64)]
        lib.hp_algorithm_id.restype = ctypes.c_uint32
        lib.hp_last_error.restype = ctypes.c_char_p
        if lib.hp_algorithm_id() != algorithm_id(program):
            raise ConfigError(f"{artifact.library} was built for another version of "
                              f"{program.name}; clear the cache and retry")
        self.lib = lib
        self.dynamic = _dynamic(program)
        self._last: dict[int, int] = {}  # n -> last payload size, to size the next buffer

    def capacity(self, n: int) -> int:
        if not self.dynamic:
            return payload_size_hint(self.program, n, 0)
        if n in self._last:
            return self._last[n] + self._last[n] // 4 + 64
        return payload_size_hint(self.program, n, max(1024, n // 64))

    def run_encode(self, x_ptr: int, r_ptr: int | None, n: int, seed: int, step: int,
                   alloc: Any) -> Any:
        """Encode into a buffer from ``alloc(size)``; retry once if the guess was short.
        With a residual the kernel adds ``x`` into it and encodes it, so a retry encodes
        the residual alone."""
        cap = self.capacity(n)
        out, out_ptr = alloc(cap)
        cap = len(out)  # a reused buffer may be larger than the guess
        size = self.lib.hp_encode(x_ptr, r_ptr, n, seed, step, out_ptr, cap)
        if size > cap:
            out, out_ptr = alloc(size)
            src = x_ptr if r_ptr is None else r_ptr
            size = self.lib.hp_encode(src, None, n, seed, step, out_ptr, size)
        if size < 0:
            message = self.lib.hp_last_error().decode(errors="replace")
            raise HiPressError(f"{self.program.name} encode failed on {self.target}: {message}")
        self._last[n] = int(size)
        return out[:size]

    def run_decode(self, p_ptr: int, size: int, n: int, out_ptr: int, accumulate: bool,
                   scale: float = 1.0, feedback: bool = False) -> None:
        err = ctypes.create_string_buffer(_ERRCAP)
        rc = self.lib.hp_decode(p_ptr, size, n, out_ptr, int(accumulate), scale,
                                int(feedback), err, _ERRCAP)
        if rc == 3:
            raise HiPressError(f"{self.program.name} decode failed on {self.target}: "
                               f"{err.value.decode(errors='replace')}")
        if rc != 0:
            raise PayloadError(err.value.decode(errors="replace"))


    def run_encode_batch(self, items: np.ndarray, seed: int, compact: bool) -> int:
        """Encode every ``ENCODE_ITEM``; with ``compact`` the payloads end up end to end
        from the first item's buffer. Returns their total bytes (0 without compact)."""
        total = self.lib.hp_encode_batch(items.ctypes.data, items.size, seed, int(compact))
        if total < 0:
            message = self.lib.hp_last_error().decode(errors="replace")
            over = [int(i) for i in np.flatnonzero(items["size"] > items["cap"].astype(np.int64))]
            if over:  # the capacities come from payload_size_hint, an upper bound
                message = f"segment {over[0]}'s payload outgrew its worst-case size"
            raise HiPressError(f"{self.program.name} batched encode failed on {self.target}: "
                               f"{message}")
        return int(total)

    def run_merge_encode_batch(self, items: np.ndarray, seed: int, msg_ptr: int,
                               size: int) -> int:
        """Add the payloads of ``msg`` (one per item, end to end) to each item's ``g``, then
        encode as :meth:`run_encode_batch` with compact. A bad payload is a PayloadError
        naming its segment; then nothing is encoded if the framing failed, and at most the
        items other than the bad one are."""
        err = ctypes.create_string_buffer(_ERRCAP)
        bad = ctypes.c_int64(-1)
        total = self.lib.hp_merge_encode_batch(items.ctypes.data, items.size, seed, 1,
                                               msg_ptr, size, err, _ERRCAP,
                                               ctypes.byref(bad))
        if total >= 0:
            return int(total)
        if bad.value >= 0:
            raise PayloadError(f"segment {bad.value} of {items.size}: "
                               f"{err.value.decode(errors='replace')}")
        message = err.value.decode(errors="replace") or \
            self.lib.hp_last_error().decode(errors="replace")
        raise HiPressError(f"{self.program.name} merge and encode failed on {self.target}: "
                           f"{message}")

    def run_decode_batch(self, items: np.ndarray, accumulate: int, scale: float,
                         feedback: bool, chained: bool) -> None:
        """Decode every ``DECODE_ITEM`` (``chained``: the first item's bytes hold one payload
        per item, end to end). A bad payload is a PayloadError naming its segment."""
        err = ctypes.create_string_buffer(_ERRCAP)
        bad = self.lib.hp_decode_batch(items.ctypes.data, items.size, int(accumulate), scale,
                                       int(feedback), int(chained), err, _ERRCAP)
        if bad < 0:
            return
        text = err.value.decode(errors="replace")
        if bad >= items.size:
            raise HiPressError(f"{self.program.name} batched decode failed on {self.target}: "
                               f"{text}")
        raise PayloadError(f"segment {bad} of {items.size}: {text}")


class CpuKernel(Kernel):
    """A C++ library called on host memory, on as many threads as ``compll.parallelism``
    chooses at each call (the framework's setting may change between calls)."""

    target = "cpu"

    def __init__(self, program: ir.Program, artifact: Artifact) -> None:
        super().__init__(program, artifact)
        self.lib.hp_set_threads.argtypes = [ctypes.c_int]
        self.lib.hp_threads.restype = ctypes.c_int
        self.lib.hp_pool_workers.restype = ctypes.c_int

    def team(self) -> int:
        """Set the thread count of the next call; returns it. Set at every call: the
        libraries share one pool and one setting (their runtime's statics are unique in
        the process), so another algorithm's call may have changed it."""
        wanted = parallelism.count()
        self.lib.hp_set_threads(wanted)
        return wanted

    def encode(self, x: np.ndarray, seed: int, step: int, into: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        self.team()
        def alloc(size: int) -> tuple[np.ndarray, int]:
            nonlocal into
            if into is not None and into.size >= size:
                buf, into = into, None  # use the caller's buffer once
            else:
                buf = np.empty(size, dtype=np.uint8)
            return buf, buf.ctypes.data

        r_ptr = None if residual is None else residual.ctypes.data
        return self.run_encode(x.ctypes.data, r_ptr, x.size, seed, step, alloc)

    def decode(self, payload: np.ndarray, n: int, out: np.ndarray, accumulate: bool,
               scale: float = 1.0, feedback: bool = False) -> None:
        self.team()
        self.run_decode(payload.ctypes.data, payload.size, n, out.ctypes.data, accumulate,
                        scale, feedback)

    def encode_batch(self, items: np.ndarray, seed: int, buf: np.ndarray) -> int:
        self.team()
        return self.run_encode_batch(items, seed, True)

    def decode_batch(self, items: np.ndarray, accumulate: int, scale: float,
                     feedback: bool) -> None:
        self.team()
        self.run_decode_batch(items, accumulate, scale, feedback, True)

    def merge_encode_batch(self, items: np.ndarray, seed: int, msg: np.ndarray,
                           buf: np.ndarray) -> int:
        self.team()
        return self.run_merge_encode_batch(items, seed, msg.ctypes.data, msg.size)


class CudaKernel(Kernel):
    """A CUDA library called on device memory of torch CUDA tensors.

    A call runs on the data's device and on torch's current stream there (the caller's
    ``torch.cuda.stream(...)``, else the default stream), so the caller orders it with
    its own work by streams and events; it returns after one synchronization of that
    stream, which the payload sizes need.
    """

    target = "cuda"

    def __init__(self, program: ir.Program, artifact: Artifact) -> None:
        super().__init__(program, artifact)
        self.lib.hp_set_stream.argtypes = [ctypes.c_void_p]

    @contextlib.contextmanager
    def _on(self, device: Any) -> Iterator[None]:
        import torch

        with torch.cuda.device(device):
            self.lib.hp_set_stream(torch.cuda.current_stream(device).cuda_stream)
            yield

    def encode(self, x: Any, seed: int, step: int, into: Any = None,
               residual: Any = None) -> Any:
        import torch

        def alloc(size: int) -> tuple[Any, int]:
            nonlocal into
            if into is not None and into.numel() >= size:
                buf, into = into, None
            else:
                buf = torch.empty(size, dtype=torch.uint8, device=x.device)
            return buf, buf.data_ptr()

        r_ptr = None if residual is None else residual.data_ptr()
        with self._on(x.device):
            return self.run_encode(x.data_ptr(), r_ptr, x.numel(), seed, step, alloc)

    def decode(self, payload: Any, n: int, out: Any, accumulate: bool,
               scale: float = 1.0, feedback: bool = False) -> None:
        if payload.data_ptr() % 8:
            raise PayloadError("a payload on the GPU must start 8-byte aligned; pass a copy")
        with self._on(out.device):
            self.run_decode(payload.data_ptr(), payload.numel(), n, out.data_ptr(), accumulate,
                            scale, feedback)

    def encode_batch(self, items: np.ndarray, seed: int, buf: Any) -> int:
        with self._on(buf.device):
            return self.run_encode_batch(items, seed, True)

    def decode_batch(self, items: np.ndarray, accumulate: int, scale: float,
                     feedback: bool, device: Any = None) -> None:
        import torch

        if items.size and int(items["p"][0]) % 8:
            raise PayloadError("a payload on the GPU must start 8-byte aligned; pass a copy")
        with self._on(torch.cuda.current_device() if device is None else device):
            self.run_decode_batch(items, accumulate, scale, feedback, True)

    def merge_encode_batch(self, items: np.ndarray, seed: int, msg: Any, buf: Any) -> int:
        if msg.data_ptr() % 8:
            raise PayloadError("a payload on the GPU must start 8-byte aligned; pass a copy")
        with self._on(buf.device):
            return self.run_merge_encode_batch(items, seed, msg.data_ptr(), msg.numel())


class EmuKernel(CpuKernel):
    """The CUDA library built for ``cuda-emu``: the generated CUDA source run on the CPU
    by ``templates/emu/cuda_runtime.h``, whose "device" memory is host memory, so it is
    called on NumPy arrays and CPU tensors exactly as the CPU target is."""

    target = "cuda-emu"

    def __init__(self, program: ir.Program, artifact: Artifact) -> None:
        Kernel.__init__(self, program, artifact)

    def team(self) -> int:
        return 1  # the emulator schedules its simulated threads on the caller


def load_kernel(program: ir.Program, target: str) -> Kernel | RefKernel:
    """Build (or fetch from the cache) and load ``program`` for ``target``; ``"ref"`` is
    the reference interpreter behind the same interface (nothing to build)."""
    if target == "ref":
        return RefKernel(program)
    artifact = build(program, target)
    kinds = {"cpu": CpuKernel, "cuda": CudaKernel, "cuda-emu": EmuKernel}
    return kinds[target](program, artifact)
