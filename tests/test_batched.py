"""Batched kernels (a chunk's segments in one call) and chunk formation."""

import numpy as np
import pytest
from conftest import gradient
from test_kernels_cpu import VARIANTS, adversarial, same_values

import hipress
from casync.chunks import _ROUTES, Chunker, Entry
from casync.feedback import ErrorFeedback
from casync.plan import Plan
from compll.constants import FEEDBACK
from compll.loaders import ENCODE_ITEM
from hipress import PayloadError

#: segment sizes of one batch: empty and one-element segments, odd sizes, one large
#: enough to run alone (parallel inside), the rest one per thread
SEGMENTS = [0, 1, 7, 1000, 0, 70_001, 3, 8]


def _inputs(kind: str) -> list[np.ndarray]:
    return [adversarial(kind, n) if n else np.zeros(0, np.float32) for n in SEGMENTS]


@pytest.mark.cpu
@pytest.mark.parametrize("kind", ["random", "special"])
@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_batch_equals_single_calls_and_the_reference(name, params, kind):
    cpu = hipress.codec(name, target="cpu", seed=4, **params)
    ref = hipress.codec(name, target="ref", seed=4, **params)
    xs = _inputs(kind)
    steps = [11 + 3 * i for i in range(len(xs))]
    start = [gradient(n, seed=i + 20) * 0.1 for i, n in enumerate(SEGMENTS)]
    res_batch, res_single, res_ref = ([r.copy() for r in start] for _ in range(3))

    payload, sizes = cpu.encode_batch(xs, steps=steps, residuals=res_batch, feedback=True)
    singles = []
    for x, s, r in zip(xs, steps, res_single, strict=True):
        p = cpu.encode(x, step=s, residual=r).copy()
        cpu.decode(p, x.size, out=r, scale=-1.0, feedback=True)
        singles.append(p)
    assert payload.tobytes() == np.concatenate(singles).tobytes()
    assert sizes == [p.size for p in singles]
    ref_payload, _ = ref.encode_batch(xs, steps=steps, residuals=res_ref, feedback=True)
    assert ref_payload.tobytes() == payload.tobytes()
    for a, b, c in zip(res_batch, res_single, res_ref, strict=True):
        assert same_values(a, b) and same_values(a, c)

    # Decode: overwrite, accumulate, scale.
    acc = [gradient(n, seed=i + 40) for i, n in enumerate(SEGMENTS)]
    for kwargs in ({}, {"accumulate": True}, {"scale": 0.25}):
        outs = cpu.decode_batch(payload, SEGMENTS, [a.copy() for a in acc], **kwargs)
        want = ref.decode_batch(payload, SEGMENTS, [a.copy() for a in acc], **kwargs)
        for p, o, w, a, n in zip(singles, outs, want, acc, SEGMENTS, strict=True):
            assert same_values(o, w), kwargs
            assert same_values(o, cpu.decode(p, n, out=a.copy(), **kwargs)), kwargs


def _deferred_encode(codec, ef, xs, step, merge=None):
    """One batched encode of ``xs`` whose residual update waits in ``ef``'s kept buffers,
    as CaSync's host path runs it (with ``merge``: that message added into ``xs`` first,
    in the same call, as an aggregator's)."""
    caps = [codec.max_payload_bytes(x.size) for x in xs]
    out = np.zeros(sum(caps) + 8, np.uint8)
    items = np.zeros(len(xs), ENCODE_ITEM)
    offsets = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.uint64)
    items["g"] = [x.ctypes.data for x in xs]
    items["r"] = [ef.site(i, x.size).ctypes.data for i, x in enumerate(xs)]
    items["keep"] = [ef.kept(i, codec, cap).ctypes.data for i, cap in enumerate(caps)]
    items["n"], items["cap"] = [x.size for x in xs], caps
    items["out"] = offsets + np.uint64(out.ctypes.data)
    items["step"], items["flags"] = 5 + step, FEEDBACK
    return out[:codec.encode_items(items, out, merge=merge)].copy()


