"""hipress.torch: the DDP comm hook, DistributedOptimizer, the launcher and the example."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ranks
import torch
from conftest import bench_module

import hipress.torch as hp
from hipress.launcher import torchrun_command

ROOT = Path(__file__).resolve().parent.parent
ALGOS = ["onebit", "dgc", "terngrad", "fp16", "none"]

# ---------------------------------------------------------------------------------- pure


#: (settings, what the ConfigError says): each is refused where it is passed
BAD_SETTINGS = [
    ({"algorithm": "sevenbit"}, "unknown algorithm 'sevenbit'"),
    ({"algorithm": "tern"}, "did you mean 'terngrad'"),
    ({"plan": "dynamic"}, "plan must be one of static, auto"),
    ({"topology": "tree"}, "topology must be one of ps, ring, allgather"),
    ({"min_compress": -1}, "min_compress must be an integer >= 0"),
    ({"timeout": 0}, "timeout must be a positive number"),
    ({"timeout": float("nan")}, "timeout must be a positive number"),
    ({"algorithm": "dgc", "ratio": 0}, "ratio must be in (0, 1]"),
    ({"algorithm": "dgc", "ratio": 2}, "ratio must be in (0, 1]"),
    ({"algorithm": "dgc", "ratio": float("nan")}, "ratio must be in (0, 1]"),
    ({"algorithm": "dgc", "ratio": "0.1"}, "parameter ratio is f32"),
    ({"algorithm": "dgc", "ratoi": 0.1}, "did you mean 'ratio'"),
    ({"algorithm": "cgx", "bits": 0}, "bits must be 1 to 8"),
    ({"algorithm": "cgx", "bits": 9}, "bits must be 1 to 8"),
    ({"algorithm": "none", "ratio": 0.1}, "takes no parameters"),
    ({"error_feedback": "yes"}, "error_feedback must be True, False or None"),
]


@pytest.mark.parametrize("settings,message", BAD_SETTINGS)
def test_every_wrapper_refuses_a_bad_setting_at_construction(settings, message):
    from casync import engine
    from hipress import ConfigError

    model = torch.nn.Linear(4, 2)
    makers = [lambda: hp.HookState(**settings),
              lambda: hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              named_parameters=model.named_parameters(),
                                              **settings),
              lambda: engine(**settings)]
    for make in makers:
        with pytest.raises(ConfigError) as info:
            make()
        assert message in str(info.value), str(info.value)


def test_hook_state_keeps_its_knobs():
    assert hp.HookState(plan="auto").plan == "auto"  # the cost-model planner
    state = hp.HookState(algorithm="dgc", ratio=0.01, timeout=5)
    assert state.options.settings.params == (("ratio", 0.01),)
    assert state.options.settings.timeout == 5.0


def test_hook_state_pickles_without_its_engine():
    state = hp.HookState(algorithm="dgc", ratio=0.01)
    state.sync = object()  # stands in for a live engine
    copy = pickle.loads(pickle.dumps(state))
    assert copy.sync is None and copy.options.params == {"ratio": 0.01}


def test_plugin_needs_init_first():
    from hipress import ConfigError

    if hp.is_initialized():
        pytest.skip("initialized by another test")
    with pytest.raises(ConfigError, match="hp.init"):
        hp.rank()


def test_training_bench_always_measures_its_reference():
    select_methods = bench_module("train").select_methods
    # every ratio is to plain DDP in the same run: it runs first even when not asked for
    assert select_methods(["HiPress onebit"], "shaped") == ["DDP", "HiPress onebit"]
    assert select_methods(["HiPress dgc", "DDP", "HiPress dgc"], "shaped") == [
        "DDP", "HiPress dgc"]
    # torch's own hooks cannot be software-paced
    assert select_methods(["torch fp16", "HiPress onebit"], "paced") == [
        "DDP", "HiPress onebit"]


def test_time_to_target_is_on_smoothed_held_out_scores():
    train = bench_module("train")
    assert train.SMOOTH == 3
    # held-out scores every 10 steps, one step a second: (seconds, step, loss, accuracy)
    ddp = [[10.0 * i, 10 * i, 1.0 - i / 10, 0.5] for i in range(1, 11)]
    fast = [[5.0 * i, 10 * i, 1.0 - i / 10, 0.5] for i in range(1, 11)]
    slower = [[10.0 * i, 10 * i, 1.02 - i / 10, 0.5] for i in range(1, 13)]
    lucky = [[10.0 * i, 10 * i, 1.0 - i / 10 + (-0.15 if i == 5 else 0.0), 0.5]
             for i in range(1, 11)]
    target = train.target_loss({"evals": ddp})
    assert target == pytest.approx(0.1)  # DDP's last three scores: 0.2, 0.1, 0.0
    assert train.time_to(target, ddp) == 100.0
    assert train.time_to(target, fast) == 50.0
    assert train.time_to(target, slower) == 110.0  # one more score, 10 steps later
    assert train.time_to(target, lucky) == 100.0  # one low score does not count
    assert train.time_to(-1.0, ddp) is None
    assert train.loss_at(100, slower) == pytest.approx(0.12)
    assert train.loss_at(105, slower) is None


def test_a_step_breakdown_adds_up_what_the_hook_recorded():
    from hipress.breakdown import StepTrace, summarize

    trace = StepTrace(hook=[(1.10, 1.11), (1.20, 1.22)], tail=[(1.30, 1.35)],
                      tasks=[("compute", "to1/encode", "c0", 1.11, 1.13),
                             ("comm", "from1/recv", "c0", 1.13, 1.30),
                             ("inline", "average", "c1", 1.31, 1.32),
                             ("p2p", "to1/send", "c0", 1.13, 1.14),
                             ("compute", "from1/decode", "c0", 1.33, 1.36)])
    got = summarize(1.0, 1.05, 1.35, 1.40, trace)
    want = {"step_ms": 400, "forward_ms": 50, "backward_ms": 300, "optimizer_ms": 50,
            "hook_ms": 30, "tail_ms": 50, "codec_ms": 60, "wire_ms": 170}
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-6, key
    # the sync ran from 1.11 to 1.36; backward's last gradient came at 1.30: 76 %
    assert abs(got["overlap"] - 0.19 / 0.25) < 1e-9
    assert set(summarize(1.0, 1.05, 1.35, 1.40, None)) == {
        "step_ms", "forward_ms", "backward_ms", "optimizer_ms"}


def test_run_on_hosts_gives_each_rank_its_environment_and_stops_the_rest(tmp_path):
    import time

    from hipress.hosts import loopback
    from hipress.launcher import run_on_hosts

    show = ("import os; print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
            "'LOCAL_WORLD_SIZE', 'MASTER_ADDR')), file=open(os.environ['OUT'] + "
            "os.environ['RANK'], 'w'))")
    with loopback(3) as hosts:
        assert run_on_hosts(hosts, [sys.executable, "-c", show],
                            {"OUT": str(tmp_path / "r"), "PATH": "/usr/bin:/bin"}) == [0, 0, 0]
    for rank in range(3):
        assert (tmp_path / f"r{rank}").read_text().split() == [
            str(rank), "3", str(rank), "3", "127.0.0.1"]
    # one rank fails: the others are stopped at once, not left waiting for it
    fail = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    start = time.monotonic()
    with loopback(3) as hosts:
        codes = run_on_hosts(hosts, [sys.executable, "-c", fail], grace=5.0)
    assert codes[1] == 3 and codes[0] != 0 and codes[2] != 0
    assert time.monotonic() - start < 30


def test_torchrun_command_lines():
    single = torchrun_command(4, ["train.py", "--steps", "5"])
    assert "--standalone" in single and single[-3:] == ["train.py", "--steps", "5"]
    multi = torchrun_command(8, ["python", "x.py"], nnodes=2, node_rank=1,
                             master_addr="10.0.0.1")
    assert ["--nnodes", "2"] == multi[multi.index("--nnodes"):multi.index("--nnodes") + 2]
    # "python" means the interpreter running hipress (a framework's own venv)
    assert "--no-python" in multi and multi[-2:] == [sys.executable, "x.py"]
    from hipress import ConfigError

    with pytest.raises(ConfigError, match="master-addr"):
        torchrun_command(2, ["x.py"], nnodes=2)
    with pytest.raises(ConfigError, match="nothing to run"):
        torchrun_command(2, [])


# ----------------------------------------------------------------------------- parallel


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    results = ranks.launch(2, "torch_plugin", tmp_path_factory.mktemp("torch"),
                           {"modes": ["hook", "optimizer", "ddp"], "algos": ALGOS})
    for rank, r in enumerate(results):
        assert r["rc"] == 0, f"rank {rank}:\n{r['log'][-3000:]}"
    return results


@pytest.mark.parallel
@pytest.mark.parametrize("mode", ["hook", "optimizer"])
@pytest.mark.parametrize("algo", ALGOS)
def test_replicas_identical_and_loss_decreases(trained, mode, algo):
    key = f"{mode}/{algo}"
    assert trained[0][key]["digest"] == trained[1][key]["digest"]
    losses = trained[0][key]["losses"]
    assert len(losses) == 20
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.02, losses


@pytest.mark.parallel
@pytest.mark.parametrize("mode", ["hook", "optimizer"])
def test_none_matches_ddp_allreduce(trained, mode):
    ours = trained[0]["arrays"][f"{mode}/none"]
    ddp = trained[0]["arrays"]["ddp/none"]
    np.testing.assert_allclose(ours, ddp, rtol=1e-4, atol=1e-6)


@pytest.mark.parallel
def test_the_default_hook_averages_an_embedding_exactly_and_says_why(tmp_path):
    """HookState() as a user leaves it: after the warm-up the embedding's gradient (8 x 16
    tokens a rank of 2048 rows) is averaged uncompressed, so its untouched rows stay
    exactly zero, as plain DDP's; HIPRESS_DUMP=plan names the rule."""
    from casync.guard import WARMUP_STEPS

    steps = WARMUP_STEPS + 3
    results = ranks.launch(2, "torch_embedding", tmp_path, {"steps": steps},
                           env={"HIPRESS_DUMP": "plan"})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
        assert "row-sparse (at least" in r["log"], r["log"][-3000:]
        assert "cgx over ps" in r["log"]  # the dense output layer is compressed
    arrays = results[0]["arrays"]
    for step in range(steps):
        ours, ddp = arrays[f"hipress{step}"], arrays[f"ddp{step}"]
        assert np.array_equal(ours == 0, ddp == 0), step  # the same rows untouched
        if step <= WARMUP_STEPS:  # until the compressed output layer moves the weights
            np.testing.assert_allclose(ours, ddp, rtol=1e-5, atol=1e-9)


