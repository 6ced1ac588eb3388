"""Blockwise reductions (``reduce(..., block=B)``) and ``expand``: one value per block,
each block reduced as an array of its own, bit-exact on every backend."""

import numpy as np
import pytest
from conftest import gradient
from test_kernels_cpu import adversarial, same_values

import hipress
from compll import load_source
from compll.semantics import block_reduce, reduce

BLOCKS = [1, 3, 100, 512, 8193, 20000]

PROGRAM = """
param b: u32 = 512
encode(g: f32[]) -> bytes:
    let sq = reduce(g, sum, key=x -> x * x, block=b)
    let s = reduce(map(g, x -> x * 0.5 + 1.0), sum, block=b)
    let lo = reduce(g, min, block=b)
    let hi = reduce(g, max, block=b)
    let amax = reduce(g, max, key=abs, block=b)
    let pos = reduce(map(g, x -> u32(x > 0.0)), sum, block=b)
    let big = reduce(map(g, x -> i32(x * 1000.0)), max, block=b)
    let small = reduce(map(g, x -> i32(x * 1000.0)), min, block=b)
    let centred = map(g, expand(lo), expand(hi), (x, a, c) -> x - (a + c) * 0.5)
    return concat(sq, s, lo, hi, amax, pos, big, small, centred)
decode(p: bytes, n: u32) -> f32[n]:
    let sq, s, lo, hi, amax, pos, big, small, centred = extract(p)
    return map(centred, expand(lo), expand(hi), expand(sq), (x, a, c, q) -> x + (a + c) * 0.5 + q)
"""


def program(block: int):
    return load_source(PROGRAM, "blocks.cll", params={"b": block})


@pytest.mark.pure
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kind", ["random", "special", "zeros"])
def test_each_block_reduces_as_an_array_of_its_own(block, kind):
    x = adversarial(kind, 3 * block + block // 2 + 1)
    x[: min(block, 5)] = np.nan  # a first block that is (for small blocks) all NaN
    ints = (np.nan_to_num(x, posinf=9, neginf=-9) * 1000).astype(np.int32)
    for op in ("sum", "min", "max"):
        for values, out in ((x, "f32"), (ints, "i32")):
            with np.errstate(all="ignore"):  # inf - inf is defined: NaN
                got = block_reduce(op, values, block, out)
                ones = [np.asarray(reduce(op, values[k * block:(k + 1) * block], out))
                        for k in range(got.size)]
            assert got.size == -(-x.size // block)
            for k, one in enumerate(ones):
                assert got[k:k + 1].tobytes() == one.reshape(1).astype(got.dtype).tobytes()


@pytest.mark.pure
def test_block_zero_is_one_block_of_all():
    x = gradient(70_001)
    for op in ("sum", "min", "max"):
        whole = np.atleast_1d(reduce(op, x, "f32"))
        assert block_reduce(op, x, 0, "f32").tobytes() == whole.tobytes()
    assert block_reduce("max", np.zeros(0, np.float32), 0, "f32")[0] == -np.inf
    assert block_reduce("max", np.zeros(0, np.float32), 4, "f32").size == 0


@pytest.mark.cpu
@pytest.mark.parametrize("block", [0, *BLOCKS])
@pytest.mark.parametrize("kind", ["random", "special", "equal"])
def test_cpu_blockwise_matches_reference_bit_for_bit(block, kind):
    prog = program(block)
    cpu, ref = hipress.Codec(prog, "cpu", 3), hipress.Codec(prog, "ref", 3)
    for n in (0, 1, 511, block + 1, 3 * 65536 + 17):
        x = adversarial(kind, n)
        p = ref.encode(x)
        assert cpu.encode(x).tobytes() == p.tobytes(), (n, block)
        assert same_values(cpu.decode(p, n), ref.decode(p, n)), (n, block)  # NaN bits may differ


@pytest.mark.pure
def test_block_lengths_size_the_payload():
    prog = program(100)
    c = hipress.Codec(prog, "ref", 0)
    n = 1001
    p = c.encode(gradient(n))
    with pytest.raises(hipress.PayloadError):
        c.decode(p[:-8], n)
    with pytest.raises(hipress.PayloadError):
        c.decode(p, n + 100)  # eleven blocks are not the twelve that n + 100 needs


@pytest.mark.cpu
@pytest.mark.parametrize("name,params", [
    *[("cgx", {"bits": b, "bucket": k}) for b in (1, 2, 3, 8) for k in (8, 64, 512, 1000)],
    ("cgx", {"bits": 4, "bucket": 8192}), ("zeropp", {"bucket": 64}),
    ("zeropp", {"bits": 8, "bucket": 2048}), ("qsgd", {"bucket": 256})])
def test_bucketed_quantizers_match_the_reference_in_every_loop_shape(name, params):
    """Buckets that divide a chunk run inside the element pass and block by block (whole
    bytes of packed bits: multiples of 8); others as passes of their own. Same bits."""
    cpu = hipress.codec(name, target="cpu", seed=5, **params)
    ref = hipress.codec(name, target="ref", seed=5, **params)
    for n in (0, 1, 7, 8191, 8193, 100_003):
        x = gradient(n)
        x[n // 3: n // 3 + 9] = 0.0  # a constant run: a bucket with a zero range
        p = ref.encode(x, step=2)
        assert cpu.encode(x, step=2).tobytes() == p.tobytes(), (n, params)
        assert cpu.decode(p, n).tobytes() == ref.decode(p, n).tobytes(), (n, params)
