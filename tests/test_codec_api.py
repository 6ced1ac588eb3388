"""The public contract of hipress.codec (see DESIGN.md)."""

import numpy as np
import pytest
import torch
from conftest import gradient

import hipress
from compll import MAX_ELEMENTS
from hipress import CompileError, ConfigError

pytestmark = pytest.mark.pure


def test_algorithms_lists_every_shipped_file():
    names = hipress.algorithms()
    assert names == sorted(names)
    for expected in ("onebit", "signsgd", "tbq", "terngrad", "qsgd", "minmax8", "fp16", "dgc",
                     "topk", "randomk", "graddrop", "natural", "threshold"):
        assert expected in names


@pytest.mark.parametrize("name", hipress.algorithms())
def test_dsl_files_are_short_and_documented(name):
    from compll.compiler import algorithm_path

    text = algorithm_path(name).read_text()
    code = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code) <= 40
    assert text.startswith(f"# {name}:")
    assert "Parameters:" in text and "Payload:" in text


def test_torch_tensors_in_and_out():
    x = torch.randn(1001)
    c = hipress.codec("fp16")
    p = c.encode(x)
    out = torch.zeros(1001)
    assert c.decode(p, 1001, out=out) is out
    np.testing.assert_array_equal(out.numpy(), x.numpy().astype(np.float16).astype(np.float32))


def test_half_precision_and_non_contiguous_inputs_are_upcast():
    base = torch.randn(64, 32)
    x = base.t()[3]  # a strided view
    assert not x.is_contiguous()
    c = hipress.codec("fp16")
    np.testing.assert_array_equal(c.decode(c.encode(x), 64),
                                  x.numpy().astype(np.float16).astype(np.float32))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        y = c.decode(c.encode(x.to(dtype)), 64)
        np.testing.assert_array_equal(
            y, x.to(dtype).float().numpy().astype(np.float16).astype(np.float32))


def test_decode_accumulate_adds_into_out():
    x = gradient(777)
    c = hipress.codec("minmax8")
    p = c.encode(x)
    acc = np.full(777, 2.0, np.float32)
    c.decode(p, 777, out=acc, accumulate=True)
    np.testing.assert_array_equal(acc, np.float32(2.0) + c.decode(p, 777))
    with pytest.raises(ConfigError, match="out="):
        c.decode(p, 777, accumulate=True)
    with pytest.raises(ConfigError, match="contiguous float32"):
        c.decode(p, 777, out=np.zeros(777, np.float64))


@pytest.mark.parametrize("name", ["minmax8", "dgc"])  # a dense and a scattered decode
def test_decode_scales_in_the_same_pass(name):
    x = gradient(5000)
    c = hipress.codec(name, target="cpu")
    p = c.encode(x)
    plain = c.decode(p, 5000)
    np.testing.assert_array_equal(c.decode(p, 5000, scale=1 / 3),
                                  plain * np.float32(1 / 3))
    acc = gradient(5000, seed=4)
    # What error feedback does: the residual minus what the payload decodes to.
    np.testing.assert_array_equal(c.decode(p, 5000, out=acc.copy(), accumulate=True,
                                           scale=-1.0), acc - plain)


@pytest.mark.parametrize("n", [5000, 3 * 8192 + 7])  # one chunk of a pass, and several
@pytest.mark.parametrize("target", ["cpu", "ref"])
@pytest.mark.parametrize("name", hipress.algorithms())
def test_error_feedback_passes_match_their_definition(name, target, n):
    """encode(x, residual=r) adds x into r and gives the payload of the sum; decode with
    feedback=True subtracts what it decodes to and zeroes non-finite results, bit for bit.
    (The CPU encoder adds inside its first pass over x where it has one: every
    algorithm, since where the add happens depends on how the encoder starts.)"""
    x, r = gradient(n), gradient(n, seed=7) * np.float32(0.1)
    x[3], x[5], r[9] = np.nan, np.inf, -np.inf
    c = hipress.codec(name, target=target, seed=2)
    with np.errstate(invalid="ignore", over="ignore"):
        total = r + x
    payload = np.asarray(c.encode(x, step=5, residual=r)).copy()
    np.testing.assert_array_equal(r.view(np.uint32), total.view(np.uint32))  # r += x
    np.testing.assert_array_equal(payload, np.asarray(c.encode(total, step=5)))
    c.decode(payload, n, out=r, scale=-1.0, feedback=True)
    with np.errstate(invalid="ignore", over="ignore"):
        want = total + np.float32(-1.0) * c.decode(payload, n)
    want[~np.isfinite(want)] = 0.0
    np.testing.assert_array_equal(r.view(np.uint32), want.view(np.uint32))
    assert np.isfinite(r).all() and r[3] == 0.0
    with pytest.raises(ConfigError, match="residual= must be a contiguous float32 array"):
        c.encode(x, residual=r[:10])
    with pytest.raises(ConfigError, match="need out="):
        c.decode(payload, n, feedback=True)


def test_a_retried_encode_with_a_residual_adds_once():
    """A payload larger than the loader's first guess makes it encode again; the residual
    must hold r + x, not r + 2x, and the payload be that of r + x."""
    n = 20000
    x, r = gradient(n), gradient(n, seed=8)
    total = r + x
    c = hipress.codec("dgc", target="cpu", ratio=0.5)  # k = n / 2: past the first guess
    payload = np.asarray(c.encode(x, step=1, residual=r)).copy()
    np.testing.assert_array_equal(r, total)
    np.testing.assert_array_equal(payload, np.asarray(c.encode(total, step=1)))