@pytest.mark.parallel
def test_bf16_gradients_and_gradient_accumulation(tmp_path):
    """bf16 models (upcast for the codec) with 2 backward passes per step: DDP no_sync
    for the hook, backward_passes_per_step=2 for the optimizer."""
    results = ranks.launch(2, "torch_plugin", tmp_path,
                           {"modes": ["hook", "optimizer"], "algos": ["onebit"], "bf16": True,
                            "passes": 2, "steps": 15})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    for key in ("hook/onebit", "optimizer/onebit"):
        assert results[0][key]["digest"] == results[1][key]["digest"]
        losses = results[0][key]["losses"]
        assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


@pytest.mark.parallel
def test_optimizer_misuse_gets_actionable_errors_and_its_hooks_come_off(tmp_path):
    results = ranks.launch(2, "misuse", tmp_path)
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
        assert "backward_passes_per_step=1" in r["backward"], r
        assert "zero_grad" not in r, r
    # after remove_hooks() nothing is averaged: each rank keeps its own batch's gradient
    assert results[0]["local grad"] != results[1]["local grad"]


@pytest.mark.parallel
def test_grad_scaler_skips_an_overflow_on_every_rank_through_every_path(tmp_path):
    """fp16 autocast with torch's GradScaler: an inf loss on one rank halves the scale on
    every rank in the same step, as plain DDP does, through the comm hook and through
    DistributedOptimizer (scaler.step alone, and with unscale_ and clipping first); the
    ranks keep identical, finite parameters."""
    algos = ["dgc", "terngrad", "topk", "cgx"]
    cases = [["ddp", "none"]] + [[m, a] for m in ("hook", "optimizer") for a in algos]
    results = ranks.launch(2, "amp", tmp_path, {"cases": cases, "steps": 5, "overflow": 2})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
    want = results[0]["ddp/none"]["scales"]
    assert want == [1024.0, 1024.0, 512.0, 512.0, 512.0]
    for mode, algo in cases:
        key = f"{mode}/{algo}"
        assert [r[key]["scales"] for r in results] == [want, want], key
        assert results[0][key]["digest"] == results[1][key]["digest"], key
        assert results[0][key]["finite"], key