@pytest.mark.cpu
@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_a_deferred_residual_update_gives_the_eager_updates_bits(name, params):
    """The update settled inside the next encode's pass (or when the residual is read):
    every payload and residual the same as updating right after each encode, through
    non-finite inputs and empty and one-element segments."""
    cpu = hipress.codec(name, target="cpu", seed=4, **params)
    eager = [np.zeros(n, np.float32) for n in SEGMENTS]
    ef = ErrorFeedback()
    for step, kind in enumerate(["random", "special", "random", "random"]):
        xs = [x * (step + 1) for x in _inputs(kind)]
        want, _ = cpu.encode_batch(xs, steps=[5 + step] * len(xs), residuals=eager,
                                   feedback=True)
        assert _deferred_encode(cpu, ef, xs, step).tobytes() == want.tobytes(), step
        owed = [int(ef.kept(i, cpu, 0)[:8].view(np.uint64)[0]) for i in range(len(xs))]
        assert all(owed), "each site owes its last payload until it is read"
        if step == 1:  # read mid-way: settled now, the next encode owes nothing more
            assert same_values(ef.residual(3), eager[3])
    state = ef.state_dict()
    for i, r in enumerate(eager):
        assert same_values(state[i], r), i


def _merge_message(codec, kind, seed):
    """A worker's upload for SEGMENTS: what an aggregator merges."""
    theirs = [x * np.float32(0.5) + np.float32(seed) for x in _inputs(kind)]
    return codec.encode_batch(theirs, steps=[seed + i for i in range(len(theirs))])[0].copy()


@pytest.mark.cpu
@pytest.mark.parametrize("feedback", [True, False])
@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_a_fused_merge_and_encode_gives_the_two_calls_bits(name, params, feedback):
    """An aggregator's last merge inside its re-encode: the same merged values, payloads
    and residuals as decoding (accumulate) and then encoding, and as the reference (on
    one kind of input: the interpreter is slow, and the two calls match it elsewhere)."""
    cpu = hipress.codec(name, target="cpu", seed=4, **params)
    ref = hipress.codec(name, target="ref", seed=4, **params)
    for kind in ("random", "special"):
        msg = _merge_message(cpu, kind, 3)
        start = [gradient(n, seed=i + 20) * 0.1 for i, n in enumerate(SEGMENTS)]
        runs = []
        for how in ("fused", "two calls", "ref")[:3 if kind == "random" else 2]:
            xs = _inputs(kind)
            res = [r.copy() for r in start] if feedback else None
            steps = [11 + 3 * i for i in range(len(xs))]
            if how == "two calls":
                cpu.decode_batch(msg, SEGMENTS, xs, accumulate=True)
                payload, _ = cpu.encode_batch(xs, steps=steps, residuals=res, feedback=feedback)
            else:
                payload, _ = (cpu if how == "fused" else ref).encode_batch(
                    xs, steps=steps, residuals=res, feedback=feedback, merge=msg)
            runs.append((payload.tobytes(), xs, res))
        (fused, xs_f, res_f), *others = runs
        for payload, xs, res in others:
            assert payload == fused, kind
            for a, b in zip(xs_f, xs, strict=True):
                assert same_values(a, b), kind
            for a, b in zip(res_f or [], res or [], strict=True):
                assert same_values(a, b), kind


