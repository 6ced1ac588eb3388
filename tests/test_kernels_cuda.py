"""Generated CUDA kernels: compile for sm_80 and sm_90 here; run where a GPU exists.

Where NVIDIA's pip nvcc is installed (``hipress[cuda]``, as ``make test`` does), every
build here runs with no nvcc on the PATH, so the pip-only route is what compiles them."""

import os
import shutil
import textwrap

import numpy as np
import pytest
from conftest import ALGORITHMS, gradient

import hipress
from compll import load, load_source
from compll.build import build, compiler_for, cuda_archs, pip_nvcc
from compll.diagnostics import BuildError

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and pip_nvcc() is None,
                                reason="no nvcc: pip install 'hipress[cuda]'")


def _without_nvcc_on_path() -> str:
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "nvcc")))


@pytest.fixture(autouse=True)
def pip_route_only(monkeypatch):
    """With a pip nvcc, hide any system one: the builds below must not need it."""
    if pip_nvcc() is not None:
        monkeypatch.setenv("PATH", _without_nvcc_on_path())
        monkeypatch.delenv("NVCC", raising=False)
        monkeypatch.delenv("HIPRESS_CUDA_ARCHS", raising=False)


@pytest.mark.skipif(pip_nvcc() is None, reason="NVIDIA's pip nvcc is not installed")
def test_the_pip_nvcc_is_used_without_a_system_toolkit():
    assert shutil.which("nvcc") is None  # the fixture hid the system one
    assert compiler_for("cuda") == pip_nvcc()
    assert "site-packages" in pip_nvcc() and pip_nvcc().endswith("/bin/nvcc")


@needs_nvcc
def test_cache_keys_differ_by_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv("HIPRESS_CACHE_DIR", str(tmp_path))
    keys = {}
    for archs in ("80", "90", "80,90"):
        monkeypatch.setenv("HIPRESS_CUDA_ARCHS", archs)
        assert cuda_archs() == tuple(archs.split(","))
        art = build(load("fp16"), "cuda")
        assert art.library.exists() and not art.cached
        keys[archs] = art.key
    assert len(set(keys.values())) == 3
    monkeypatch.setenv("HIPRESS_CUDA_ARCHS", "90")
    assert build(load("fp16"), "cuda").key == keys["90"]  # and the same arch hits its entry


def test_bad_architecture_list_is_a_build_error(monkeypatch):
    monkeypatch.setenv("HIPRESS_CUDA_ARCHS", "sm90")
    with pytest.raises(BuildError, match="HIPRESS_CUDA_ARCHS"):
        cuda_archs()

EVERY_OPERATOR = textwrap.dedent("""
    # every operator once, so the CUDA runtime's templates all get instantiated
    param k: u32 = 5
    encode(g: f32[]) -> bytes:
        let n = size(g)
        let s, order = sort(map(g, abs), descending=true, index=true)
        let lo = reduce(g, min)
        let c = reduce(map(g, x -> x > 0.0), sum)
        let big = reduce(map(g, x -> i32(x * 100.0)), max)
        let kept, vals = filter(g, x -> abs(x) > 0.5, index=true)
        let ti, tv = topk(g, k, key=abs, index=true)
        let picked = gather(g, map(iota(k), i -> randint(n)))
        let h = map(g, x -> f16(x))
        let bs = reduce(g, sum, key=x -> x * x, block=100)
        let bmn = reduce(g, min, block=300)
        let bmx = reduce(g, max, block=300)
        let bc = reduce(map(g, x -> u32(x > 0.0)), sum, block=7)
        let bi = reduce(map(g, x -> i32(x * 100.0)), max, block=9000)
        let e = map(g, expand(bmn), expand(bmx), (x, a, b) -> x * a + b)
        return concat(lo, c, big, pack(map(g, x -> u8(x > 0.0) + u8(random() < 0.5)), bits=2),
                      kept, vals, ti, tv, picked, h, bs, bc, bi, e)
    decode(p: bytes, n: u32) -> f32[n]:
        let lo, c, big, q, kept, vals, ti, tv, picked, h, bs, bc, bi, e = extract(p)
        let a = scatter(kept, vals, n)
        let b = scatter(ti, tv, n)
        return map(a, b, unpack(q), h, expand(bs), e,
                   (x, y, z, w, s, t) -> x + y + f32(z) * lo + f32(w) + s + t)
""")


@needs_nvcc
@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_compiles_for_sm80_and_sm90(name):
    art = build(load(name), "cuda", use_cache=False)
    assert art.library.exists()
    assert "[=] __device__" in art.source.read_text()  # element functions run on the GPU


@needs_nvcc
def test_every_operator_compiles_for_cuda_and_runs_on_cpu():
    prog = load_source(EVERY_OPERATOR, "every.cll")
    assert build(prog, "cuda", use_cache=False).library.exists()
    cpu, ref = hipress.Codec(prog, "cpu", 3), hipress.Codec(prog, "ref", 3)
    x = gradient(20_000)
    p = ref.encode(x)
    assert cpu.encode(x).tobytes() == p.tobytes()
    np.testing.assert_array_equal(cpu.decode(p, x.size), ref.decode(p, x.size))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and (shutil.which("nvcc") or pip_nvcc()) is not None
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device and nvcc")
@pytest.mark.parametrize("name", ALGORITHMS)
def test_cuda_matches_reference(name):
    import torch

    gpu = hipress.codec(name, target="cuda", seed=4)
    ref = hipress.codec(name, target="ref", seed=4)
    for n in (0, 1, 9, 1000, 2**20 + 3):
        x = gradient(n, seed=n)
        pg = gpu.encode(torch.from_numpy(x).cuda(), step=2)
        pr = ref.encode(x, step=2)
        assert pg.cpu().numpy().tobytes() == pr.tobytes()
        dg = gpu.decode(torch.from_numpy(pr).cuda(), n).cpu().numpy()
        dr = ref.decode(pr, n)
        nan = np.isnan(dr)
        assert (np.isnan(dg) == nan).all()
        assert dg[~nan].tobytes() == dr[~nan].tobytes()