@pytest.mark.parallel
def test_backward_does_not_wait_on_the_engine_chunk_by_chunk(tmp_path):
    """Every message arrives 200 ms late; a step of eight chunks (a DDP bucket each) needs
    two messages per chunk in a row (the upload to its aggregator, then the download;
    a rank waits on one or both, as the chunk's segments are owned). The hook only hands
    each bucket over, so backward returns once the last messages land, not after each
    chunk's: far less than the messages' delays one after another, and with the same
    parameters as over a plain transport."""
    delay = 0.2
    results = ranks.launch(2, "slow_wire", tmp_path, {"delay": delay})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
        slow, plain = r["slow"], r["plain"]
        assert slow["chunks"] == 8 and slow["waits"] >= slow["chunks"], slow
        assert slow["backward_s"] < slow["chunks"] * 2 * delay / 2, slow
        assert slow["digest"] == plain["digest"]
    assert results[0]["slow"]["digest"] == results[1]["slow"]["digest"]


@pytest.mark.parallel
@pytest.mark.parametrize("mode", ["hook", "optimizer"])
def test_one_rank_with_an_invalid_setting_fails_every_rank_with_its_message(tmp_path, mode):
    """The rank with ``ratio=0`` fails at construction; the other, whose settings are fine,
    fails at its engine's settings check with a ConfigError that names rank 1 and quotes
    it, well within the timeout: no raw Gloo error, no wait on the process group."""
    results = ranks.launch(2, "invalid_rank", tmp_path, {"mode": mode},
                           env={"HIPRESS_TIMEOUT": "20"})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
        assert r["type"] == "ConfigError", r
        assert "ratio must be in (0, 1]" in r["error"], r["error"]
        assert r["after"] < 20, r["after"]
    assert "rank 1's settings are invalid" in results[0]["error"]