@pytest.mark.cpu
@pytest.mark.parametrize("name,params", VARIANTS, ids=[f"{n}-{p}" for n, p in VARIANTS])
def test_a_fused_merge_with_a_deferred_update_gives_the_eager_bits(name, params):
    """CaSync's host path: the merge, the deferred update of the last payload and the
    encode in one pass, over steps, against merging and encoding eagerly."""
    cpu = hipress.codec(name, target="cpu", seed=4, **params)
    eager = [np.zeros(n, np.float32) for n in SEGMENTS]
    ef = ErrorFeedback()
    for step, kind in enumerate(["random", "special", "random"]):
        msg = _merge_message(cpu, kind, step + 1)
        mine = [x * (step + 1) for x in _inputs(kind)]
        xs = [x.copy() for x in mine]
        cpu.decode_batch(msg, SEGMENTS, xs, accumulate=True)
        want, _ = cpu.encode_batch(xs, steps=[5 + step] * len(xs), residuals=eager,
                                   feedback=True)
        got = _deferred_encode(cpu, ef, mine, step, merge=msg)
        assert got.tobytes() == want.tobytes(), step
        for a, b in zip(mine, xs, strict=True):
            assert same_values(a, b), step
    state = ef.state_dict()
    for i, r in enumerate(eager):
        assert same_values(state[i], r), i


@pytest.mark.cpu
@pytest.mark.parametrize("target", ["cpu", "ref"])
def test_a_bad_merge_payload_names_its_segment(target):
    c = hipress.codec("onebit", target=target)
    xs = [gradient(n, seed=n) for n in (100, 200, 300)]
    msg, sizes = c.encode_batch([x * 2 for x in xs])
    bad = msg.copy()
    bad[sizes[0] + 4] ^= 0xFF  # the second segment's algorithm id
    with pytest.raises(PayloadError, match="segment 1 of 3"):
        c.encode_batch([x.copy() for x in xs], merge=bad)
    for broken in (msg[:-8], np.concatenate([msg, np.zeros(8, np.uint8)])):
        mine = [x.copy() for x in xs]
        with pytest.raises(PayloadError, match="segment 2 of 3"):
            c.encode_batch(mine, merge=broken)
        for a, b in zip(mine, xs, strict=True):  # framing failed: nothing was merged
            assert same_values(a, b)
    with pytest.raises(hipress.ConfigError, match="merge's target"):
        c.encode_batch([x.astype(np.float64) for x in xs], merge=msg)


@pytest.mark.cpu
def test_a_deferred_update_is_settled_before_its_site_changes_codec():
    onebit, terngrad = hipress.codec("onebit", target="cpu"), hipress.codec("terngrad")
    ef, eager = ErrorFeedback(), [np.zeros(1000, np.float32)]
    x = [gradient(1000, seed=3)]
    _deferred_encode(onebit, ef, x, 0)
    onebit.encode_batch(x, steps=[5], residuals=eager, feedback=True)
    ef.kept(0, terngrad, terngrad.max_payload_bytes(1000))  # a new plan for the site
    assert same_values(ef.residual(0), eager[0])


@pytest.mark.cpu
@pytest.mark.parametrize("target", ["cpu", "ref"])
def test_batch_decode_names_the_bad_segment_and_keeps_the_others(target):
    c = hipress.codec("onebit", target=target)
    xs = [gradient(n, seed=n) for n in (100, 200, 300)]
    payload, sizes = c.encode_batch(xs)
    bad = payload.copy()
    bad[sizes[0] + 4] ^= 0xFF  # the second segment's algorithm id
    outs = [np.full(n, 7.0, np.float32) for n in (100, 200, 300)]
    with pytest.raises(PayloadError, match="segment 1 of 3"):
        c.decode_batch(bad, [100, 200, 300], outs)
    assert (outs[1] == 7.0).all()  # untouched
    for i in (0, 2):  # the others decoded, on either side of it
        assert same_values(outs[i], c.decode(c.encode(xs[i]), xs[i].size)), i
    with pytest.raises(PayloadError, match="follow"):
        c.decode_batch(np.concatenate([payload, np.zeros(8, np.uint8)]), [100, 200, 300])
    with pytest.raises(PayloadError):
        c.decode_batch(payload[:-8], [100, 200, 300])
    with pytest.raises(PayloadError):  # one segment fewer than the message holds
        c.decode_batch(payload, [100, 200])


