"""Generated C++ kernels: bit-for-bit equal to the reference interpreter."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ALGORITHMS, SIZES, gradient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hipress
from compll import load, load_source
from compll.build import build
from compll.diagnostics import BuildError
from hipress import PayloadError

pytestmark = pytest.mark.cpu

VARIANTS = [(name, {}) for name in ALGORITHMS] + [
    ("minmax8", {"bits": 4}), ("qsgd", {"bits": 2}), ("qsgd", {"bits": 4}),
    ("topk", {"ratio": 0.05}), ("dgc", {"ratio": 0.01}), ("randomk", {"ratio": 0.1}),
    ("threshold", {"tau": 0.5}), ("tbq", {"tau": 0.3}),
    ("qsgd", {"bucket": 0}), ("qsgd", {"bits": 4, "bucket": 100}),
    ("cgx", {"bits": 3, "bucket": 8193}), ("cgx", {"bits": 8, "bucket": 0}), ("cgx", {"bits": 1}),
    ("zeropp", {"bits": 8, "bucket": 1}),
]


def adversarial(kind: str, n: int) -> np.ndarray:
    r = np.random.default_rng(n)
    if kind == "zeros":
        return np.zeros(n, np.float32)
    if kind == "equal":
        return np.full(n, -0.375, np.float32)
    if kind == "special":
        x = gradient(n, seed=5)
        picks = r.integers(0, max(n, 1), size=max(n // 7, 1)) if n else []
        for j, i in enumerate(picks):
            x[i] = [np.nan, np.inf, -np.inf, -0.0, 1e-42, -3e-39, 65519.0, 7e4][j % 8]
        return x
    return gradient(n, seed=n)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal, except that a NaN's sign and payload may differ (see docs)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = np.isnan(a)
    return bool((nan == np.isnan(b)).all()) and a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("kind", ["random", "zeros", "equal", "special"])
@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_cpu_matches_reference_bit_for_bit(name, params, kind):
    cpu = hipress.codec(name, target="cpu", seed=9, **params)
    ref = hipress.codec(name, target="ref", seed=9, **params)
    for n in SIZES if kind == "random" else [0, 1, 9, 1000, 70_001]:
        x = adversarial(kind, n)
        for step in (0, 5):
            pc, pr = cpu.encode(x, step=step), ref.encode(x, step=step)
            assert same_bits(pc, pr), (n, step)
            acc = gradient(n, seed=1)
            assert same_values(cpu.decode(pr, n), ref.decode(pr, n))
            assert same_values(cpu.decode(pr, n, out=acc.copy(), accumulate=True),
                               ref.decode(pr, n, out=acc.copy(), accumulate=True))
            # Scaled in the same pass: the average of a sum, and error feedback's subtract.
            assert same_values(cpu.decode(pr, n, scale=0.25), ref.decode(pr, n, scale=0.25))
            assert same_values(cpu.decode(pr, n, out=acc.copy(), accumulate=True, scale=-1),
                               ref.decode(pr, n, out=acc.copy(), accumulate=True, scale=-1))


def test_encode_reuses_a_callers_buffer():
    c = hipress.codec("onebit", target="cpu")
    x = gradient(10_000)
    buf = np.zeros(4096, np.uint8)
    p = c.encode(x, step=0, out=buf)
    assert p.base is buf or np.shares_memory(p, buf)
    small = np.zeros(8, np.uint8)
    q = c.encode(x, step=0, out=small)  # too small: a new buffer, same bytes
    assert not np.shares_memory(q, small) and same_bits(p, q)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ALGORITHMS), st.binary(max_size=300), st.booleans())
def test_fuzzed_payloads_raise_payload_error_and_leave_out_untouched(name, blob, from_good):
    c = hipress.codec(name, target="cpu")
    n = 257
    if from_good:  # a real header with a corrupted body or length
        good = c.encode(gradient(n))
        data = np.frombuffer(bytes(good[:24]) + blob, np.uint8)
    else:
        data = np.frombuffer(blob, np.uint8)
    out = gradient(n, seed=2)
    before = out.copy()
    try:
        c.decode(data, n, out=out, accumulate=True)
    except PayloadError:
        assert same_bits(out, before)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(ALGORITHMS), st.data())
def test_truncated_and_bit_flipped_payloads(name, data):
    c = hipress.codec(name, target="cpu")
    good = c.encode(gradient(1000))
    cut = data.draw(st.integers(0, good.size - 1))
    with pytest.raises(PayloadError):
        c.decode(good[:cut].copy(), 1000)
    bad = good.copy()
    pos = data.draw(st.integers(0, good.size - 1))
    bad[pos] ^= np.uint8(1 << data.draw(st.integers(0, 7)))
    ref = hipress.codec(name, target="ref")
    try:
        want = ref.decode(bad, 1000)
    except PayloadError:
        with pytest.raises(PayloadError):
            c.decode(bad, 1000)
    else:
        assert same_values(c.decode(bad, 1000), want)


def test_second_codec_reuses_the_cache_and_a_changed_file_rebuilds(tmp_path):
    src = tmp_path / "scale.cll"
    body = ("encode(g: f32[]) -> bytes:\n    return concat(map(g, x -> x * {k}))\n"
            "decode(p: bytes, n: u32) -> f32[n]:\n    let v: f32[n] = extract(p)\n"
            "    return map(v, x -> x / {k})\n")
    src.write_text(body.format(k="2.0"))
    first = build(load(str(src)), "cpu")
    again = build(load(str(src)), "cpu")
    assert again.cached and again.library == first.library
    src.write_text(body.format(k="4.0"))
    changed = build(load(str(src)), "cpu")
    assert not changed.cached and changed.key != first.key
    c = hipress.codec(str(src), target="cpu")
    x = gradient(100)
    np.testing.assert_array_equal(c.decode(c.encode(x), 100), x)


def test_concurrent_builds_of_one_key_agree(tmp_path):
    env = dict(os.environ, HIPRESS_CACHE_DIR=str(tmp_path / "cache"))
    code = textwrap.dedent("""
        import sys, numpy as np, hipress
        c = hipress.codec("terngrad", target="cpu", seed=1)
        x = np.linspace(-1, 1, 1001, dtype=np.float32)
        sys.stdout.write(c.encode(x, step=0).tobytes().hex())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert len({o[0] for o in outs}) == 1
    libraries = list((tmp_path / "cache").rglob("*.so"))
    assert len(libraries) == 1