#: kernel threads as a user's job may have them: the abort needed a lane's kernel threads alive
EXIT_ENV = {"HIPRESS_THREADS": "2", "OMP_NUM_THREADS": "2"}
EXITS = [("hook", "destroy", "dist")] * 3 + [("optimizer", "destroy", "dist")] * 2 + [
    ("hook", "shutdown", "hp"), ("hook", "both", "hp"), ("hook", "reversed", "dist"),
    ("hook", "neither", "dist"), ("optimizer", "neither", "hp"), ("optimizer", "both", "dist")]


@pytest.mark.parallel
@pytest.mark.parametrize("mode,ending,init", EXITS,
                         ids=[f"{m}-{e}-{i}-{n}" for n, (m, e, i) in enumerate(EXITS)])
def test_a_script_exits_0_whatever_it_calls_last(tmp_path, mode, ending, init):
    """``dist.destroy_process_group()`` alone (PyTorch's DDP tutorial's last line; it
    aborted about half the runs), ``hp.shutdown()``, both in either order, or neither:
    every rank exits 0. The destroy case repeats: the abort was a race."""
    results = ranks.launch(2, "torch", tmp_path, {"mode": mode, "ending": ending,
                                                  "init": init},
                           script=Path(__file__).parent / "exits.py", timeout=120,
                           env=EXIT_ENV)
    for r in results:
        assert r["rc"] == 0 and r.get("trained"), r["log"][-3000:]
        assert "terminate called" not in r["log"], r["log"][-3000:]


