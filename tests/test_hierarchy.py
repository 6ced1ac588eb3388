"""The hierarchical topology (``casync.hierarchy``): uncompressed inside a node,
compressed across nodes, on CPU ranks standing in for nodes of ``LOCAL_WORLD_SIZE``."""

from __future__ import annotations

import numpy as np
import pytest
import ranks

from casync.hierarchy import Layout
from hipress.errors import ConfigError


def _nodes(per_node: int) -> dict[str, str]:
    return {"LOCAL_WORLD_SIZE": str(per_node)}


def _ok(results: list[dict]) -> None:
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]


def test_a_layout_numbers_ranks_node_by_node(monkeypatch):
    assert Layout.of(5, 6, 2) == Layout(nodes=3, local_size=2, node=2, local_rank=1)
    assert Layout(3, 2, 0, 0).cross_ranks(1) == [1, 3, 5]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Layout.of(6, 8).node == 1
    monkeypatch.setenv("GROUP_RANK", "0")
    with pytest.raises(ConfigError, match="numbered node by node"):
        Layout.of(6, 8)
    with pytest.raises(ConfigError, match="divisor"):
        Layout.of(0, 6, 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ConfigError, match="ranks_per_node"):
        Layout.of(0, 4)


@pytest.mark.parametrize("bad,field", [({"across": "star"}, "across"),
                                       ({"intra_dtype": "int8"}, "intra_dtype"),
                                       ({"pack_elems": 0}, "pack_elems"),
                                       ({"levels": "flat"}, "levels"),
                                       ({"timeout": -1}, "timeout")])
def test_bad_settings_fail_construction_naming_them(bad, field):
    from casync import engine

    with pytest.raises(ConfigError, match=field):
        engine("onebit", "hierarchical", ranks_per_node=2, **bad)


@pytest.mark.parallel
@pytest.mark.parametrize("world,per_node,dtype", [(4, 2, "float32"), (6, 2, "float32"),
                                                  (4, 2, "bfloat16")])
def test_uncompressed_hierarchy_is_the_allreduce_on_every_rank_alike(tmp_path, world,
                                                                     per_node, dtype):
    results = ranks.launch(world, "hierarchical", tmp_path,
                           {"algo": "none", "steps": 2, "reference": True,
                            "intra_dtype": dtype}, env=_nodes(per_node))
    _ok(results)
    first = results[0]["arrays"]["results"]
    for r in results:  # bitwise the same on every rank
        assert r["arrays"]["results"].tobytes() == first.tobytes()
        assert r["layout"]["nodes"] == world // per_node and r["step"] == 2
    ref, wide = results[0]["arrays"]["references"], results[0]["arrays"]["float32"]
    # float rounding of another summation order (an ulp more where the tensor is 16-bit),
    # or of one rounding to bfloat16 on the way
    tol = 2e-6 if dtype == "float32" else 2e-2
    scale = np.abs(ref).max()
    assert np.allclose(first[wide], ref[wide], rtol=tol, atol=tol * scale), \
        np.abs(first - ref)[wide].max()
    assert np.allclose(first[~wide], ref[~wide], rtol=max(tol, 1e-2), atol=tol * scale)


@pytest.mark.parallel
@pytest.mark.parametrize("world,across", [(4, "ps"), (6, "ring")])
def test_compressed_hierarchy_keeps_replicas_identical_with_error_feedback(tmp_path, world,
                                                                           across):
    results = ranks.launch(world, "hierarchical", tmp_path,
                           {"algo": "onebit", "steps": 20, "across": across},
                           env=_nodes(2))
    _ok(results)
    first = results[0]["arrays"]["results"]
    assert np.isfinite(first).all()
    for r in results:
        assert r["arrays"]["results"].tobytes() == first.tobytes()


@pytest.mark.parallel
@pytest.mark.parametrize("victim", [1, 3])
def test_a_dead_rank_in_either_level_is_a_sync_error_on_every_survivor(tmp_path, victim):
    # rank 1 shares node 0 with rank 0 (intra level); rank 3 is rank 1's peer across nodes
    timeout = 5.0
    results = ranks.launch(4, "fault", tmp_path,
                           {"algo": "onebit", "topology": "hierarchical", "timeout": timeout,
                            "victim": victim, "mode": "die"}, timeout=timeout + 120,
                           env=_nodes(2))
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["rc"] == 0, r["log"][-3000:]
        assert r["type"] == "SyncError", r
        assert r["after"] <= 3 * timeout + 10, r


@pytest.mark.parallel
def test_a_nan_on_one_rank_reaches_its_tensor_on_every_rank_and_clears(tmp_path):
    results = ranks.launch(4, "nonfinite", tmp_path,
                           {"victim": 3, "algos": ["onebit", "dgc", "none"],
                            "topologies": ["hierarchical"]}, env=_nodes(2))
    _ok(results)
    # step 0: tensors 0 (compressed across) and 2 (raw) held the value; step 1 is clean
    want = [[True, False, True], [False, False, False]]
    for r in results:
        assert len(r["found"]) == 9
        assert all(got == want for got in r["found"].values()), r["found"]


@pytest.mark.parallel
def test_a_ddp_job_resumes_its_hierarchical_state_bit_for_bit(tmp_path):
    ranks.resumed_bit_for_bit("torch_checkpoint", tmp_path,
                              {"algo": "onebit", "mode": "hook", "topology": "hierarchical"},
                              world=4, env=_nodes(2))


@pytest.mark.parallel
def test_auto_plan_on_nodes_profiles_both_links_and_routes_alike(tmp_path):
    cache = {"HIPRESS_CACHE_DIR": str(tmp_path / "cache")}
    results = ranks.launch(4, "auto_levels", tmp_path / "measured", {"algo": "onebit"},
                           env={**_nodes(2), **cache}, timeout=600)
    # the profile cached, each step's tensors split between the two engines by size
    split = ranks.launch(4, "auto_levels", tmp_path / "split",
                         {"algo": "onebit", "split": 10_000}, env={**_nodes(2), **cache},
                         timeout=600)
    for run in (results, split):
        _ok(run)
        first = run[0]
        assert first["engine"] == "Hierarchical" and first["gpus"] == 2 and first["intra"] > 0
        for r in run:  # one profile, one routing, the same bits
            assert (r["digest"], r["levels"]) == (first["digest"], first["levels"])
            assert r["arrays"]["results"].tobytes() == first["arrays"]["results"].tobytes()
        assert np.isfinite(first["arrays"]["results"]).all()
    assert split[0]["digest"] == results[0]["digest"]
    assert split[0]["levels"] == [n > 10_000 for n in split[0]["sizes"]]


def test_the_level_chooser_follows_the_links():
    from casync.model.costmodel import CostModel
    from casync.model.planner import LevelChooser

    big = 4 << 20
    fast_node = LevelChooser(CostModel.cluster(2, 4, 10e9, ("onebit",)), 2)
    assert fast_node.hierarchical(big)
    slow_node = LevelChooser(CostModel.cluster(2, 4, 10e9, ("onebit",), intra_Bps=0.1e9), 2)
    assert not slow_node.hierarchical(big)
    assert slow_node.predicted(big, True) > slow_node.predicted(big, False)