def test_missing_compiler_names_the_variable(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("HIPRESS_NO_CACHE", "1")
    with pytest.raises(BuildError, match="set CXX"):
        build(load("onebit"), "cpu")


def test_compiler_failure_is_a_compile_error_with_its_message(monkeypatch, tmp_path):
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx: internal error 42' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("HIPRESS_NO_CACHE", "1")
    with pytest.raises(hipress.CompileError, match="internal error 42"):
        build(load("onebit"), "cpu")


def test_dsl_names_cannot_inject_code():
    """Names that are C++ keywords or runtime symbols are prefixed, never spliced raw."""
    src = textwrap.dedent("""
        param int: f32 = 2.0
        encode(g: f32[]) -> bytes:
            let main = reduce(g, max, key=abs)
            let hp = map(g, std -> std * int)
            let for, return_ = topk(hp, 3, index=true)
            return concat(main, for, return_)
        decode(p: bytes, n: u32) -> f32[n]:
            let exit, i, v = extract(p)
            return scatter(i, map(v, delete -> delete / 2.0 + exit * 0.0), n)
    """)
    prog = load_source(src, "evil.cll")
    cpu = hipress.Codec(prog, "cpu", 0)
    ref = hipress.Codec(prog, "ref", 0)
    x = gradient(500)
    assert same_bits(cpu.encode(x), ref.encode(x))
    assert same_values(cpu.decode(ref.encode(x), 500), ref.decode(ref.encode(x), 500))


def test_randint_draws_equal_the_reference_for_every_kind_of_bound():
    """Powers of two render as a shift of the hash (1 as zero); other bounds as a 64-bit
    product; parameters at run time. All must draw the reference's numbers."""
    src = textwrap.dedent("""
        param hi: u32 = 1000
        encode(g: f32[]) -> bytes:
            let a = map(g, x -> randint(1))
            let b = map(g, x -> randint(2))
            let c = map(g, x -> randint(2147483648))
            let d = map(g, x -> randint(1000))
            let e = map(g, x -> randint(hi))
            return concat(a, b, c, d, e)
        decode(p: bytes, n: u32) -> f32[n]:
            let a: u32[n], b: u32[n], c: u32[n], d: u32[n], e: u32[n] = extract(p)
            return map(a, b, c, d, e, (u, v, w, y, z) -> f32(u + v + w % 7 + y + z))
    """)
    prog = load_source(src, "draws.cll")
    x = gradient(20_000)
    for step in (0, 3):
        assert same_bits(hipress.Codec(prog, "cpu", 5).encode(x, step=step),
                         hipress.Codec(prog, "ref", 5).encode(x, step=step))


def test_a_parameterised_build_is_cached():
    """A second build of one parameter set is a cache hit (build times: bench/kernels.py)."""
    art = build(load("qsgd", bits=4), "cpu", use_cache=True)
    again = build(load("qsgd", bits=4), "cpu", use_cache=True)
    assert again.cached and art.library.exists()


def test_cheap_reductions_skip_the_staging_buffer_and_still_match_the_reference():
    """Float reductions of loads, +, -, *, comparisons, abs and selects evaluate straight
    into vector registers (``DIRECT``); draws, divisions and casts are staged; a min and
    a max of the same elements in one pass share one op. Every way, the sums keep the
    defined order and max/min skip NaN, bit for bit."""
    from compll import schedule as sch
    from compll.lower import lower
    from compll.render import CpuRenderer, CudaRenderer
    from compll.scheduling import schedule

    src = textwrap.dedent("""
        param w: f32 = 0.5
        encode(g: f32[]) -> bytes:
            let pos = map(g, x -> if x >= 0.0 then x else 0.0)
            let a = reduce(g, min)
            let b = reduce(g, max, key=x -> abs(x) * w)
            let c = reduce(pos, sum)
            let d = reduce(g, sum, key=x -> x * x - 0.5 * x)
            let e = reduce(map(g, x -> x * random()), sum)
            let f = reduce(g, max, key=x -> x / 3.0)
            let h = reduce(map(g, x -> f32(i32(x * 1000.0))), min)
            let m = reduce(g, max)
            let o = reduce(g, min, key=x -> x / 3.0)
            return concat(a, b, c, d, e, f, h, m, o)
        decode(p: bytes, n: u32) -> f32[n]:
            let a: f32, b: f32, c: f32, d: f32, e: f32, f: f32, h: f32, m: f32, o: f32 = extract(p)
            return map(iota(n), i -> a + b + c + d + e + f + h + m + o)
    """)
    prog = load_source(src, "reductions.cll")
    encode, _ = schedule(lower(prog), CpuRenderer.options)
    passes = [item for item in encode.items if isinstance(item, sch.Pass)]
    assert len(passes) == 1 and passes[0].extent == sch.N  # all ten in one pass over g
    def what(op):
        outs = (op.lo, op.hi) if isinstance(op, sch.MinMax) else getattr(op, "out", None)
        return type(op).__name__, outs, getattr(op, "direct", None)

    ops = {what(op) for op in passes[0].ops}
    assert ops == {
        ("TakeInputOp", None, None),       # r += g, fused into the first pass
        ("MinMax", ("a", "m"), True),        # a min and a max of g: one op, direct
        ("Extreme", "b", True),              # abs and *: direct
        ("Sum", "c", True), ("Sum", "d", True),
        ("Sum", "e", False),                 # the RNG: staged
        ("MinMax", ("o", "f"), False),       # a division: staged, still merged
        ("Extreme", "h", False),             # casts: staged
    }
    assert isinstance(passes[0].ops[0], sch.TakeInputOp)
    cuda, _ = schedule(lower(prog), CudaRenderer.options)
    cuda_ops = [op for item in cuda.items if isinstance(item, sch.Pass) for op in item.ops]
    assert not any(isinstance(op, sch.MinMax) or getattr(op, "direct", False)
                   for op in cuda_ops)  # the CUDA runtime has neither
    cpu, ref = hipress.Codec(prog, "cpu", 3), hipress.Codec(prog, "ref", 3)
    for kind in ("random", "zeros", "equal", "special"):
        for n in (0, 1, 31, 33, 8191, 8193, 70_001):
            x = adversarial(kind, n)
            assert same_bits(cpu.encode(x, step=1), ref.encode(x, step=1)), (kind, n)
    x = np.full(20_000, np.nan, np.float32)  # all-NaN chunks, then a finite tail
    x[-5:] = [1.0, -2.0, np.inf, 0.0, -0.0]
    assert same_bits(cpu.encode(x, step=1), ref.encode(x, step=1))
    x[-5:] = [np.inf, np.inf, np.nan, -np.inf, -0.0]
    assert same_bits(cpu.encode(x, step=1), ref.encode(x, step=1))


def test_sampled_topk_matches_the_reference_for_float_and_integer_keys():
    """Large tensors take top-k's sampled-threshold path, whose candidate pass compares
    float keys as floats and other keys as doubles; both select what the reference does
    (ties by lower index, NaN last)."""
    src = textwrap.dedent("""
        encode(g: f32[]) -> bytes:
            let fi, fv = topk(g, 150, key=abs, index=true)
            let q = map(g, x -> i32(x * 1000.0))
            let ii, iv = topk(q, 150, key=abs, index=true)
            return concat(fi, fv, ii, iv)
        decode(p: bytes, n: u32) -> f32[n]:
            let fi: u32[], fv: f32[], ii: u32[], iv: i32[] = extract(p)
            return scatter(fi, fv, n)
    """)
    prog = load_source(src, "topks.cll")
    cpu, ref = hipress.Codec(prog, "cpu", 0), hipress.Codec(prog, "ref", 0)
    for kind in ("random", "equal", "special"):
        x = adversarial(kind, 300_001)
        assert same_bits(cpu.encode(x), ref.encode(x)), kind
