"""Sharded training: FSDP2's gradient reduce-scatter through ``hp.compress_fsdp`` and
CaSync's ``scatter`` topology, on 2 and 3 CPU ranks (3: FSDP pads every shard)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ranks
from fsdp_ranks import SCATTER_N

pytestmark = pytest.mark.parallel

SCRIPT = Path(__file__).resolve().parent / "fsdp_ranks.py"


def _run(world: int, scenario: str, out: Path, args: dict) -> list[dict]:
    return ranks.launch_ok(world, scenario, out, args, SCRIPT)


@pytest.mark.parametrize("world", [2, 3])
def test_algorithm_none_equals_plain_fsdp2_bit_for_bit(tmp_path, world):
    plain = _run(world, "train", tmp_path / "plain", {"algorithm": "plain", "steps": 5})
    none = _run(world, "train", tmp_path / "none", {"algorithm": "none", "steps": 5})
    for a, b in zip(plain, none, strict=True):
        assert a["arrays"]["params"].tobytes() == b["arrays"]["params"].tobytes()
        assert b["modules"] == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert b["sent"] == 0  # nothing went through the engine


@pytest.mark.parametrize("world,algorithm,params", [(2, "cgx", {"bits": 4}),
                                                    (3, "cgx", {"bits": 4}),
                                                    (2, "zeropp", {})])
def test_compressed_reduce_scatter_keeps_replicas_equal_and_learns(tmp_path, world, algorithm,
                                                                   params):
    steps = 20
    plain = _run(world, "train", tmp_path / "plain", {"algorithm": "plain", "steps": steps})
    ours = _run(world, "train", tmp_path / algorithm,
                {"algorithm": algorithm, "params": params, "steps": steps})
    full = [r["arrays"]["full"] for r in ours]
    assert all(f.tobytes() == full[0].tobytes() for f in full)  # every rank's full model
    losses, base = ours[0]["losses"], plain[0]["losses"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert abs(losses[-1] - base[-1]) <= 0.05 * base[-1], (losses[-1], base[-1])
    assert ours[0]["steps"] == steps and ours[0]["sent"] > 0
    # compressed: less than a fifth of what the float32 shards would take
    n = full[0].size
    assert ours[0]["sent"] < 0.2 * 4 * n * (world - 1) / world * steps


def test_the_first_steps_are_fsdp2s_own_reduce_scatter_unless_the_guard_is_off(tmp_path):
    """casync.guard's warm-up: compress_fsdp's first WARMUP_STEPS steps give plain FSDP2's
    bits and send nothing through HiPress; with guard=False the first step compresses."""
    from casync.guard import WARMUP_STEPS

    args = {"steps": WARMUP_STEPS}
    plain = _run(2, "train", tmp_path / "plain", {**args, "algorithm": "plain"})
    warm = _run(2, "train", tmp_path / "warm", {**args, "algorithm": "cgx"})
    cold = _run(2, "train", tmp_path / "cold", {**args, "algorithm": "cgx",
                                                "params": {"guard": False}})
    for a, b, c in zip(plain, warm, cold, strict=True):
        assert a["arrays"]["params"].tobytes() == b["arrays"]["params"].tobytes()
        assert b["sent"] == 0 and b["steps"] == WARMUP_STEPS
        assert c["sent"] > 0 and a["arrays"]["params"].tobytes() != \
            c["arrays"]["params"].tobytes()


def test_an_int8_all_gather_gives_every_rank_the_same_quantized_weights(tmp_path):
    steps = 20
    plain = _run(2, "train", tmp_path / "plain", {"algorithm": "plain", "steps": steps})
    ours = _run(2, "train", tmp_path / "int8", {"algorithm": "cgx", "params": {"bits": 4},
                                                 "all_gather": "int8", "steps": steps})
    assert ours[0]["arrays"]["full"].tobytes() == ours[1]["arrays"]["full"].tobytes()
    losses, base = ours[0]["losses"], plain[0]["losses"]
    # step 0: the same exact shards, but forward saw them quantized
    assert losses[0] != base[0] and abs(losses[0] - base[0]) <= 0.01 * base[0]
    assert abs(losses[-1] - base[-1]) <= 0.05 * base[-1], (losses[-1], base[-1])
    # a byte per weight and a scale per 512: about a quarter of float32's
    n = ours[0]["arrays"]["params"].size  # this rank's shard
    assert 0 < ours[0]["gathered"] <= 0.3 * 4 * n * 2 * steps


def test_hsdp_on_a_2x2_mesh_equals_fsdp2s_own_and_compresses_across_nodes(tmp_path):
    """4 ranks, 2 a node: ``"none"`` equals FSDP2's own HSDP bit for bit; cgx keeps every
    rank's model identical, learns as HSDP does, and compresses only the replica
    all-reduce (the reduce-scatter inside a node stays FSDP's own) after the guard's
    uncompressed warm-up steps."""
    from casync.guard import WARMUP_STEPS

    steps = 12
    plain = _run(4, "train", tmp_path / "plain", {"algorithm": "plain", "hsdp": True,
                                                   "steps": steps})
    none = _run(4, "train", tmp_path / "none", {"algorithm": "none", "hsdp": True,
                                                 "steps": steps})
    for a, b in zip(plain, none, strict=True):
        assert a["arrays"]["params"].tobytes() == b["arrays"]["params"].tobytes()
    ours = _run(4, "train", tmp_path / "cgx", {"algorithm": "cgx", "hsdp": True,
                                                "params": {"bits": 4}, "steps": steps})
    full = [r["arrays"]["full"] for r in ours]
    assert all(f.tobytes() == full[0].tobytes() for f in full)
    assert abs(ours[0]["losses"][-1] - plain[0]["losses"][-1]) <= 0.05 * plain[0]["losses"][-1]
    shard = ours[0]["arrays"]["params"].size  # this rank's shard: what it all-reduces
    warm = WARMUP_STEPS * 4 * shard  # float32, each element once to the other replica
    assert warm < ours[0]["sent"] < warm + 0.2 * 4 * shard * (steps - WARMUP_STEPS)


def test_checkpoint_round_trip_resumes_bit_for_bit(tmp_path):
    straight = ranks.resumed_bit_for_bit("train", tmp_path,
                                         {"algorithm": "cgx", "params": {"bits": 4}},
                                         script=SCRIPT)
    assert straight[0]["steps"] == 12


def test_a_dead_rank_is_a_sync_error_within_the_timeout(tmp_path):
    results = ranks.launch(3, "fault", tmp_path, {"algorithm": "cgx", "timeout": 10},
                           script=SCRIPT)
    assert results[1]["rc"] == 3
    for r in (results[0], results[2]):
        assert r["rc"] == 0, r["log"][-3000:]
        assert r["error"] == "SyncError" and r["module"] == "hipress.errors", r
        assert r["seconds"] < 30, r


def test_a_nan_on_one_rank_reaches_the_owners_shard_and_clears(tmp_path):
    for algorithm in ("cgx", "plain"):
        results = _run(2, "nonfinite", tmp_path / algorithm, {"algorithm": algorithm})
        for r in results:
            assert r["nonfinite"] == [False, True, False], (algorithm, r)


@pytest.mark.parametrize("changed,field", [({"params": {"bits": 2}}, "bits"),
                                           ({"all_gather": "int8"}, "all_gather")])
def test_ranks_that_disagree_fail_naming_the_setting(tmp_path, changed, field):
    results = _run(2, "mismatch", tmp_path,
                   {"algorithm": "cgx", "params": {"bits": 4}, "changed": changed})
    for r in results:
        assert r["error"] == "ConfigError" and field in r["message"], r


@pytest.mark.parametrize("world", [2, 3])
def test_the_scatter_topology_leaves_each_shards_mean_on_its_owner(tmp_path, world):
    """CaSync alone: rank j ends with the mean of every rank's shard j, each sender's part
    as its payloads decode (one per piece of the shard), its own exact; its copy of the
    other shards untouched; one message per peer per chunk."""
    import hipress
    from casync.primitives import partition

    chunk_elems = 16384
    results = _run(world, "scatter", tmp_path, {"algorithm": "cgx", "steps": 2,
                                                 "error_feedback": False,
                                                 "chunk_elems": chunk_elems})
    shard = SCATTER_N // world
    pieces = partition(shard, -(-shard // chunk_elems))
    codec = hipress.codec("cgx", target="ref")
    for step in range(2):
        xs = [ranks.data(r, 0, SCATTER_N, step) for r in range(world)]
        for rank, r in enumerate(results):
            got = r["arrays"][f"out{step}"]
            own = xs[rank][rank * shard:(rank + 1) * shard]
            total = own.astype(np.float64)
            for src in range(world):
                if src != rank:
                    theirs = xs[src][rank * shard:(rank + 1) * shard]
                    total += np.concatenate([codec.decode(codec.encode(theirs[sl]),
                                                          sl.stop - sl.start)
                                             for sl in pieces])
            want = (total / world).astype(np.float32)
            mine = got[rank * shard:(rank + 1) * shard]
            np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-6)
            others = np.ones(SCATTER_N, bool)
            others[rank * shard:(rank + 1) * shard] = False
            assert got[others].tobytes() == xs[rank][others].tobytes()
    for r in results:  # per step, one message per owner for each of its shard's chunks
        assert r["messages"] <= 2 * (world - 1) * len(pieces), r["messages"]


@pytest.mark.parametrize("link", ["staged", "nccl"])
def test_the_scatter_topology_on_the_device_path_gives_the_host_paths_bits(tmp_path, link):
    """CUDA tensors' path (CPU tensors standing in, the CUDA kernels emulated), with error
    feedback over 3 steps: the same bits as host memory and the CPU kernels."""
    args = {"algorithm": "cgx", "steps": 3}
    host = _run(2, "scatter", tmp_path / "host", args)
    device = _run(2, "scatter", tmp_path / link, {**args, "device": link,
                                                   "target": "cuda-emu"})
    for h, d in zip(host, device, strict=True):
        for key in h["arrays"]:
            assert h["arrays"][key].tobytes() == d["arrays"][key].tobytes(), (link, key)


def test_compress_fsdp_refuses_a_model_without_fsdp_modules():
    torch = pytest.importorskip("torch")

    import hipress.torch as hp
    from hipress import ConfigError

    with pytest.raises(ConfigError, match="fully_shard"):
        hp.compress_fsdp(torch.nn.Linear(4, 4), algorithm="cgx")


def test_an_all_gather_codec_must_have_a_fixed_payload_size():
    pytest.importorskip("torch")

    import hipress.torch as hp
    from hipress import ConfigError

    assert hp.FSDPState(all_gather="int8").gather_codec.name == "zeropp"
    assert hp.FSDPState(all_gather="cgx").gather_codec.name == "cgx"
    with pytest.raises(ConfigError, match="depends on the values"):
        hp.FSDPState(all_gather="dgc")
    with pytest.raises(ConfigError, match="unknown algorithm"):
        hp.FSDPState(all_gather="int9")
