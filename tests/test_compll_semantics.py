"""The reference interpreter's exact semantics: packing, integers, casts, sums, RNG."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compll import interpreter as I
from compll import load_source, payload, rng
from compll.builtins import OPERATORS

pytestmark = pytest.mark.pure


def test_pack_is_lsb_first():
    ones = I.pack(np.array([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=np.uint8), 1)
    assert ones.data.tolist() == [0b00001101, 0b00000001]
    twos = I.pack(np.array([3, 0, 1, 2, 7], dtype=np.uint8), 2)
    assert twos.data.tolist() == [3 | 1 << 4 | 2 << 6, 3]  # 7 keeps its low 2 bits
    nibbles = I.pack(np.array([0xA, 0x5, 0xF], dtype=np.uint8), 4)
    assert nibbles.data.tolist() == [0x5A, 0x0F]


@given(st.sampled_from([1, 2, 4, 8]), st.lists(st.integers(0, 255), max_size=70))
def test_unpack_inverts_pack(bits, values):
    v = np.array(values, dtype=np.uint8)
    p = I.pack(v, bits)
    assert p.data.size == (len(values) * bits + 7) // 8
    np.testing.assert_array_equal(I.unpack(p), v & ((1 << bits) - 1))


def c_div(a, b):
    if b == 0:
        return 0, 0
    q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
    return q, a - q * b


@given(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**31), 2**31 - 1))
def test_integer_division_truncates_like_c(a, b):
    x, y = np.array([a], np.int32), np.array([b], np.int32)
    q, r = c_div(a, b)
    wrap = lambda v: (v + 2**31) % 2**32 - 2**31  # noqa: E731
    assert int(OPERATORS["/"].numpy(x, y, "i32")[0]) == wrap(q)
    assert int(OPERATORS["%"].numpy(x, y, "i32")[0]) == wrap(r)


def test_casts_saturate_and_wrap():
    f = np.array([300.7, -5.5, np.nan, 1e10, -1e10, np.inf], dtype=np.float32)
    assert I.cast(f, "u8").tolist() == [255, 0, 0, 255, 0, 255]
    assert I.cast(f, "i32").tolist() == [300, -5, 0, 2**31 - 1, -(2**31), 2**31 - 1]
    assert I.cast(f, "u32").tolist() == [300, 0, 0, 2**32 - 1, 0, 2**32 - 1]
    assert I.cast(np.array([300, -1], np.int32), "u8").tolist() == [44, 255]
    assert I.cast(np.array([-1], np.int32), "u32").tolist() == [2**32 - 1]
    assert I.cast(np.array([np.nan, 0.0], np.float32), "bool").tolist() == [True, False]


def test_sum_order_is_the_documented_one():
    r = np.random.default_rng(5)
    x = (r.standard_normal(20_001) * 10.0 ** r.integers(-8, 8, 20_001)).astype(np.float32)
    chunks = []
    for start in range(0, x.size, I.SUM_CHUNK):
        lanes = [0.0] * 32
        chunk = x[start:start + I.SUM_CHUNK]
        for b in range(0, chunk.size, 512):
            partial = [np.float32(0.0)] * 32  # f32 within a block of 512
            for j, v in enumerate(chunk[b:b + 512]):
                partial[j % 32] = np.float32(partial[j % 32] + v)
            lanes = [t + float(p) for t, p in zip(lanes, partial, strict=True)]
        while len(lanes) > 1:  # adjacent pairs, level by level
            lanes = [lanes[k] + lanes[k + 1] for k in range(0, len(lanes), 2)]
        chunks.append(lanes[0])
    total = 0.0
    for c in chunks:
        total += c
    assert I.reduce("sum", x, "f32").tobytes() == np.float32(total).tobytes()


def test_sum_is_accurate_on_a_large_mixed_sign_tensor():
    """16-term f32 partials in f64 lanes: off by 2e-10 of the magnitudes here, where a
    sequential f32 sum is off by 2e-8 of them."""
    r = np.random.default_rng(6)
    x = (r.standard_normal(1_000_003) * r.exponential(1.0, 1_000_003)).astype(np.float32)
    exact = math.fsum(float(v) for v in x)
    got = float(I.reduce("sum", x, "f32"))
    assert abs(got - exact) <= 1e-9 * float(np.abs(x, dtype=np.float64).sum())


def test_max_min_ignore_nan_and_canonicalise_zero():
    x = np.array([np.nan, -0.0, -3.0], np.float32)
    assert float(I.reduce("max", x, "f32")) == 0.0
    assert not np.signbit(I.reduce("max", x, "f32"))
    assert float(I.reduce("min", x, "f32")) == -3.0
    assert float(I.reduce("max", np.array([], np.float32), "f32")) == -math.inf
    assert np.isnan(I.reduce("max", np.array([np.nan], np.float32), "f32"))


def _py_mix(x):
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = x * 0x85EBCA6B & 0xFFFFFFFF
    x ^= x >> 13
    x = x * 0xC2B2AE35 & 0xFFFFFFFF
    return x ^ (x >> 16)


def _py_hash(seed, step, stream, i):
    m = 0xFFFFFFFF
    k0 = _py_mix(seed * 0x9E3779B9 + 0x7F4A7C15)
    k1 = _py_mix(k0 ^ ((step * 0x85EBCA77 + 0x165667B1) & m))
    key = _py_mix(k1 ^ ((stream * 0xC2B2AE3D + 0x27D4EB2F) & m))
    return _py_mix((i & m) * 0x9E3779B9 + (i >> 32) * 0x85EBCA77 + key)


@pytest.mark.parametrize("seed,step,stream", [(0, 0, 0), (7, 3, 65536), (2**32 - 1, 9, 1)])
def test_rng_matches_an_independent_implementation(seed, step, stream):
    idx = np.array([0, 1, 2, 1000, 2**31 + 5, 2**33 + 7], dtype=np.uint64)
    key = rng.stream_key(seed, step, stream)
    want = [_py_hash(seed, step, stream, int(i)) for i in idx]
    assert rng.hash_index(key, idx).tolist() == want
    u = rng.uniform(key, idx)
    assert u.tolist() == [np.float32((h >> 8) * 2.0**-24) for h in want]
    assert rng.randint(key, idx, np.uint32(10)).tolist() == [(h * 10) >> 32 for h in want]


def test_rng_is_roughly_uniform():
    u = rng.uniform(rng.stream_key(1, 2, 3), np.arange(200_000, dtype=np.uint64))
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    chi2 = ((counts - 10_000) ** 2 / 10_000).sum()
    assert chi2 < 60  # 19 degrees of freedom; p < 1e-5 beyond this


def test_exponent_and_pow2_are_exact():
    x = np.array([1.0, 1.5, 0.75, 3e-38, 1e-45, 0.0, -8.0, np.inf], np.float32)
    assert I.elementwise("exponent", [x], "f32").tolist() == [0, 0, -1, -125, -127, -127, 3,
                                                              128]
    assert I.elementwise("mantissa", [x], "f32").tolist() == [0, 2**22, 2**22,
                                                              0x2355E6, 1, 0, 0, 0]
    e = np.array([-127, -126, 0, 5, 127, 128], np.int32)
    got = I.elementwise("pow2", [e], "i32")
    assert got.tolist() == [0.0, 2.0**-126, 1.0, 32.0, 2.0**127, math.inf]


def _run(encode_body, n=8, x=None):
    """Run an encode body that returns concat(<f32 array>) and give that array back (read
    from the payload's section: a NaN input flags the payload, which decodes to NaN)."""
    src = (
        "encode(g: f32[]) -> bytes:\n" + encode_body +
        "decode(p: bytes, n: u32) -> f32[n]:\n    let v: f32[] = extract(p)\n"
        "    return scatter(iota(size(v)), v, n)\n"
    )
    prog = load_source(src, "t.cll")
    data = I.encode(prog, np.arange(n, dtype=np.float32) if x is None else x)
    _, (section,), _ = payload.parse(prog, data, n)
    return np.frombuffer(section.tobytes(), "<f4").astype(np.float32)


def test_topk_breaks_ties_by_lower_index_and_keeps_index_order():
    x = np.array([1, -3, 3, 2, -3, 0, 3, 1], np.float32)
    body = ("    let idx, v = topk(g, 3, key=abs, index=true)\n"
            "    return concat(scatter(idx, map(iota(size(idx)), i -> f32(i) + 1.0), size(g)))\n")
    # |x| = 3 at indices 1, 2, 4, 6: the three lowest indices win, in index order.
    assert _run(body, x=x).tolist() == [0, 1, 2, 0, 3, 0, 0, 0]


def test_sort_descending_is_stable_with_nan_last():
    x = np.array([2, np.nan, 5, 2, -1, 5, 0, 1], np.float32)
    body = "    return concat(sort(g, descending=true))\n"
    got = _run(body, x=x)
    assert got[:-1].tolist() == [5, 5, 2, 2, 1, 0, -1] and np.isnan(got[-1])
    body = "    let i, v = sort(g, index=true)\n    return concat(map(i, f32))\n"
    assert _run(body, x=x).tolist() == [4, 6, 7, 0, 3, 2, 5, 1]


def test_integer_promotion_follows_c():
    body = ("    let a = u32(3) - 4\n"            # u32 wraps
            "    let b = i32(3) - u32(4)\n"       # i32 op u32 is u32
            "    let c = u8(200) + u8(100)\n"     # u8 promotes to i32
            "    let d = -7 / 2\n"                 # literals: truncation
            "    let e = 1 << 33\n"               # shift count masked to 5 bits
            "    return concat(map(iota(5), i -> if i == 0 then f32(a) else if i == 1 "
            "then f32(b) else if i == 2 then f32(c) else if i == 3 then f32(d) else f32(e)))\n")
    want = [2.0**32 - 1, 2.0**32 - 1, 300, -3, 2]
    assert _run(body, n=5).tolist() == [float(np.float32(w)) for w in want]


def test_same_seed_and_step_give_identical_bytes():
    import hipress

    x = np.random.default_rng(0).standard_normal(4097).astype(np.float32)
    a = hipress.codec("terngrad", seed=3)
    b = hipress.codec("terngrad", seed=3)
    pa, pb = a.encode(x), b.encode(x)
    assert pa.tobytes() == pb.tobytes()
    assert a.encode(x).tobytes() != pa.tobytes()  # the step advanced
    assert a.encode(x, step=0).tobytes() == pa.tobytes()
    assert hipress.codec("terngrad", seed=4).encode(x).tobytes() != pa.tobytes()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=300))
