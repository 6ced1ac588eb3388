"""The counter-based RNG, in NumPy. The C++ and CUDA templates implement the same
function, so a stochastic codec gives the same bits on every backend.

    mix(x)  = murmur3's fmix32
    k0      = mix(seed * 0x9E3779B9 + 0x7F4A7C15)
    k1      = mix(k0 ^ (step * 0x85EBCA77 + 0x165667B1))
    key     = mix(k1 ^ (stream * 0xC2B2AE3D + 0x27D4EB2F))
    h(i)    = mix(lo32(i) * 0x9E3779B9 + hi32(i) * 0x85EBCA77 + key)
    uniform = (h >> 8) * 2**-24                  # an f32 in [0, 1), exact
    randint(hi) = (h * hi) >> 32                 # in [0, hi), 64-bit product

All arithmetic is on unsigned 32-bit integers modulo 2**32. ``h`` is SplitMix's
construction, a Weyl sequence through one finaliser: kernels compute ``lo32(i) *
0x9E3779B9`` as a running sum, so a number costs the finaliser's two multiplies (a
second mix round doubled the cost of the stochastic codecs' encode). Element indices
stay below 2**32 in a codec call; ``hi32`` keeps the definition total.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix32", "stream_key", "hash_index", "uniform", "randint"]

_M = 0xFFFFFFFF


def mix32(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer on a uint32 array."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x85EBCA6B)
        x = x ^ (x >> np.uint32(13))
        x = x * np.uint32(0xC2B2AE35)
        x = x ^ (x >> np.uint32(16))
    return x


def _mix_int(x: int) -> int:
    return int(mix32(np.array([x & _M], dtype=np.uint32))[0])


def stream_key(seed: int, step: int, stream: int) -> int:
    """The 32-bit key of one random stream for one (seed, step)."""
    k0 = _mix_int((seed * 0x9E3779B9 + 0x7F4A7C15) & _M)
    k1 = _mix_int(k0 ^ ((step * 0x85EBCA77 + 0x165667B1) & _M))
    return _mix_int(k1 ^ ((stream * 0xC2B2AE3D + 0x27D4EB2F) & _M))


def hash_index(key: int, index: np.ndarray) -> np.ndarray:
    """h(i) for an array of uint64 element indices."""
    index = np.asarray(index, dtype=np.uint64)
    lo = (index & np.uint64(_M)).astype(np.uint32)
    hi = (index >> np.uint64(32)).astype(np.uint32)
    k = np.uint32(key)
    with np.errstate(over="ignore"):
        return mix32(lo * np.uint32(0x9E3779B9) + hi * np.uint32(0x85EBCA77) + k)


def uniform(key: int, index: np.ndarray) -> np.ndarray:
    """Uniform float32 numbers in [0, 1), one per index."""
    h = hash_index(key, index)
    return ((h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


def randint(key: int, index: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Uniform uint32 numbers in [0, hi), one per index (0 where hi is 0)."""
    h = hash_index(key, index).astype(np.uint64)
    return ((h * np.asarray(hi, dtype=np.uint64)) >> np.uint64(32)).astype(np.uint32)