@pytest.mark.cpu
def test_batch_reuses_a_buffer_and_advances_the_step():
    c = hipress.codec("terngrad", target="cpu", seed=1)
    xs = [gradient(n, seed=n) for n in (50, 60)]
    buf = np.zeros(sum(c.max_payload_bytes(x.size) for x in xs), np.uint8)
    payload, _ = c.encode_batch(xs, out=buf)
    assert payload.ctypes.data == buf.ctypes.data
    assert c.step == 2
    again, _ = hipress.codec("terngrad", target="cpu", seed=1).encode_batch(xs, steps=[0, 1])
    assert again.tobytes() == payload.tobytes()


class _Tensor:
    def __init__(self, name: str, numel: int) -> None:
        self.name, self.numel, self.pending, self.device = name, numel, 0, "cpu"


@pytest.mark.pure
def test_chunks_fill_to_their_size_and_keep_plans_apart():
    chunker = Chunker(world=4, chunk_elems=1000)
    ps, none = Plan("ps", "onebit", 1), Plan("none")
    closed = []
    for i in range(10):
        closed += chunker.add(_Tensor(f"c{i}", 300), ps)
        closed += chunker.add(_Tensor(f"r{i}", 10), none)
    assert [c.numel for c in closed] == [1200, 1200]  # closed once they hold 1000
    rest = chunker.flush()
    assert [(c.plan.topology, c.numel) for c in rest] == [("none", 100), ("ps", 600)]
    assert all(len({s.owner for s in c.segments}) == 4 for c in closed)
    # every segment a payload; a tensor's segments are in order and cover it
    segs = [s for c in closed + rest for s in c.segments if s.entry.name == "c3"]
    assert [(s.lo, s.hi) for s in segs] == [(0, 300)]


@pytest.mark.pure
def test_a_batch_is_chunked_as_its_tensors_one_by_one():
    """``add_many`` closes the same chunks as ``add`` per tensor; plans that differ only
    in K, or are equal but distinct objects, fill one chunk."""
    def layout(chunks: list) -> list:
        return [(c.plan, c.seq, [(s.entry.name, s.lo, s.hi, s.owner) for s in c.segments])
                for c in chunks]

    sizes = [300, 10, 2500, 7, 0, 900, 1, 4000]
    plans = [Plan("ps", "onebit", 1), Plan("none"), Plan("ps", "onebit", 2),
             Plan("none", None, 3), Plan("none"), Plan("ps", "onebit", 1),
             Plan("ring", "onebit", 1), Plan("ps", "onebit", 4)]
    one, many = Chunker(world=3, chunk_elems=1000), Chunker(world=3, chunk_elems=1000)
    by_one = [c for i, n in enumerate(sizes)
              for c in one.add(_Tensor(f"t{i}", n), plans[i])] + one.flush()
    batch = [_Tensor(f"t{i}", n) for i, n in enumerate(sizes)]
    by_many = many.add_many(batch, plans) + many.flush()
    assert layout(by_many) == layout(by_one)
    assert [t.pending for t in batch] == [1, 1, 3, 1, 1, 1, 1, 4]
    # ps plans of K 1, 2 and 4 share chunks: one chunk fills at a time
    ps = [c for c in by_many if c.plan.topology == "ps"]
    assert len(ps) == 6 and all(c.numel >= 1000 for c in ps)
    assert len({id(c.plan) for c in ps}) == 1


@pytest.mark.pure
def test_new_plan_objects_share_a_chunk_and_do_not_grow_the_chunker():
    """A planner may build a new plan per call: equal plans still fill one chunk, and the
    chunker keeps a bounded number of them."""
    chunker = Chunker(world=2, chunk_elems=1 << 30)
    count = 3 * _ROUTES
    for i in range(count):
        chunker.add(_Tensor(f"t{i}", 10), Plan("ps", "onebit", 1 + i % 2))
    assert len(chunker._routes) <= _ROUTES
    assert [c.numel for c in chunker.flush()] == [10 * count]