def _run_example(tmp_path: Path, name: str, *args: str) -> dict:
    metrics = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hipress.cli", "run", "-np", "2",
         str(ROOT / "examples" / "torch_train.py"), "--quiet", "--metrics", str(metrics),
         *args], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(metrics.read_text())


@pytest.mark.parallel
def test_the_example_breaks_a_transformers_step_down(tmp_path):
    """The GPT-style model (76 tensors) under the hook with --breakdown: every rank
    reports every column, and the engine's own time for the same gradients."""
    from hipress.breakdown import COLUMNS

    result = _run_example(tmp_path, "lm", "--model", "transformer", "--width", "96",
                          "--steps", "6", "--batch", "2", "--breakdown")
    assert result["tensors"] == 76 and result["replicas_identical"]
    assert len(result["breakdown"]) == 2
    for rank in result["breakdown"]:
        assert set(rank) == set(COLUMNS), rank
        assert rank["step_ms"] > rank["hook_ms"] > 0 and 0 <= rank["overlap"] <= 1
    assert all(ms > 0 for ms in result["engine_alone_ms"])


@pytest.mark.parallel
def test_hipress_run_trains_the_example(tmp_path):
    result = _run_example(tmp_path, "short", "--steps", "5", "--width", "256")
    assert result["steps"] == 5 and result["world"] == 2
    assert result["warmup_steps"] == 3 and result["steady_samples_per_s"] > 0
    assert result["replicas_identical"]
    assert result["bytes_per_step"] > 0


@pytest.mark.parallel
def test_onebit_converges_like_uncompressed(tmp_path):
    """A CI-sized version of the training bench: onebit with error feedback reaches
    uncompressed accuracy within 2 points after the same epochs."""
    from casync.plan import MIN_COMPRESS

    width = 512
    common = ("--width", str(width), "--batch", "32", "--lr", "0.05", "--epochs", "6")
    plain = _run_example(tmp_path, "plain", "--sync", "ddp", *common)
    onebit = _run_example(tmp_path, "onebit", "--sync", "hook", "--algorithm", "onebit",
                          *common)
    assert plain["accuracy"] > 0.9, plain["accuracy"]
    assert onebit["accuracy"] >= plain["accuracy"] - 0.02, (onebit["accuracy"],
                                                            plain["accuracy"])
    # On 2 ranks an fp32 allreduce sends every float once per step; onebit sends ~1/32
    # of those it compresses (16 floats' room here for headers) and small tensors raw.
    sizes = [64 * width, width, width * width, width, width * 10, 10]
    raw = sum(n for n in sizes if n < MIN_COMPRESS)
    assert onebit["params"] == sum(sizes)
    assert 0 < onebit["bytes_per_step"] < 4 * raw + 4 * (sum(sizes) - raw) / 16


# ------------------------------------------------------------------------------ failures

FAULT_TIMEOUT = 5.0


@pytest.mark.parallel
@pytest.mark.parametrize("fault", ["die", "stall"])
@pytest.mark.parametrize("mode", ["hook", "optimizer"])
def test_a_dead_or_stalled_peer_is_a_sync_error_in_the_training_loop(tmp_path, mode, fault):
    """``try: loss.backward(); opt.step() except hipress.SyncError`` catches a peer that
    dies or stalls mid-step, under DDP's comm hook as under DistributedOptimizer, within
    the timeout; the survivor then exits with its own code (7), not SIGABRT."""
    results = ranks.launch(2, "torch_fault", tmp_path, {"mode": mode, "fault": fault},
                           env={"HIPRESS_TIMEOUT": str(FAULT_TIMEOUT)}, timeout=120)
    survivor = results[0]
    assert survivor["rc"] == 7, survivor["log"][-3000:]
    assert survivor["type"] == "SyncError", survivor
    assert "step 3" in survivor["error"] and "rank 1" in survivor["error"], survivor
    assert survivor["after"] <= FAULT_TIMEOUT + 10, survivor
    assert results[1]["rc"] == (17 if fault == "die" else 7), results[1]["log"][-3000:]


