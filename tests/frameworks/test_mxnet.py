"""hipress.mxnet on 2 ranks (runs in .venv-mx: `make test-mx`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mxnet")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the rank launcher
from ranks import launch, resumed_bit_for_bit  # noqa: E402

SCENARIOS = Path(__file__).resolve().parent / "scenarios.py"


def _run(tmp_path: Path, **args: object) -> list[dict]:
    return launch(2, "mx_train", tmp_path, dict(args), timeout=300,
                  env={"HIPRESS_TIMEOUT": "20"}, script=SCENARIOS)


@pytest.mark.parametrize("mode", ["kvstore", "trainer"])
@pytest.mark.parametrize("algo", ["onebit", "dgc", "none"])
def test_replicas_identical_and_loss_decreases(tmp_path, algo, mode):
    results = _run(tmp_path, algo=algo, mode=mode)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    assert results[0]["digest"] == results[1]["digest"], "replicas differ"
    losses = results[0]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    if algo == "none":
        assert results[0]["grad_error"] < 1e-6 and results[1]["grad_error"] < 1e-6


FAULT_TIMEOUT = 5.0


@pytest.mark.parametrize("fault", ["die", "stall"])
@pytest.mark.parametrize("mode", ["kvstore", "trainer"])
def test_a_dead_or_stalled_rank_is_a_sync_error_and_a_clean_exit(tmp_path, mode, fault):
    start = time.monotonic()
    results = launch(2, "mx_train", tmp_path,
                     {"algo": "onebit", "mode": mode, "kill_rank": 1, "kill_step": 5,
                      "stall": fault == "stall", "exit_code": 7}, timeout=300,
                     env={"HIPRESS_TIMEOUT": str(FAULT_TIMEOUT)}, script=SCENARIOS)
    survivor = results[0]
    assert survivor["rc"] == 7, survivor["log"][-3000:]
    assert survivor["type"] == "SyncError" and "rank 1" in survivor["sync_error"], survivor
    assert survivor["after"] <= FAULT_TIMEOUT + 10, survivor
    assert results[1]["rc"] == (3 if fault == "die" else 7), results[1]["log"][-3000:]
    assert time.monotonic() - start < 120


def test_kvstore_is_registered_and_keeps_the_optimizer_local():
    import mxnet as mx

    import hipress.mxnet as hp

    kv = mx.kv.create("hipress")
    assert isinstance(kv, hp.KVStore) and kv.type == "hipress"
    assert kv.is_capable("optimizer") is False
    assert kv.num_workers == 1 and kv.rank == 0
    with pytest.raises(ValueError, match="unknown algorithm"):
        hp.KVStore(algorithm="zip")


def test_wrappers_reject_bad_options():
    import mxnet as mx

    import hipress.mxnet as hp
    from hipress import ConfigError

    params = mx.gluon.nn.Dense(2, in_units=3).collect_params()
    cases = [({"algorithm": "zip"}, "unknown algorithm"), ({"topology": "star"}, "topology"),
             ({"algorithm": "dgc", "ratio": 2}, "ratio must be"),
             ({"algorithm": "cgx", "bits": 9}, "bits must be 1 to 8"),
             ({"min_compress": -1}, "min_compress"), ({"timeout": 0}, "timeout")]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=message):
            hp.KVStore(**settings)
        with pytest.raises(ConfigError, match=message):
            hp.DistributedTrainer(params, "sgd", {"learning_rate": 0.1}, **settings)


@pytest.mark.parametrize("algo", ["dgc", "topk", "terngrad"])
def test_the_amp_loss_scaler_skips_an_overflow_on_every_rank(tmp_path, algo):
    """MXNet's AMP checks the gradients after the trainer's allreduce: an inf loss on rank
    1 halves the scale on both ranks in the same step, through hp.KVStore and
    hp.DistributedTrainer; the parameters stay identical and finite."""
    results = launch(2, "mx_amp", tmp_path, {"modes": ["kvstore", "trainer"], "steps": 5,
                                             "overflow": 2, "algo": algo},
                     timeout=300, env={"HIPRESS_TIMEOUT": "30"}, script=SCENARIOS)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    want = [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]
    for mode in ("kvstore", "trainer"):
        assert [r[mode]["scales"] for r in results] == [want, want], mode
        assert results[0][mode]["digest"] == results[1][mode]["digest"], mode
        assert results[0][mode]["finite"], mode


@pytest.mark.parametrize("ending", ["destroy", "neither", "shutdown", "reversed"])
def test_a_script_exits_0_whatever_it_calls_last(tmp_path, ending):
    results = launch(2, "mx", tmp_path, {"ending": ending},
                     script=SCENARIOS.parent.parent / "exits.py", timeout=300,
                     env={"HIPRESS_THREADS": "2", "OMP_NUM_THREADS": "2"})
    for r in results:
        assert r["rc"] == 0 and r.get("trained"), r["log"][-3000:]


def test_example_runs_under_the_launcher(tmp_path):
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "hipress.cli", "run", "-np", "2",
                           str(root / "examples" / "mxnet_train.py"), "--steps", "5",
                           "--metrics", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["replicas_identical"]


@pytest.mark.parametrize("algo", ["onebit", "terngrad"])
@pytest.mark.parametrize("mode", ["kvstore", "trainer"])
def test_a_resumed_job_continues_bit_for_bit(tmp_path, mode, algo):
    """12 steps straight with a checkpoint (weights and HiPress's state) after the 6th,
    and fresh processes that resume from it for 6 more: the same weights to the bit on
    every rank."""
    resumed_bit_for_bit("mx_checkpoint", tmp_path, {"algo": algo, "mode": mode}, script=SCENARIOS)


def test_the_kernels_follow_mxnets_openmp_threads():
    """hipress.mxnet makes the kernels follow MXNet's OpenMP setting (which it reads
    from the environment at start-up), capped by the cores' share."""
    import json
    import os
    import subprocess

    code = ("import json, hipress, hipress.mxnet\n"
            "t = hipress.threads()\n"
            "print(json.dumps([t.source, t.count, t.cap]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HIPRESS_THREADS", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE",
                        "OMPI_COMM_WORLD_LOCAL_SIZE", "OMP_NUM_THREADS",
                        "MXNET_OMP_MAX_THREADS")}
    results = []
    for extra in ({}, {"OMP_NUM_THREADS": "1"}):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, **extra}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.splitlines()[-1]))
    (unset_source, unset, cap), (set_source, one, _) = results
    assert unset_source == "cores" and unset == cap
    assert set_source.startswith("MXNet's OMP_NUM_THREADS") and one == 1