@pytest.mark.pure
def test_large_tensors_are_cut_into_pieces_that_span_chunks():
    chunker = Chunker(world=2, chunk_elems=1000)
    t = _Tensor("big", 3500)
    closed = chunker.add(t, Plan("ps", "onebit", 2))
    closed += chunker.flush()
    assert t.pending == 4 and [c.numel for c in closed] == [1750, 1750]
    pieces = [(s.lo, s.hi) for c in closed for s in c.segments]
    assert pieces == [(0, 875), (875, 1750), (1750, 2625), (2625, 3500)]


@pytest.mark.pure
def test_ring_runs_follow_owners_not_the_chunk():
    """A segment's run (and so its hops, payloads and residual sites) depends on its
    owner alone: the same tensors split into chunks differently (DDP's buckets before and
    after it rebuilds them) give the same runs."""
    def runs(flush_after: set[int]) -> dict[tuple[str, int, int], int]:
        chunker = Chunker(world=4)
        chunks = []
        for i, n in enumerate([300_000, 10, 70_000, 5, 0, 200_000]):
            chunks += chunker.add(Entry(f"t{i}", None, np.zeros(n, np.float32)),
                                  Plan("ring", "onebit", 1))
            if i in flush_after:
                chunks += chunker.flush()
        chunks += chunker.flush()
        return {s.key: c for chunk in chunks for c, run in enumerate(chunk.runs(4))
                for s in run}

    one, many = runs(set()), runs({0, 2, 3})
    assert one == many
    # large tensors are cut into a piece per run
    assert sorted(c for (name, _, _), c in one.items() if name == "t0") == [0, 1, 2, 3]


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["dgc", "topk", "randomk", "threshold", "graddrop"])
@pytest.mark.parametrize("scale", [1.0, -1.0, 0.25, -0.5])
def test_sparse_decodes_into_special_accumulators_match_the_reference(name, scale):
    """Adding a sparse payload touches only its elements, plus what the formula does to
    the others (-0 + 0 is +0; feedback zeroes Inf and NaN): the same bits as the
    reference's dense sum."""
    cpu = hipress.codec(name, target="cpu", seed=2)
    ref = hipress.codec(name, target="ref", seed=2)
    n = 50_000
    x = gradient(n, seed=3)
    payload = ref.encode(x, step=1)
    acc = gradient(n, seed=4)
    acc[::7] = -0.0
    acc[1::97] = np.inf
    acc[2::89] = np.nan
    acc[3::113] = -np.inf
    for feedback in (False, True):
        got = cpu.decode(payload, n, out=acc.copy(), accumulate=True, scale=scale,
                         feedback=feedback)
        want = ref.decode(payload, n, out=acc.copy(), accumulate=True, scale=scale,
                          feedback=feedback)
        assert same_values(got, want), (feedback, scale)
        if feedback:  # no NaN is left: every bit agrees
            assert got.tobytes() == want.tobytes()
    # and overwriting: scale * 0 (a -0 for a negative scale) where nothing is scattered
    assert cpu.decode(payload, n, scale=scale).tobytes() == \
        ref.decode(payload, n, scale=scale).tobytes()


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["onebit", "cgx"])
def test_a_batch_of_other_dtypes_and_strides_encodes_as_their_float32_copies(name):
    """float64 and strided segments are converted once and held until the kernels have
    read them (the rows carry only addresses)."""
    c = hipress.codec(name, target="cpu", seed=3)
    base = [gradient(n, seed=i) for i, n in enumerate([5000, 70_001, 3])]
    inputs = [base[0].astype(np.float64), np.repeat(base[1], 2)[::2], base[2]]
    want, want_sizes = c.encode_batch(base, steps=[1, 2, 3])
    got, sizes = c.encode_batch(inputs, steps=[1, 2, 3])
    assert sizes == want_sizes and got.tobytes() == want.tobytes()
