"""HiPress inside the trainers people use, each with its one added line: Accelerate
(``hipress.torch.accelerate.compress``), Lightning (the ``HiPress`` callback) and
Trainer (``hipress.torch.transformers.compress``). Two CPU
ranks each: identical replicas, fewer bytes than DDP's float32, a bit-identical resume
from the framework's own checkpoint (loaded as the framework loads it), and a dead rank
as ``SyncError`` through the framework. Skipped where the framework is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ranks

HERE = Path(__file__).parent
SCRIPT = HERE / "trainer_ranks.py"


def _launch(scenario: str, out: Path, args: dict) -> list[dict]:
    return ranks.launch(2, scenario, out, args, script=SCRIPT, timeout=300)


@pytest.mark.parallel
@pytest.mark.parametrize("scenario,module", [("accelerate", "accelerate"),
                                             ("lightning", "lightning.pytorch"),
                                             ("trainer", "transformers")])
def test_the_trainer_resumes_from_its_own_checkpoint_bit_for_bit(tmp_path, scenario,
                                                                 module):
    pytest.importorskip(module)
    args = {"options": {"algorithm": "onebit"}}

    def run(name: str, **more) -> list[dict]:
        results = _launch(scenario, tmp_path / name, {**args, **more})
        for r in results:
            assert r["rc"] == 0 and r["error"] is None, r["log"][-3000:]
        return results

    straight = run("straight", start=0, steps=12, save=str(tmp_path / "ckpt"), save_at=6)
    second = run("second", start=6, steps=6, load=str(tmp_path / "ckpt"))
    a = [r["arrays"]["params"] for r in straight]
    assert a[0].tobytes() == a[1].tobytes()  # replicas identical
    for r, b in zip(straight, second, strict=True):
        assert r["arrays"]["params"].tobytes() == b["arrays"]["params"].tobytes()
    # onebit after the guard's 2 float32 steps: well under DDP's float32 every step
    ddp = straight[0]["params"] * 4 * 12
    assert 0 < straight[0]["sent"] < ddp / 3, (straight[0]["sent"], ddp)


@pytest.mark.parallel
@pytest.mark.parametrize("scenario,module", [("accelerate", "accelerate"),
                                             ("lightning", "lightning.pytorch"),
                                             ("trainer", "transformers")])
def test_a_dead_rank_is_a_sync_error_through_the_trainer(tmp_path, scenario, module):
    pytest.importorskip(module)
    results = _launch(scenario, tmp_path, {"options": {"timeout": 10}, "start": 0,
                                           "steps": 8, "die_at": 3})
    survivor = results[0]
    assert results[1]["rc"] == 3
    assert survivor["rc"] == 0 and survivor["error"] == "SyncError", survivor["log"][-3000:]


def _by_lightning(out: Path, args: dict) -> list[dict]:
    """One ``python`` process, as a user runs a Lightning script: Lightning starts the
    other rank itself. Nothing of torchrun's environment, no thread variables."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "OMP_NUM_THREADS", "HIPRESS_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent), env.get("PYTHONPATH"))
                                        if p)
    proc = subprocess.run([sys.executable, str(SCRIPT), "lightning_fsdp", json.dumps(args),
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    files = [out / f"rank{r}.json" for r in range(2)]
    deadline = time.monotonic() + 60  # the spawned rank may finish after rank 0 (it
    # writes its arrays before its JSON)
    while not all(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.returncode == 0 and all(f.exists() for f in files), \
        (proc.stdout + proc.stderr)[-3000:]
    results = []
    for r, f in enumerate(files):
        with np.load(out / f"rank{r}.npz") as z:
            results.append({**json.loads(f.read_text()), "params_": z["params"]})
    return results


@pytest.mark.parallel
def test_lightning_fsdp2_under_its_own_launcher_resumes_bit_for_bit(tmp_path):
    pytest.importorskip("lightning.pytorch")
    args = {"options": {"algorithm": "onebit", "min_compress": 1000}}
    straight = _by_lightning(tmp_path / "straight", {**args, "start": 0, "steps": 12,
                                                     "save": str(tmp_path / "ckpt"),
                                                     "save_at": 6})
    second = _by_lightning(tmp_path / "second", {**args, "start": 6, "steps": 6,
                                                 "load": str(tmp_path / "ckpt")})
    assert [r["kind"] for r in straight] == ["FSDPState"] * 2
    a = [r["params_"] for r in straight]
    assert a[0].tobytes() == a[1].tobytes()  # the full parameters agree on both ranks
    for r, b in zip(straight, second, strict=True):
        assert r["params_"].tobytes() == b["params_"].tobytes()
    # reduce-scatter of float32 gradients: each rank sends about half of them a step
    fp32 = straight[0]["params"] * 4 / 2 * 12
    assert 0 < straight[0]["sent"] < fp32 / 3, (straight[0]["sent"], fp32)