@pytest.mark.parametrize("name", ["onebit", "dgc"])  # add fused into a pass, add first
def test_an_encode_into_a_short_buffer_still_adds_into_the_residual(name):
    """The kernel's contract with the loader's retry: when the payload does not fit,
    nothing is written but r already holds r + x (the retry encodes r alone)."""
    import ctypes

    n = 20000
    x, r = gradient(n), gradient(n, seed=8)
    total = r + x
    kernel = hipress.codec(name, target="cpu")._kernel("cpu")
    out = np.zeros(16, np.uint8)
    size = kernel.lib.hp_encode(x.ctypes.data, r.ctypes.data, n, 0, 1, out.ctypes.data,
                                ctypes.c_uint64(out.size))
    assert size > out.size and not out.any()
    np.testing.assert_array_equal(r, total)


def test_more_elements_than_a_u32_counts_is_a_clear_error():
    c = hipress.codec("onebit", target="cpu")
    huge = np.broadcast_to(np.float32(1.0), (MAX_ELEMENTS + 1,))  # no memory behind it
    with pytest.raises(ConfigError, match="4,294,967,296 elements is more than one encode"):
        c.encode(huge)
    with pytest.raises(ConfigError, match="split the tensor"):
        c.decode(np.zeros(64, np.uint8), MAX_ELEMENTS + 1)


def test_the_kernels_themselves_refuse_more_elements_than_a_u32_counts():
    """The C ABI guards its 32-bit element loops too, before touching any memory."""
    import ctypes

    kernel = hipress.codec("terngrad", target="cpu")._kernel("cpu")
    x, out = np.zeros(8, np.float32), np.zeros(64, np.uint8)
    size = kernel.lib.hp_encode(x.ctypes.data, None, MAX_ELEMENTS + 1, 0, 0, out.ctypes.data,
                                ctypes.c_uint64(out.size))
    assert size == -1 and not out.any()
    assert b"split the tensor" in kernel.lib.hp_last_error()
    err = ctypes.create_string_buffer(256)
    rc = kernel.lib.hp_decode(out.ctypes.data, out.size, MAX_ELEMENTS + 1, x.ctypes.data, 0,
                              ctypes.c_float(1.0), 0, err, 256)
    assert rc == 1 and b"split the tensor" in err.value and not x.any()


def test_params_override_defaults():
    c = hipress.codec("dgc", ratio=0.01)
    assert c.params["ratio"] == pytest.approx(0.01)
    assert "ratio=0.01" in repr(c)
    with pytest.raises(ConfigError, match="unknown parameter"):
        hipress.codec("dgc", rate=0.01)
    with pytest.raises(ConfigError, match="ratio must be in"):
        hipress.codec("dgc", ratio=2.0)


def test_unknown_algorithm_and_target():
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'.*onebit"):
        hipress.codec("nope")
    with pytest.raises(ConfigError, match="unknown target"):
        hipress.codec("onebit", target="tpu")


def test_a_user_file_by_path(tmp_path):
    src = tmp_path / "half.cll"
    src.write_text(
        "# half: keep every other element\n"
        "encode(g: f32[]) -> bytes:\n"
        "    return concat(map(g, x -> x * 0.5))\n"
        "decode(p: bytes, n: u32) -> f32[n]:\n"
        "    let h: f32[n] = extract(p)\n"
        "    return map(h, v -> v * 2.0)\n"
    )
    c = hipress.codec(str(src))
    x = gradient(100)
    np.testing.assert_array_equal(c.decode(c.encode(x), 100), x)
    src.write_text("encode(g: f32[]) -> bytes:\n    return concat(g\n")
    with pytest.raises(CompileError) as info:
        hipress.codec(str(src))
    assert str(info.value).startswith(f"{src}:")


def test_error_hierarchy():
    for cls in (hipress.CompileError, hipress.PayloadError, hipress.SyncError,
                hipress.ConfigError):
        assert issubclass(cls, hipress.HiPressError)


def test_docs_walkthrough_compiles_and_runs(tmp_path):
    """The compressor built step by step in docs/compll.md works as shown."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "compll.md").read_text()
    walk = doc[doc.index("## Walk-through"):]
    blocks = re.findall(r"```\n(.*?)```", walk, flags=re.S)
    import textwrap

    source = "\n".join(textwrap.dedent(b) for b in blocks[:3])
    path = tmp_path / "deadzone.cll"
    path.write_text(source)
    c = hipress.codec(str(path), eps=0.05)
    x = gradient(5000)
    y = c.decode(c.encode(x), x.size)
    cut = np.float32(0.05) * np.abs(x).max()
    kept = np.abs(x) > cut
    np.testing.assert_array_equal(y[~kept], 0)
    np.testing.assert_array_equal(np.sign(y[kept]), np.sign(x[kept]))
    np.testing.assert_allclose(np.abs(y[kept]), np.abs(x[kept]).mean(), rtol=1e-5)
    from hipress.cli import main

    assert main(["compile", str(path)]) == 0
