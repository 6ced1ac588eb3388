"""The non-finite flag: a NaN or an infinity in what an encoder reads reaches every decode
as NaN, for every codec and target, batched or not, and never enters a residual."""

import struct

import numpy as np
import pytest
from conftest import gradient
from test_kernels_cpu import VARIANTS

import hipress
from compll import payload
from compll.constants import NONFINITE
from compll.loaders import DECODE_ITEM
from hipress import PayloadError

pytestmark = pytest.mark.cpu

N = 20_000
SPECIALS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
NAN_BITS = 0x7FC00000

#: a codec written with no thought of NaN: its max ignores one and its cast makes one 0
USER_CODEC = """\
encode(g: f32[]) -> bytes:
    let scale = reduce(g, max, key=abs)
    let q = map(g, x -> if scale > 0.0 then i32(round(x / scale * 7.0)) + 8 else 8)
    return concat(scale, pack(q, bits=4))

decode(p: bytes, n: u32) -> f32[n]:
    let scale: f32, q: u4[n] = extract(p)
    return map(unpack(q), v -> f32(i32(v) - 8) * scale / 7.0)
"""


def _flags(p: np.ndarray) -> int:
    return struct.unpack_from("<I", np.ascontiguousarray(p[12:16]).tobytes())[0]


def _codecs(name, params, tmp_path=None):
    return [hipress.codec(name, target=t, seed=3, **params) for t in ("cpu", "ref")]


@pytest.fixture(scope="module")
def user_cll(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "mine4.cll"
    path.write_text(USER_CODEC)
    return str(path)


CASES = VARIANTS + [("USER", {})]


def _name(name, user_cll):
    return user_cll if name == "USER" else name


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_one_non_finite_element_flags_the_payload_and_decodes_to_nan(name, params, user_cll):
    cpu, ref = _codecs(_name(name, user_cll), params)
    clean = gradient(N, seed=1)
    assert _flags(cpu.encode(clean, step=0)) == 0  # a finite tensor is never flagged
    for kind, value in SPECIALS.items():
        for at in (0, 4321, N - 1):  # the first and last element, and one inside a chunk
            x = clean.copy()
            x[at] = value
            p = cpu.encode(x, step=1)
            assert p.tobytes() == ref.encode(x, step=1).tobytes(), (kind, at)
            assert _flags(p) == NONFINITE, (kind, at)
            for c in (cpu, ref):
                y = c.decode(p, N)
                assert (y.view(np.uint32) == NAN_BITS).all(), (c.target, kind, at)
                acc = gradient(N, seed=2)
                c.decode(p, N, out=acc, accumulate=True, scale=0.5)
                assert (acc.view(np.uint32) == NAN_BITS).all(), (c.target, kind, at)


@pytest.mark.parametrize("name", ["onebit", "terngrad", "dgc", "topk", "cgx", "randomk",
                                  "threshold", "fp16"])
def test_a_flagged_step_leaves_the_residual_finite(name):
    """With error feedback, a step whose sum r + g is not finite ends with r = 0 (the sum is
    lost where g was not finite, and the loss scaler discards that step anyway); a finite
    r + g that overflows to inf flags the payload too."""
    for c in _codecs(name, {}):
        r = gradient(N, seed=5) * 0.1
        x = gradient(N, seed=6)
        x[77] = np.nan
        p = c.encode(x, step=2, residual=r)
        assert _flags(p) == NONFINITE
        c.decode(p, N, out=r, scale=-1.0, feedback=True)
        assert r.tobytes() == np.zeros(N, np.float32).tobytes(), c.target
        # the residual's own sum overflows: finite inputs, a non-finite encoder input
        r = np.full(N, 3e38, np.float32)
        p = c.encode(np.full(N, 3e38, np.float32), step=3, residual=r)
        assert _flags(p) == NONFINITE, c.target


@pytest.mark.parametrize("name", ["onebit", "dgc", "cgx", "terngrad", "qsgd"])
def test_batches_keep_the_flag_per_segment(name):
    """One flagged segment of a batch: its output is NaN, its residual 0, the others are
    what they would be alone; the batched merge re-encodes a flagged sum flagged."""
    cpu, ref = _codecs(name, {})
    sizes = [5000, 70_001, 9]
    xs = [gradient(n, seed=10 + i) for i, n in enumerate(sizes)]
    xs[1][12345] = np.inf
    for c in (cpu, ref):
        res = [gradient(n, seed=20 + i) * 0.1 for i, n in enumerate(sizes)]
        clean = [r.copy() for r in res]
        payload_, _ = c.encode_batch(xs, steps=[1, 2, 3], residuals=res, feedback=True)
        assert res[1].tobytes() == np.zeros(sizes[1], np.float32).tobytes()
        for i in (0, 2):  # the clean segments' residuals moved as a single call's would
            p = c.encode(xs[i], step=i + 1, residual=clean[i])
            c.decode(p, sizes[i], out=clean[i], scale=-1.0, feedback=True)
            assert res[i].tobytes() == clean[i].tobytes(), (c.target, i)
        outs = c.decode_batch(payload_, sizes)
        assert np.isnan(outs[1]).all() and np.isfinite(outs[0]).all() \
            and np.isfinite(outs[2]).all(), c.target
        # an aggregator: the flagged payloads merged into its values, then re-encoded
        agg = [gradient(n, seed=30 + i) for i, n in enumerate(sizes)]
        merged, got = c.encode_batch(agg, steps=[4, 5, 6], merge=payload_)
        starts = np.cumsum([0, *got[:-1]])
        assert [_flags(merged[s:]) for s in starts] == [0, NONFINITE, 0], c.target


def test_the_scaled_sum_of_a_batched_decode_is_nan_where_one_payload_was_flagged():
    """An allgather's mean of two payloads, as its graph runs it: the first added into the
    output, the second added and the sum scaled (one call each: rows of one call write
    distinct outputs, in parallel)."""
    c = hipress.codec("terngrad", target="cpu")
    a, b = gradient(N, seed=1), gradient(N, seed=2)
    b[5] = np.nan
    out = np.zeros(N, np.float32)
    for sent, last in ((c.encode(a, step=1), False), (c.encode(b, step=2), True)):
        items = np.zeros(1, DECODE_ITEM)
        items["p"][0], items["size"][0] = sent.ctypes.data, sent.size
        items["n"], items["out"] = N, out.ctypes.data
        c.decode_items(items, accumulate=True, scale=0.5 if last else 1.0, scale_sum=last)
    assert (out.view(np.uint32) == NAN_BITS).all()


@pytest.mark.parametrize("target", ["cpu", "ref"])
def test_unknown_flag_bits_are_a_payload_error(target):
    c = hipress.codec("onebit", target=target)
    p = c.encode(gradient(N, seed=1))
    for bits in (2, 0x80000000, NONFINITE | 4):
        bad = p.copy()
        struct.pack_into("<I", bad, 12, bits)
        with pytest.raises(PayloadError, match="flags"):
            c.decode(bad, N)
    assert not payload.nonfinite(p)
