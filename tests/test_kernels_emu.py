"""The CUDA target's kernels executed on the CPU (target ``cuda-emu``): the generated CUDA
source and runtime headers, compiled as host C++ against ``compll/templates/emu``, must
give the reference's bits in both schedule orders, and the emulator's checks must catch
the faults they are for (hand-written kernels in ``tests/emu/faults.cu``)."""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import ranks
from conftest import ALGORITHMS, ROOT, SIZES, gradient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batched import SEGMENTS
from test_kernels_cpu import VARIANTS, adversarial, same_bits, same_values
from test_kernels_cuda import EVERY_OPERATOR

import hipress
from compll import load, load_source
from compll.build import EMU_FLAGS, build
from hipress import PayloadError

pytestmark = pytest.mark.cpu

EMU = ROOT / "compll" / "templates" / "emu"
#: the forward order at every size; the reverse order (threads between barriers, and
#: blocks, last first) at sizes up to a few chunks, which is where races would show
SMALL = [0, 1, 9, 1000, 70_001]


def _affordable(params: dict, sizes: list[int]) -> list[int]:
    """A block of one element is a thread block per element: 256 emulated threads through
    nine barriers each, 0.1 ms an element, so such variants stop at 10,000 elements (the
    emulator's grid cap still makes their loops stride)."""
    if params.get("bucket") != 1:
        return sizes
    return sorted({min(n, 10_000) for n in sizes})


@pytest.fixture(params=["forward", "reverse"])
def order(request, monkeypatch):
    """The emulator's schedule order (read at every launch)."""
    if request.param == "reverse":
        monkeypatch.setenv("HIPRESS_EMU_ORDER", "reverse")
    else:
        monkeypatch.delenv("HIPRESS_EMU_ORDER", raising=False)
    return request.param


def _decodes_match(emu, ref, p, n):
    acc = gradient(n, seed=1)
    assert same_values(emu.decode(p, n), ref.decode(p, n))
    for kwargs in ({"accumulate": True}, {"scale": 0.25},
                   {"accumulate": True, "scale": -1.0},
                   {"scale": -1.0, "feedback": True}):  # error feedback's residual update
        out = acc.copy() if kwargs.get("accumulate") or kwargs.get("feedback") else None
        want = ref.decode(p, n, out=None if out is None else out.copy(), **kwargs)
        got = emu.decode(p, n, out=out, **kwargs)
        assert same_values(got, want), (n, kwargs)


@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_emulated_cuda_matches_the_reference_bit_for_bit(name, params, order):
    emu = hipress.codec(name, target="cuda-emu", seed=9, **params)
    ref = hipress.codec(name, target="ref", seed=9, **params)
    for kind in ("random", "zeros", "equal", "special"):
        sizes = _affordable(params, SIZES if kind == "random" and order == "forward"
                            else SMALL)
        for n in sizes:
            x = adversarial(kind, n)
            for step in (0, 5):
                pe, pr = emu.encode(x, step=step), ref.encode(x, step=step)
                assert same_bits(pe, pr), (kind, n, step)
                _decodes_match(emu, ref, pr, n)


def test_every_operator_runs_emulated(order):
    """Every runtime template instantiated and run: sort, filter, top-k (both paths),
    gather, scatter, f16, packs, and blockwise sums and extremes."""
    prog = load_source(EVERY_OPERATOR, "every.cll")
    emu, ref = hipress.Codec(prog, "cuda-emu", 3), hipress.Codec(prog, "ref", 3)
    for kind in ("random", "special"):
        for n in (0, 1, 257, 20_000, 70_001):
            x = adversarial(kind, n)
            p = ref.encode(x, step=1)
            assert same_bits(emu.encode(x, step=1), p), (kind, n)
            assert same_values(emu.decode(p, n), ref.decode(p, n)), (kind, n)


def test_a_users_file_runs_emulated_unchanged(tmp_path):
    src = tmp_path / "clip.cll"
    src.write_text(textwrap.dedent("""
        param c: f32 = 0.5
        encode(g: f32[]) -> bytes:
            let s = reduce(map(g, abs), max)
            return concat(s, pack(map(g, x -> u8(x > c * s)), bits=1))
        decode(p: bytes, n: u32) -> f32[n]:
            let s: f32, b: u1[n] = extract(p)
            return map(unpack(b), x -> f32(x) * s)
    """))
    emu, ref = hipress.codec(str(src), target="cuda-emu"), hipress.codec(str(src), target="ref")
    x = gradient(100_003)
    assert same_bits(emu.encode(x), ref.encode(x))
    assert same_values(emu.decode(ref.encode(x), x.size), ref.decode(ref.encode(x), x.size))
    assert build(load(str(src)), "cuda-emu").key != build(load(str(src)), "cpu").key


