"""hipress.tensorflow on 2 ranks (runs in .venv-tf: `make test-tf`)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the rank launcher
from ranks import launch, resumed_bit_for_bit  # noqa: E402

SCENARIOS = Path(__file__).resolve().parent / "scenarios.py"


def _run(tmp_path: Path, **args: object) -> list[dict]:
    results = launch(2, "tf_train", tmp_path, dict(args), timeout=300,
                     env={"HIPRESS_TIMEOUT": "20"}, script=SCENARIOS)
    return results


@pytest.mark.parametrize("algo", ["onebit", "dgc", "none"])
def test_replicas_identical_and_loss_decreases(tmp_path, algo):
    modes = ["eager", "graph", "keras"]
    results = _run(tmp_path, algo=algo, modes=modes)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    for mode in modes:
        first, second = results[0][mode], results[1][mode]
        assert first["digest"] == second["digest"], f"{mode}: replicas differ"
        losses = first["losses"]
        assert losses[-1] < losses[0], (mode, losses)
        if algo == "none" and mode != "keras":
            assert first["grad_error"] < 1e-6 and second["grad_error"] < 1e-6, mode


FAULT_TIMEOUT = 5.0


@pytest.mark.parametrize("mode,fault", [("eager", "die"), ("graph", "die"), ("keras", "die"),
                                        ("keras", "stall")])
def test_a_dead_or_stalled_rank_is_a_sync_error_and_a_clean_exit(tmp_path, mode, fault):
    """Eagerly the SyncError comes as it is; inside tf.function and model.fit, through
    ``hp.sync_errors()``. Then the survivor shuts down and exits with its own code. A
    stall reaches the same error by the engine's timeout instead of a closed connection
    (tests/test_casync.py): one mode, fit's (inside a tf.function too), covers its way
    out of TensorFlow."""
    start = time.monotonic()
    results = launch(2, "tf_train", tmp_path,
                     {"algo": "onebit", "modes": [mode], "kill_rank": 1, "kill_step": 5,
                      "stall": fault == "stall", "exit_code": 7}, timeout=300,
                     env={"HIPRESS_TIMEOUT": str(FAULT_TIMEOUT)}, script=SCENARIOS)
    survivor = results[0]
    assert survivor["rc"] == 7, survivor["log"][-3000:]
    assert survivor["type"] == "SyncError" and "rank 1" in survivor["sync_error"], survivor
    assert survivor["after"] <= FAULT_TIMEOUT + 10, survivor
    assert results[1]["rc"] == (3 if fault == "die" else 7), results[1]["log"][-3000:]
    assert time.monotonic() - start < 120


def test_wrappers_reject_bad_options():
    import keras
    import tensorflow as tf

    import hipress.tensorflow as hp
    from hipress import ConfigError

    cases = [({"algorithm": "zip"}, "unknown algorithm"), ({"topology": "star"}, "topology"),
             ({"algorithm": "dgc", "ratio": 0}, "ratio must be in (0, 1]"),
             ({"algorithm": "dgc", "ratoi": 0.1}, "did you mean 'ratio'"),
             ({"plan": "dynamic"}, "plan must be"), ({"timeout": -5}, "timeout")]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            hp.DistributedGradientTape(tf.GradientTape(), **settings)
        with pytest.raises(ConfigError, match=re.escape(message)):
            hp.DistributedOptimizer(keras.optimizers.SGD(0.1), **settings)


@pytest.mark.parametrize("algo", ["dgc", "topk", "terngrad"])
def test_the_loss_scaler_skips_an_overflow_on_every_rank(tmp_path, algo):
    """Keras's LossScaleOptimizer over averaged gradients, with a tape and under model.fit
    with the mixed_float16 policy: an inf loss on rank 1 halves the scale on both ranks
    in the same step, and the weights stay identical and finite."""
    results = launch(2, "tf_amp", tmp_path,
                     {"modes": ["tape", "keras"], "steps": 5, "overflow": 2, "algo": algo},
                     timeout=300, env={"HIPRESS_TIMEOUT": "30"}, script=SCENARIOS)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    for mode, start in (("tape", 1024.0), ("keras", 32768.0)):
        want = [start, start, start / 2, start / 2, start / 2]
        assert [r[mode]["scales"] for r in results] == [want, want], mode
        assert results[0][mode]["digest"] == results[1][mode]["digest"], mode
        assert results[0][mode]["finite"], mode


@pytest.mark.parametrize("ending", ["destroy", "neither", "shutdown", "reversed"])
def test_a_script_exits_0_whatever_it_calls_last(tmp_path, ending):
    results = launch(2, "tf", tmp_path, {"ending": ending},
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
    # the issue's form: `hipress run -np 2 python examples/tf_train.py`
    proc = subprocess.run([sys.executable, "-m", "hipress.cli", "run", "-np", "2", "python",
                           str(root / "examples" / "tf_train.py"), "--steps", "5",
                           "--metrics", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["replicas_identical"]


@pytest.mark.parametrize("algo", ["onebit", "terngrad"])
@pytest.mark.parametrize("mode", ["tape", "keras"])
def test_a_resumed_job_continues_bit_for_bit(tmp_path, mode, algo):
    """12 steps straight with a checkpoint (weights and HiPress's state) after the 6th,
    and fresh processes that resume from it for 6 more: the same weights to the bit on
    every rank."""
    resumed_bit_for_bit("tf_checkpoint", tmp_path, {"algo": algo, "mode": mode}, script=SCENARIOS)


def test_the_kernels_follow_tensorflows_intra_op_threads():
    """hipress.tensorflow makes the kernels follow TensorFlow's setting (a fresh process:
    TensorFlow takes it only before its runtime starts), capped by the cores' share."""
    import json
    import os
    import subprocess

    code = ("import json, tensorflow as tf, hipress, hipress.tensorflow\n"
            "before = hipress.threads()\n"
            "tf.config.threading.set_intra_op_parallelism_threads(1)\n"
            "after = hipress.threads()\n"
            "print(json.dumps([before.source, before.count, after.source, after.count, "
            "after.cap]))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HIPRESS_THREADS", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE",
                        "OMPI_COMM_WORLD_LOCAL_SIZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before_source, before, after_source, after, cap = json.loads(proc.stdout.splitlines()[-1])
    assert before_source == "cores" and before == cap  # TF's default 0: the cores' share
    assert after_source.startswith("tf.config.threading") and after == 1
