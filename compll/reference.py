"""The reference interpreter behind the native kernels' interface (target ``"ref"``).

``RefKernel`` answers the same calls as ``compll.loaders.CpuKernel``: single encodes and
decodes, and the batched ones on ``ENCODE_ITEM``/``DECODE_ITEM`` rows that carry host
addresses, with the kernels' semantics (error feedback's flag, an average of a sum,
payloads end to end, a bad segment named and the others decoded). So ``Codec`` and
CaSync's graphs run the NumPy oracle exactly as they run compiled code, and every path
that uses kernels can be checked against it.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from hipress_base.errors import HiPressError, PayloadError

from . import interpreter, ir
from .constants import FEEDBACK, SCALE_SUM
from .payload import frame_all, nonfinite

__all__ = ["RefKernel"]


def _view(address: int, count: int, dtype: Any) -> np.ndarray:
    """``count`` elements of ``dtype`` at a host address, without a copy (the caller keeps
    the memory alive, as it does for the kernels)."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype)


class RefKernel:
    """``compll.interpreter`` with the kernels' calling convention, on host memory."""

    target = "ref"

    def __init__(self, program: ir.Program) -> None:
        self.program = program

    # -- one tensor ---------------------------------------------------------------------------
    def encode(self, x: np.ndarray, seed: int, step: int, into: np.ndarray | None = None,
               residual: np.ndarray | None = None) -> np.ndarray:
        data = x
        if residual is not None:  # as the kernels: r += x, and the sum is encoded
            with np.errstate(invalid="ignore", over="ignore"):
                np.add(residual, x, out=residual)
            data = residual
        payload = interpreter.encode(self.program, data, seed, step)
        if into is not None and into.size >= payload.size:
            into[:payload.size] = payload
            return into[:payload.size]
        return payload

    def decode(self, payload: np.ndarray, n: int, out: np.ndarray, accumulate: bool,
               scale: float = 1.0, feedback: bool = False, scale_sum: bool = False) -> None:
        """Decode into ``out`` with the kernels' bits: a flagged payload writes NaN,
        ``feedback`` accumulates and zeroes non-finite results, ``scale_sum`` scales the
        sum ``out + values`` instead of the values."""
        values = interpreter.decode(self.program, payload, n)
        with np.errstate(invalid="ignore", over="ignore"):  # as quiet as the kernels
            if scale_sum:
                out += values
                out *= np.float32(scale)
                return
            if scale != 1.0:
                values = values * np.float32(scale)
            if nonfinite(payload) and not feedback:
                out[...] = np.nan  # the kernels write NaN, not out + NaN: same bits
            elif accumulate or feedback:
                out += values
            else:
                out[...] = values
            if feedback:
                out[~np.isfinite(out)] = 0.0

    # -- batches ------------------------------------------------------------------------------
    def encode_batch(self, items: np.ndarray, seed: int, buf: Any = None) -> int:
        """Encode every row into payloads end to end from the first row's ``out``; set each
        row's ``size``; return the total bytes."""
        pos = int(items["out"][0]) if items.size else 0
        total = 0
        for k, item in enumerate(items):
            n = int(item["n"])
            g = _view(int(item["g"]), n, np.float32)
            r = _view(int(item["r"]), n, np.float32) if item["r"] else None
            payload = self.encode(g, seed, int(item["step"]), residual=r)
            if payload.size > int(item["cap"]):
                raise HiPressError(f"{self.program.name} batched encode failed on ref: "
                                   f"segment {k}'s payload outgrew its worst-case size")
            if r is not None and int(item["flags"]) & FEEDBACK:
                self.decode(payload, n, r, True, -1.0, feedback=True)
            _view(pos + total, payload.size, np.uint8)[:] = payload
            items["size"][k] = payload.size
            total += payload.size
        return total

    def merge_encode_batch(self, items: np.ndarray, seed: int, msg: np.ndarray,
                           buf: Any = None) -> int:
        """Add the payloads of ``msg`` (one per row) into each row's ``g``, then encode as
        ``encode_batch``; nothing is merged when the payloads do not frame."""
        if not items.size and msg.size:
            raise PayloadError(f"{msg.size} bytes for no segments")
        self._decode_chained(msg, items["n"], items["g"], 1, 1.0, False)
        return self.encode_batch(items, seed, buf)

    def decode_batch(self, items: np.ndarray, accumulate: int, scale: float,
                     feedback: bool, device: Any = None) -> None:
        """Decode the payloads the first row's bytes hold end to end into each row's
        ``out``. A bad segment keeps its output, the others still decode, and the first
        bad one is reported (as the kernels do)."""
        if not items.size:
            return
        msg = _view(int(items["p"][0]), int(items["size"][0]), np.uint8)
        self._decode_chained(msg, items["n"], items["out"], accumulate, scale, feedback)

    def _decode_chained(self, msg: np.ndarray, ns: np.ndarray, outs: np.ndarray,
                        accumulate: int, scale: float, feedback: bool) -> None:
        count = len(ns)
        pos = 0
        first: PayloadError | None = None
        for k, size in enumerate(frame_all(msg, count)):
            n = int(ns[k])
            out = _view(int(outs[k]), n, np.float32)
            try:
                self.decode(msg[pos:pos + size], n, out, bool(accumulate), scale, feedback,
                            scale_sum=accumulate == SCALE_SUM)
            except PayloadError as exc:
                first = first or PayloadError(f"segment {k} of {count}: {exc}")
            pos += size
        if first is not None:
            raise first