@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_emulated_batched_entry_points_match(name, params):
    """The CUDA batched ABI: encodes with residuals and error feedback, decodes (overwrite,
    accumulate, scale) and an aggregator's merge and re-encode, against the reference and
    the CPU target."""
    emu = hipress.codec(name, target="cuda-emu", seed=4, **params)
    ref = hipress.codec(name, target="ref", seed=4, **params)
    cpu = hipress.codec(name, target="cpu", seed=4, **params)
    segments = _affordable(params, SEGMENTS) if params.get("bucket") == 1 else SEGMENTS
    steps = [11 + 3 * i for i in range(len(segments))]

    def inputs(kind):
        return [adversarial(kind, n) if n else np.zeros(0, np.float32) for n in segments]

    for kind in ("random", "special"):
        xs = inputs(kind)
        start = [gradient(n, seed=i + 20) * 0.1 for i, n in enumerate(segments)]
        res_emu, res_ref = ([r.copy() for r in start] for _ in range(2))
        payload, sizes = emu.encode_batch(xs, steps=steps, residuals=res_emu, feedback=True)
        want, want_sizes = ref.encode_batch(xs, steps=steps, residuals=res_ref, feedback=True)
        assert payload.tobytes() == want.tobytes() and sizes == want_sizes, kind
        for a, b in zip(res_emu, res_ref, strict=True):
            assert same_values(a, b), kind
        acc = [gradient(n, seed=i + 40) for i, n in enumerate(segments)]
        for kwargs in ({}, {"accumulate": True}, {"scale": 0.25}):
            outs = emu.decode_batch(payload, segments, [a.copy() for a in acc], **kwargs)
            wants = ref.decode_batch(payload, segments, [a.copy() for a in acc], **kwargs)
            for o, w in zip(outs, wants, strict=True):
                assert same_values(o, w), (kind, kwargs)
        merged = []
        for codec in (emu, cpu):
            mine = inputs(kind)
            res = [r.copy() for r in start]
            p, _ = codec.encode_batch(mine, steps=steps, residuals=res, feedback=True,
                                      merge=payload)
            merged.append((p.tobytes(), mine, res))
        (p_emu, x_emu, r_emu), (p_cpu, x_cpu, r_cpu) = merged
        assert p_emu == p_cpu, kind
        for a, b in zip(x_emu + r_emu, x_cpu + r_cpu, strict=True):
            assert same_values(a, b), kind


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ALGORITHMS), st.data())
def test_emulated_decoders_refuse_truncated_and_flipped_payloads(name, data):
    """The CUDA decoders' own payload checks (run here for the first time): a clear
    PayloadError and an untouched output, or the reference's values."""
    emu = hipress.codec(name, target="cuda-emu")
    good = emu.encode(gradient(1000))
    cut = data.draw(st.integers(0, good.size - 1))
    out = gradient(1000, seed=2)
    with pytest.raises(PayloadError):
        emu.decode(good[:cut].copy(), 1000, out=out, accumulate=True)
    assert same_bits(out, gradient(1000, seed=2))
    bad = good.copy()
    bad[data.draw(st.integers(0, good.size - 1))] ^= np.uint8(1 << data.draw(st.integers(0, 7)))
    try:
        want = hipress.codec(name, target="ref").decode(bad, 1000)
    except PayloadError:
        with pytest.raises(PayloadError):
            emu.decode(bad, 1000, out=out)
        assert same_bits(out, gradient(1000, seed=2))
    else:
        assert same_values(emu.decode(bad, 1000), want)


@pytest.mark.parallel
def test_the_engine_on_emulated_kernels_gives_the_cpu_kernels_bits(tmp_path):
    """CaSync's device path (CPU tensors standing in for CUDA ones, staged and nccl
    links) calling the CUDA batched kernels: every topology, fp16/bf16 tensors."""
    args = {"algos": ["onebit", "dgc", "cgx"]}
    host = ranks.arrays_of("strategies", tmp_path / "host", args)
    for link in ("staged", "nccl"):
        emu = ranks.arrays_of("strategies", tmp_path / link,
                              {**args, "device": link, "target": "cuda-emu"})
        for h, e in zip(host, emu, strict=True):
            assert h.keys() == e.keys()
            for key in h:
                assert h[key].tobytes() == e[key].tobytes(), (link, key)


@pytest.mark.parallel
@pytest.mark.parametrize("device", [None, "staged"])
def test_error_feedback_through_emulated_kernels_gives_the_cpu_kernels_bits(tmp_path,
                                                                            device):
    """Residuals updated by the CUDA kernels' eager update (the CPU's is deferred), on
    the host path and the device path, over ring hops and aggregators."""
    args = {"algo": "onebit", "topology": "ring", "steps": 12}
    host = ranks.arrays_of("feedback", tmp_path / "host", args)
    emu = ranks.arrays_of("feedback", tmp_path / "emu", {**args, "device": device,
                                                          "target": "cuda-emu"})
    for h, e in zip(host, emu, strict=True):
        assert sorted(h) == sorted(e) and len(h) > 1
        for key in h:
            assert h[key].tobytes() == e[key].tobytes(), key


# ---- the emulator's checks -------------------------------------------------------------


