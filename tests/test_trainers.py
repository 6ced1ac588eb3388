"""HiPress inside the trainers people use, each with its one added line: Accelerate
(``hipress.torch.accelerate.compress``), Lightning (the ``HiPress`` callback) and
Trainer (``hipress.torch.transformers.compress``). Two CPU
ranks each: identical replicas, fewer bytes than DDP's float32, a bit-identical resume
from the framework's own checkpoint (loaded as the framework loads it), and a dead rank
as ``SyncError`` through the framework. Skipped where the framework is not installed."""

from __future__ import annotations

from pathlib import Path

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