def test_every_algorithm_survives_nan_inf_and_denormals(values):
    import hipress

    x = np.array(values, dtype=np.float32)
    finite = bool(np.isfinite(x).all())
    for name in hipress.algorithms():
        c = hipress.codec(name)
        y = c.decode(c.encode(x), x.size)
        assert y.shape == x.shape
        if not finite:  # the payload carries the flag: NaN everywhere, whatever the codec
            assert np.isnan(y).all(), name
        elif name == "fp16":
            with np.errstate(over="ignore"):
                want = x.astype(np.float16).astype(np.float32)
            np.testing.assert_array_equal(y, want)


def test_sort_ascending_keeps_negative_infinity_first():
    x = np.array([1, -np.inf, np.nan, 0, np.inf, -1, 2, 3], np.float32)
    got = _run("    return concat(sort(g))\n", x=x)
    assert got[:-1].tolist() == [-np.inf, -1, 0, 1, 2, 3, np.inf] and np.isnan(got[-1])


def test_reductions_return_the_canonical_nan():
    for op in ("sum", "max", "min"):
        x = np.array([np.nan, np.nan], np.float32) if op != "sum" else \
            np.array([1.0, np.uint32(0xFFC00001).view(np.float32)], np.float32)
        assert I.reduce(op, x, "f32").view(np.uint32) == 0x7FC00000