def _compile(tmp_path, name, *flags):
    exe = tmp_path / name
    cmd = [os.environ.get("CXX", "g++"), *[f for f in EMU_FLAGS if f not in ("-shared",)],
           *flags, f"-I{EMU}", str(ROOT / "tests" / "emu" / "faults.cu"), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return exe


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The fault programs: checked (both fiber switches) and with the checks compiled out."""
    tmp = tmp_path_factory.mktemp("faults")
    return {"checked": _compile(tmp, "checked"),
            "ucontext": _compile(tmp, "ucontext", "-DHP_EMU_UCONTEXT"),
            "unchecked": _compile(tmp, "unchecked", "-DHP_EMU_UNCHECKED")}


def _run(exe, case, order="forward", env=None):
    env = {**os.environ, **(env or {}), "HIPRESS_EMU_ORDER": order}
    done = subprocess.run([str(exe), case], capture_output=True, text=True, timeout=120,
                          env=env)
    return done.returncode, done.stdout.strip(), done.stderr


@pytest.mark.parametrize("build_", ["checked", "ucontext"])
def test_correct_kernels_pass_in_both_orders(faults, build_):
    for order in ("forward", "reverse"):
        assert _run(faults[build_], "race-synced", order)[:2] == (0, "wrong 0")
        assert _run(faults[build_], "vote", order)[:2] == (0, "wrong 0\nlaunch: ok")


def test_a_missing_barrier_is_caught_by_the_reverse_order(faults):
    """A thread reads its neighbour's shared value without a barrier between: run in
    order the race is invisible; reversed, every block's reads come before the writes."""
    assert _run(faults["checked"], "race-missing", "forward")[1] == "wrong 0"
    assert _run(faults["checked"], "race-missing", "reverse")[1] == "wrong 1020"
    assert _run(faults["unchecked"], "race-missing", "reverse")[1] == "wrong 0"


@pytest.mark.parametrize("case,message", [
    ("exit-before-barrier", "128 threads of a block wait at __syncthreads while 128 have "
                            "exited: divergent barrier"),
    ("two-barriers", "threads of one block wait at two different barriers"),
    ("vote-exited", "__ballot_sync names lane 5 of warp 0, which has exited"),
    ("deadlock", "nothing can release them: deadlock"),
    ("empty-grid", "launched with a grid of 0 blocks"),
])
def test_faults_a_gpu_would_hide_or_hang_on_are_launch_errors(faults, case, message):
    for build_ in ("checked", "ucontext"):
        rc, out, _ = _run(faults[build_], case)
        assert rc == 0 and out.startswith("launch: cuda-emu: ") and message in out, out
    assert _run(faults["unchecked"], case)[1] == "launch: ok"


def test_reads_of_memory_nothing_wrote_show_as_nan(faults):
    assert _run(faults["checked"], "unwritten")[1] == "nan 500"
    assert _run(faults["unchecked"], "unwritten")[1] == "nan 0"


def _asan_runtime() -> str | None:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None
    found = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True,
                           text=True, check=False).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


needs_asan = pytest.mark.skipif(_asan_runtime() is None, reason="no AddressSanitizer runtime")


@needs_asan
def test_an_out_of_bounds_read_is_caught_under_address_sanitizer(tmp_path, faults):
    asan = _compile(tmp_path, "asan", "-fsanitize=address", "-fno-omit-frame-pointer")
    env = {"ASAN_OPTIONS": "detect_leaks=0"}
    rc, _, err = _run(asan, "out-of-bounds", env=env)
    assert rc != 0 and "heap-buffer-overflow" in err and "read_past_end" in err
    assert _run(faults["checked"], "out-of-bounds")[:2] == (0, "launch: ok")  # unseen
    # the fibers' stacks are known to the sanitizer: kernels with barriers run clean
    for case in ("race-synced", "vote"):
        rc, out, err = _run(asan, case, "reverse", env)
        assert rc == 0 and out.startswith("wrong 0") and "ERROR" not in err, err


@needs_asan
@pytest.mark.slow
def test_codecs_built_with_address_sanitizer_run_clean(tmp_path):
    """HIPRESS_EMU_ASAN=1 builds the kernels instrumented; loaded into a process that
    preloads the runtime, every kernel of two algorithms runs without a report."""
    code = textwrap.dedent("""
        import numpy as np, hipress
        x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
        for name in ("dgc", "cgx"):
            emu = hipress.codec(name, target="cuda-emu")
            ref = hipress.codec(name, target="ref")
            p = emu.encode(x, step=1)
            assert p.tobytes() == ref.encode(x, step=1).tobytes(), name
            assert emu.decode(p, x.size).tobytes() == ref.decode(p, x.size).tobytes(), name
        print("clean")
    """)
    env = {**os.environ, "HIPRESS_EMU_ASAN": "1", "LD_PRELOAD": _asan_runtime(),
           "ASAN_OPTIONS": "detect_leaks=0", "HIPRESS_CACHE_DIR": str(tmp_path)}
    env.pop("HIPRESS_EMU_ORDER", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-3000:]
    libraries = list(tmp_path.rglob("*.so"))
    assert len(libraries) == 2
    assert all(b"__asan_report_load" in lib.read_bytes() for lib in libraries)
