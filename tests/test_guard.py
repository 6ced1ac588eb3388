"""The engine's rules on top of the plan (casync.guard): the first steps uncompressed,
row-sparse gradients never compressed, decided alike on every rank."""

import numpy as np
import pytest
import ranks

import hipress
from casync.guard import SPARSE_SHARE, WARMUP_STEPS, Guard
from casync.plan import DEFAULT_ALGORITHM, Plan


@pytest.mark.pure
def test_warm_up_steps_go_uncompressed_and_reduce_scatters_keep_their_plans():
    guard = Guard(warmup=2)
    compressed, scatter, raw = Plan("ps", "cgx", 2), Plan("scatter", "cgx"), Plan("none")
    for step in (0, 1):
        plans, why = guard.adjust(step, ["a", "b", "c"], [compressed, scatter, raw])
        assert plans[0] == Plan("none", None, 2) and why[0].startswith("warm-up")
        assert plans[1] is scatter and plans[2] is raw and why[1:] == [None, None]
    plans, why = guard.adjust(2, ["a"], [compressed])
    assert plans == [compressed] and why == [None]


@pytest.mark.pure
def test_a_gradient_of_mostly_zeros_stays_uncompressed_and_the_decision_is_saved():
    guard = Guard(warmup=2)
    emb = np.zeros(1000, np.float32)
    emb[:100] = 1.0  # 90 % zeros
    dense = np.ones(1000, np.float32)
    dense[: int(1000 * SPARSE_SHARE) - 1] = 0.0  # just under the share: compressed
    once = emb.copy()
    once[:800] = 1.0  # row-sparse in one warm-up step only: compressed
    for step in range(2):
        guard.inspect("emb", emb)
        guard.inspect("dense", dense)
        guard.inspect("once", emb if step == 0 else once)
        # a layer behind a zero-initialised scale: no gradient in the first step, then
        # dense; no evidence, then dense: compressed
        guard.inspect("late", np.zeros(1000, np.float32) if step == 0 else dense + 1)
    saved = Guard(warmup=2)
    saved.load_state_dict(guard.state_dict())  # counted, not yet decided
    names = ["emb", "dense", "once", "late"]
    plans, why = guard.adjust(2, names, [Plan("ps", "cgx")] * 4)
    assert set(guard.sparse) == {"emb"} and guard.sparse["emb"] == pytest.approx(0.9)
    assert plans[0].topology == "none"
    assert why[0] == "row-sparse (at least 90% zeros in the warm-up)"
    assert all(p.compress for p in plans[1:]) and why[1:] == [None, None, None]
    assert saved.adjust(2, names, [Plan("ps", "cgx")] * 4) == (plans, why)
    loaded = Guard(warmup=2)
    loaded.load_state_dict(guard.state_dict())
    assert loaded.sparse == guard.sparse
    torch = pytest.importorskip("torch")
    counted = Guard(warmup=1)
    counted.inspect("emb", torch.from_numpy(emb))  # a tensor is counted where it lives
    counted.adjust(1, [], [])
    assert counted.sparse == {"emb": pytest.approx(0.9)}


@pytest.mark.pure
def test_wrappers_default_to_hipress_algorithm_then_the_default_with_the_guard(monkeypatch):
    from hipress.distributed import EngineOptions

    monkeypatch.delenv("HIPRESS_ALGORITHM", raising=False)
    options = EngineOptions()
    assert options.algorithm == DEFAULT_ALGORITHM and options.settings.guard
    monkeypatch.setenv("HIPRESS_ALGORITHM", "dgc")
    assert EngineOptions().settings.algorithm == "dgc"
    assert EngineOptions("onebit", guard=False).settings == EngineOptions(
        "onebit", guard=False).settings
    assert not EngineOptions("onebit", guard=False).settings.guard
    with pytest.raises(hipress.ConfigError, match="guard must be True or False"):
        EngineOptions(guard="yes")


@pytest.mark.parallel
@pytest.mark.parametrize("algo,topology", [("cgx", "ps"), ("onebit", "ring"),
                                           (DEFAULT_ALGORITHM, "allgather")])
def test_an_embedding_stays_exact_while_dense_layers_are_compressed(tmp_path, algo, topology):
    steps = WARMUP_STEPS + 3
    results = ranks.launch(2, "guarded", tmp_path, {"algo": algo, "topology": topology,
                                                    "steps": steps})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    first, second = (r["arrays"] for r in results)
    for key in first:  # every rank ends each step with the same bits
        assert first[key].tobytes() == second[key].tobytes(), key
    for step in range(steps):
        (e0, d0), (e1, d1) = ranks.guard_data(0, step), ranks.guard_data(1, step)
        emb_mean, dense_mean = (e0 + e1) * np.float32(0.5), (d0 + d1) * np.float32(0.5)
        # the embedding is averaged exactly at every step: untouched rows stay exactly 0
        np.testing.assert_allclose(first[f"emb{step}"], emb_mean, rtol=1e-6, atol=0)
        assert np.array_equal(first[f"emb{step}"] == 0, emb_mean == 0)
        if step < WARMUP_STEPS:  # warm-up: the dense layer too
            np.testing.assert_allclose(first[f"dense{step}"], dense_mean, rtol=1e-6, atol=0)
        else:  # then it is compressed (its average is no longer exact)
            assert not np.allclose(first[f"dense{step}"], dense_mean, rtol=1e-4, atol=0)
    for r in results:
        assert set(r["guard"]["sparse"]) == {"emb"}, r["guard"]