@pytest.mark.parallel
@pytest.mark.parametrize("shutdown", [True, False], ids=["shutdown", "exit"])
@pytest.mark.parametrize("topology", ["ps", "ring"])
def test_survivors_exit_with_their_code_after_a_failure(tmp_path, topology, shutdown):
    """With many messages in flight when a rank dies, every survivor raises SyncError and
    ends with the exit code it chose, whether it calls hp.shutdown() or just exits: no
    'terminate called without an active exception', no hang."""
    results = ranks.launch(4, "torch_fault", tmp_path,
                           {"mode": "engine", "topology": topology, "shutdown": shutdown},
                           env={"HIPRESS_TIMEOUT": str(FAULT_TIMEOUT)}, timeout=120)
    assert results[3]["rc"] == 17
    for r in results[:3]:
        assert r["rc"] == 7, r["log"][-3000:]
        assert r["type"] == "SyncError", r
        assert "terminate called" not in r["log"]


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parallel
@pytest.mark.parametrize("mode,algo,topology", [
    ("hook", "onebit", "ps"), ("hook", "terngrad", "ps"), ("hook", "onebit", "ring"),
    ("optimizer", "onebit", "ps"), ("optimizer", "terngrad", "allgather")])
def test_a_resumed_job_continues_bit_for_bit(tmp_path, mode, algo, topology):
    """12 steps straight with a checkpoint (model, optimizer, HiPress) after the 6th, and
    fresh processes that resume from it for 6 more: the same parameters to the bit on every
    rank. onebit's residuals matter (its tensors are compressed with error feedback);
    terngrad is stochastic. Under DDP the resumed job's first step runs DDP's initial
    buckets, the straight one its rebuilt ones: the engine's names, aggregators and runs
    must not depend on them."""
    args = {"algo": algo, "mode": mode, "topology": topology}
    straight = ranks.resumed_bit_for_bit("torch_checkpoint", tmp_path, args)
    if algo == "onebit":
        # and a job that restored all but HiPress's state (the residuals) would not match
        reset = ranks.launch(2, "torch_checkpoint", tmp_path / "reset",
                             {**args, "start": 6, "steps": 6, "load": str(tmp_path / "ckpt"),
                              "reset": True})
        assert reset[0]["rc"] == 0, reset[0]["log"][-3000:]
        assert reset[0]["arrays"]["params"].tobytes() != straight[0]["arrays"]["params"] \
            .tobytes()


@pytest.mark.parallel
@pytest.mark.parametrize("mode", ["hook", "optimizer"])
def test_one_file_from_rank_0_resumes_every_rank_bit_for_bit(tmp_path, mode):
    """Rank 0 writes the one checkpoint (as Lightning, Accelerate and Trainer do) with
    ``hp.AllRanksState`` holding every rank's HiPress state; every rank of the fresh job
    reads that file with torch's default ``weights_only=True`` and takes its own part."""
    ranks.resumed_bit_for_bit("torch_checkpoint", tmp_path,
                              {"algo": "onebit", "mode": mode, "topology": "ps",
                               "one_file": True})
    assert not list((tmp_path / "ckpt").glob("rank*.pt"))


@pytest.mark.parallel
def test_a_job_whose_rank_died_restarts_from_its_checkpoint(tmp_path):
    """``hipress run --max-restarts 1``: rank 1 dies after step 25 of 40; torchrun's agent
    restarts both ranks, which resume from the step-20 checkpoint and finish."""
    metrics = tmp_path / "m.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hipress.cli", "run", "-np", "2", "--max-restarts", "1",
         str(ROOT / "examples" / "torch_train.py"), "--checkpoint", str(tmp_path / "ckpt"),
         "--fail-at", "25", "--steps", "40", "--width", "256", "--quiet",
         "--metrics", str(metrics)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1 fails after step 25" in proc.stdout + proc.stderr
    assert "resumed from step 20" in proc.stdout
    result = json.loads(metrics.read_text())
    assert (result["resumed_from"], result["steps"]) == (20, 40)
    assert result["replicas_identical"]
