"""CaSync: plans, primitives and error feedback (pure), then the engine on 2 and 4 ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ranks
import torch

import hipress
from casync import ErrorFeedback, Plan, StaticPlanner, default_timeout
from casync.primitives import partition
from compll.payload import framed_size
from hipress import ConfigError, PayloadError

# ---------------------------------------------------------------------------------- pure


@pytest.mark.parametrize("n,k", [(0, 1), (1, 1), (10, 3), (7, 7), (1000, 4), (5, 8)])
def test_partition_covers_in_order(n, k):
    parts = partition(n, k)
    assert len(parts) == k
    assert parts[0].start == 0 and parts[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))
    sizes = [p.stop - p.start for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_static_planner_threshold_and_partitions():
    planner = StaticPlanner("onebit", "ring", min_compress=1000, partition_bytes=4000)
    assert planner.plan("small", 999, 4) == Plan("none", None, 1)
    assert planner.plan("one", 1000, 4) == Plan("ring", "onebit", 1)
    assert planner.plan("big", 1_000_000, 4).partitions == 4   # at most one per rank
    assert planner.plan("big", 1_000_000, 1).topology == "none"  # nothing to talk to
    assert StaticPlanner("none").plan("x", 10**6, 4).topology == "none"


def test_plan_rejects_inconsistent_fields():
    with pytest.raises(ConfigError, match="unknown topology"):
        Plan("tree", "onebit")
    with pytest.raises(ConfigError, match="compresses"):
        Plan("none", "onebit")
    with pytest.raises(ConfigError, match="compresses"):
        Plan("ps", None)
    with pytest.raises(ConfigError, match="at least 1"):
        Plan("ps", "onebit", 0)


def test_default_timeout_reads_the_environment(monkeypatch):
    monkeypatch.delenv("HIPRESS_TIMEOUT", raising=False)
    assert default_timeout() == 300
    monkeypatch.setenv("HIPRESS_TIMEOUT", "12.5")
    assert default_timeout() == 12.5
    monkeypatch.setenv("HIPRESS_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="HIPRESS_TIMEOUT"):
        default_timeout()


def test_progress_is_posted_off_the_step_and_a_dead_store_holds_up_nothing():
    """The step's progress reaches the store from a helper thread: the newest step
    arrives, progress() returns at once even while the store hangs, close() ends it."""
    import threading
    import time

    from casync.health import Health

    class Store:
        def __init__(self) -> None:
            self.values: dict[str, str] = {}
            self.hang = threading.Event()
            self.release = threading.Event()

        def set(self, key: str, value: str) -> None:
            if self.hang.is_set():
                self.release.wait(10)
            self.values[key] = value

    store = Store()
    health = Health(None, 1, 2, store=store)
    health.progress(0)
    deadline = time.monotonic() + 5
    while store.values.get("hipress/health/step/1") != "0" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.values["hipress/health/step/1"] == "0"
    store.hang.set()  # the store stops answering (its host died)
    t0 = time.monotonic()
    for step in range(1, 50):
        health.progress(step)
    assert time.monotonic() - t0 < 1.0
    store.hang.clear()
    store.release.set()  # the post in flight lands, then the newest step
    deadline = time.monotonic() + 5
    while store.values.get("hipress/health/step/1") != "49" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.values["hipress/health/step/1"] == "49"
    poster = health._poster
    assert poster is not None
    health.close()
    poster.join(5)
    assert not poster.is_alive()


def test_progress_is_posted_at_most_once_per_interval_and_the_newest_step_lands():
    """A step loop of a few ms does not pay a store round trip per step: posts are spaced
    by ``POST_EVERY``, and the last step still reaches the store."""
    import time

    from casync.health import POST_EVERY, Health

    class Store:
        def __init__(self) -> None:
            self.values: dict[str, str] = {}
            self.posts = 0

        def set(self, key: str, value: str) -> None:
            self.posts += 1
            self.values[key] = value

    store = Store()
    health = Health(None, 0, 2, store=store)
    t0 = time.monotonic()
    for step in range(200):
        health.progress(step)
        time.sleep(0.001)
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while store.values.get("hipress/health/step/0") != "199" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.values["hipress/health/step/0"] == "199"
    assert store.posts <= took / POST_EVERY + 2, (store.posts, took)
    health.close()


def test_the_diagnosis_blames_only_ranks_that_never_started_the_step():
    """Posts are spaced, so a rank's newest step may not be in the store yet when
    another rank fails: the diagnosis waits for the posts to settle, and names only the
    rank that really stopped."""
    import threading

    from casync.health import Health

    class Store:
        def __init__(self) -> None:
            self.values: dict[str, str] = {}
            self.lock = threading.Lock()

        def set(self, key: str, value: str) -> None:
            with self.lock:
                self.values[key] = value

        def check(self, keys: list[str]) -> bool:
            with self.lock:
                return all(k in self.values for k in keys)

        def get(self, key: str) -> bytes:
            with self.lock:
                return self.values[key].encode()

    store = Store()
    ranks = [Health(None, r, 3, store=store) for r in range(3)]
    for step in range(3):  # steps 0-2 in quick succession on ranks 0 and 1
        ranks[0].progress(step)
        ranks[1].progress(step)
        if step < 2:
            ranks[2].progress(step)  # rank 2 stops before step 2
    ranks[0].report("lost rank 2")
    found = ranks[0].diagnose(2)
    assert "rank 2 never started step 2 (last seen in step 1)" in found, found
    assert "rank 1" not in found, found
    for health in ranks:
        health.close()


@pytest.mark.pure
def test_an_inline_task_runs_on_the_thread_that_finished_its_input():
    """The inline lane (a small chunk's average) takes no hand-off: it runs where its
    input completed, here the thread that added the graph; a compute task after it runs
    on the compute thread. Both count as the graph's own work (``bench sync``'s critical
    path re-runs ``ran``); a post does not."""
    import threading

    from casync.executor import Executor, Graph, Lane

    executor = Executor(None, timeout=5.0, trace=True)  # type: ignore[arg-type]
    ran: dict[str, str] = {}

    def note(name: str) -> object:
        return lambda: ran.__setitem__(name, threading.current_thread().name)

    graph = Graph("g", 0)
    posted = graph.task("post", Lane.POST, (0, 0), note("post"))
    inline = graph.task("average", Lane.INLINE, (1, 0), note("average"), deps=(posted,))
    graph.task("after", Lane.COMPUTE, (2, 0), note("after"), deps=(inline,))
    executor.add(graph)
    assert graph.finished.wait(5)
    executor.close()
    here = threading.current_thread().name
    assert ran == {"post": here, "average": here, "after": "casync-compute"}
    ran.clear()
    for work in executor.ran:
        work()
    assert sorted(ran) == ["after", "average"]


def test_framed_size_finds_the_payload_in_a_larger_buffer():
    c = hipress.codec("dgc", target="ref")
    payload = c.encode(ranks.data(0, 0, 5000))
    big = np.zeros(c.max_payload_bytes(5000), np.uint8)
    big[:payload.size] = payload
    assert payload.size <= big.size
    assert framed_size(big) == payload.size
    with pytest.raises(PayloadError):
        framed_size(big[:payload.size - 1])
    with pytest.raises(PayloadError, match="magic"):
        framed_size(np.zeros(64, np.uint8))


@pytest.mark.parametrize("algo", ["onebit", "dgc", "minmax8", "terngrad", "topk", "threshold"])
def test_max_payload_bytes_bounds_every_payload(algo):
    c = hipress.codec(algo, target="ref")
    for n in (0, 1, 9, 4096):
        for x in (ranks.data(1, 2, n), np.ones(n, np.float32)):
            assert c.encode(x).size <= c.max_payload_bytes(n)


def test_error_feedback_keeps_the_running_sum_close():
    """Synchronized sum minus true sum is exactly the current residual, so it stays bounded."""
    c = hipress.codec("onebit", target="ref")
    ef = ErrorFeedback()
    sent = np.zeros(4096)
    true = np.zeros(4096)
    plain = np.zeros(4096)
    for step in range(50):
        g = ranks.data(0, 0, 4096, step)
        sent += c.decode(ef.encode(c, g, step, key="g"), g.size)
        plain += c.decode(c.encode(g), g.size)
        true += g
    residual = ef.residual("g")
    assert residual is not None
    np.testing.assert_allclose(true - sent, residual, rtol=0, atol=1e-3)
    assert np.linalg.norm(true - sent) < 0.2 * np.linalg.norm(true - plain)


def test_error_feedback_drops_non_finite_residuals():
    c = hipress.codec("onebit", target="ref")
    ef = ErrorFeedback()
    g = ranks.data(0, 0, 100)
    g[3] = np.inf
    ef.encode(c, g, 0, key="g")
    residual = ef.residual("g")
    assert residual is not None and np.isfinite(residual).all()


# ----------------------------------------------------------------------------- parallel

DTYPE_EPS = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: encodes on the path from a gradient to the result: worker, then aggregator / ring hops
ENCODES = {"allgather": 1.5, "ps": 2.0, "ring": 2.0}


def _inputs(world: int, index: int) -> list[np.ndarray]:
    n, dtype, _ = ranks.TENSORS[index]
    return [torch.from_numpy(ranks.data(r, index, n)).to(getattr(torch, dtype)).float().numpy()
            for r in range(world)]


def _groups() -> list[list[int]]:
    """Tensors compressed together: each alone (chunks keep one payload per tensor)."""
    return [[i] for i in range(len(ranks.TENSORS))]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def strategy_results(request, tmp_path_factory):
    world = request.param
    results = ranks.launch(world, "strategies", tmp_path_factory.mktemp(f"strat{world}"))
    for rank, r in enumerate(results):
        assert r["rc"] == 0, f"rank {rank} failed:\n{r['log'][-3000:]}"
    return world, [r["arrays"] for r in results]


@pytest.mark.parallel
@pytest.mark.parametrize("topology", ranks.TOPOLOGIES)
@pytest.mark.parametrize("algo", ranks.ALGOS)
def test_strategy_matches_reference_and_is_identical(strategy_results, algo, topology):
    world, arrays = strategy_results
    ref_codec = hipress.codec(algo, target="ref")
    for group in _groups():
        outs = [np.concatenate([a[f"{algo}/{topology}/{i}"] for i in group]) for a in arrays]
        for rank in range(1, world):  # every rank decoded the same bytes
            assert outs[rank].tobytes() == outs[0].tobytes(), f"rank {rank} differs"
        xs = [np.concatenate(parts) for parts in zip(*(_inputs(world, i) for i in group),
                                                      strict=True)]
        if xs[0].size == 0:
            continue
        mean = np.mean(xs, axis=0)
        decoded = [ref_codec.decode(ref_codec.encode(x), x.size) for x in (*xs, mean)]
        codec_error = max(_rel(d, x) for d, x in zip(decoded, (*xs, mean), strict=True))
        ref = np.mean(decoded[:-1], axis=0)  # mean of what each rank's payload decodes to
        eps = max(DTYPE_EPS[ranks.TENSORS[i][1]] for i in group)
        bound = ENCODES[topology] * codec_error + 2 * eps + 1e-6
        assert _rel(outs[0], mean) <= bound, (group, _rel(outs[0], mean), bound)
        assert _rel(outs[0], ref) <= bound + codec_error, (group, _rel(outs[0], ref))


@pytest.mark.parallel
def test_submit_many_gives_the_bits_of_one_submit_per_tensor(strategy_results, tmp_path):
    """A step handed over as one batch (as the DDP hook hands a bucket) forms the same
    chunks and payloads as the same tensors submitted one by one: identical bits; its
    future resolves to the tensors; a repeated name is refused up front."""
    world, arrays = strategy_results
    algos = ["onebit", "dgc", "terngrad"]
    results = ranks.launch(world, "strategies", tmp_path, {"batched": True, "algos": algos})
    for rank, r in enumerate(results):
        assert r["rc"] == 0, f"rank {rank} failed:\n{r['log'][-3000:]}"
        assert r["refused"] == ["ConfigError: submit_many takes the tensors of one GPU, "
                                "not of cuda:0, cuda:1: call it once per device",
                                "gradients must be floating point, not torch.int32",
                                "tensor 't0' was already submitted in step 0; call "
                                "synchronize() to finish the step first"], r["refused"]
        for algo in algos:
            for topo in ranks.TOPOLOGIES:
                for i in range(len(ranks.TENSORS)):
                    key = f"{algo}/{topo}/{i}"
                    assert r["arrays"][key].tobytes() == arrays[rank][key].tobytes(), key


def _true_means(world: int, n: int, steps: int) -> list[np.ndarray]:
    return [np.mean([ranks.data(r, 0, n, s) for r in range(world)], axis=0, dtype=np.float64)
            for s in range(steps)]


@pytest.mark.parallel
@pytest.mark.parametrize("topology", ["ps", "ring"])
def test_error_feedback_tracks_the_true_sum(tmp_path, topology):
    world, steps = 2, 50
    with_ef = ranks.launch(world, "feedback", tmp_path / "ef",
                           {"algo": "onebit", "topology": topology, "steps": steps})
    without = ranks.launch(world, "feedback", tmp_path / "plain",
                           {"algo": "onebit", "topology": topology, "steps": steps,
                            "error_feedback": False})
    for r in with_ef + without:
        assert r["rc"] == 0, r["log"][-3000:]
    means = _true_means(world, 20_000, steps)
    true = np.sum(means, axis=0)
    step_norm = float(np.mean([np.linalg.norm(m) for m in means]))
    drift_ef = np.linalg.norm(with_ef[0]["arrays"]["total"] - true)
    drift_plain = np.linalg.norm(without[0]["arrays"]["total"] - true)
    # With feedback the drift is the residuals (worker + aggregator): a few steps' worth,
    # not growing with the number of steps.
    print(f"{topology}: drift with feedback {drift_ef / step_norm:.2f} steps' worth, "
          f"without {drift_plain / step_norm:.2f}")
    assert drift_ef < 3 * step_norm, (drift_ef, step_norm)
    assert drift_ef < 0.5 * drift_plain, (drift_ef, drift_plain)
    if topology == "ps":
        # Roles stay put: one rank aggregates the tensor every step (one aggregator
        # residual), the other is always its worker (one worker residual). A moving
        # aggregator would leave residuals behind that wait steps to be applied.
        assert [r["residuals"] for r in with_ef] == [1, 1]


@pytest.mark.parallel
@pytest.mark.parametrize("world,topology,mode", [(2, "ring", "die"), (4, "ps", "die"),
                                                 (4, "ring", "stall"), (2, "ring", "gone")])
def test_dead_or_stalled_peer_raises_sync_error(tmp_path, world, topology, mode):
    timeout, victim = 5.0, world - 1
    results = ranks.launch(world, "fault", tmp_path,
                           {"algo": "onebit", "topology": topology, "timeout": timeout,
                            "victim": victim, "mode": mode}, timeout=timeout + 90)
    for rank, r in enumerate(results):
        if rank == victim:
            continue
        assert r["rc"] == 0, r["log"][-3000:]
        assert r["type"] == "SyncError", r
        assert "step 2" in r["error"] and "layer1" in r["error"] and "rank" in r["error"]
        assert r["after"] <= timeout + 10, r


@pytest.mark.parallel
@pytest.mark.parametrize("changed,field", [({"algorithm": "terngrad"}, "algorithm"),
                                           ({"bits": 4}, "algorithm parameters"),
                                           ({"topology": "ring"}, "topology"),
                                           ({"seed": 7}, "seed")])
def test_mismatched_configs_fail_at_init(tmp_path, changed, field):
    base = {"algorithm": "minmax8", "topology": "ps"}
    results = ranks.launch(2, "mismatch", tmp_path, {"base": base, "changed": changed})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
        assert r["error"] and f"disagree on {field}:" in r["error"], r["error"]


@pytest.mark.parallel
def test_settings_are_compared_before_anything_collective(tmp_path):
    """A plan that differs (the auto rank would start profiling) and an invalid setting on
    one rank fail fast on every rank with a ConfigError naming the field or the rank;
    settings that mean the same agree."""
    timeout = 10
    base = {"algorithm": "onebit", "topology": "ps", "timeout": timeout}
    cases = [({"plan": "auto"}, "disagree on plan:"),
             ({"min_compress": 0}, "disagree on plan:"),
             ({"ratio": 0.5, "algorithm": "dgc"}, "disagree on algorithm:"),
             ({"error_feedback": True}, None),      # onebit's default: the same engine
             ({"bits": 9, "algorithm": "cgx"}, "rank 1's settings are invalid: cgx: bits")]
    for n, (changed, expected) in enumerate(cases):
        results = ranks.launch(2, "mismatch", tmp_path / str(n),
                               {"base": base, "changed": changed},
                               env={"HIPRESS_TIMEOUT": str(timeout)})
        for rank, r in enumerate(results):
            assert r["rc"] == 0, r["log"][-3000:]
            if expected is None:
                assert r["error"] is None, (changed, r["error"])
                continue
            assert r["type"] == "ConfigError", (changed, rank, r)
            if rank == 1 and "invalid" in expected:  # its own construction said why
                assert "cgx: bits must be 1 to 8" in r["error"], r["error"]
            else:
                assert expected in r["error"], (changed, rank, r["error"])
            assert r["after"] < timeout + 10, (changed, rank, r["after"])


@pytest.mark.parallel
@pytest.mark.parametrize("algo", ["none", "onebit"])
def test_waiting_on_a_future_before_synchronize_sends_its_chunk(tmp_path, algo):
    """A future's chunk was still filling; waiting on it sends it, on every rank at the
    same point of the program, and the averages are those of every rank."""
    results = ranks.launch(2, "wait_first", tmp_path, {"algo": algo})
    for r in results:
        assert r["rc"] == 0, r["log"][-3000:]
        assert max(r["waits"]) < 10, r["waits"]
    for key, value in results[0]["arrays"].items():
        assert value.tobytes() == results[1]["arrays"][key].tobytes(), key
        if algo == "none":
            step, index = int(key[1]), "abc".index(key[0])
            n = 5000 if index == 0 else 3000
            mean = np.mean([ranks.data(r, index, n, step) for r in range(2)], axis=0)
            np.testing.assert_allclose(value, mean, rtol=1e-6, atol=1e-6)


#: a codec a user might write, with no thought of NaN: its max ignores one, its cast
#: turns one into 0, so only the engine's flag can carry it
USER_CODEC = """\
unbiased

encode(g: f32[]) -> bytes:
    let scale = reduce(g, max, key=abs)
    let q = map(g, x -> if scale > 0.0 then i32(round(x / scale * 7.0)) + 8 else 8)
    return concat(scale, pack(q, bits=4))

decode(p: bytes, n: u32) -> f32[n]:
    let scale: f32, q: u4[n] = extract(p)
    return map(unpack(q), v -> f32(i32(v) - 8) * scale / 7.0)
"""


@pytest.mark.parallel
@pytest.mark.parametrize("world,device", [(2, None), (3, None), (2, "staged")])
def test_a_non_finite_element_on_one_rank_reaches_every_rank(tmp_path, world, device):
    """As with DDP: a NaN, +inf or -inf in one element of one rank's tensor leaves that
    tensor non-finite on every rank, for every shipped codec, a user's .cll file and the
    uncompressed path, in every topology; the other tensors of the chunk stay finite, and
    the next step is finite again (no residual kept the value)."""
    user = tmp_path / "mine4.cll"
    user.write_text(USER_CODEC)
    algos = [*hipress.algorithms(), str(user)]
    results = ranks.launch(world, "nonfinite", tmp_path / "out",
                           {"victim": world - 1, "algos": algos, "device": device})
    for rank, r in enumerate(results):
        assert r["rc"] == 0, f"rank {rank} failed:\n{r['log'][-3000:]}"
    # step 0: tensors 0 (compressed) and 2 (allreduced) held the value; step 1 is clean
    want = [[True, False, True], [False, False, False]]
    for rank, r in enumerate(results):
        assert len(r["found"]) == len(algos) * len(ranks.TOPOLOGIES) * 3
        wrong = {case: got for case, got in r["found"].items() if got != want}
        assert not wrong, f"rank {rank}: {wrong}"


@pytest.mark.parallel
@pytest.mark.parametrize("topology", ["ps", "ring", "allgather"])
def test_encode_of_a_later_chunk_overlaps_earlier_communication(tmp_path, topology):
    results = ranks.launch(2, "pipeline", tmp_path, {"topology": topology})
    assert results[0]["rc"] == 0, results[0]["log"][-3000:]
    trace = results[0]["trace"]

    def chunk(label: str) -> int:  # "tensor 'big' (chunk 3)"
        return int(label.rsplit("chunk ", 1)[1].rstrip(")"))

    comm = [(chunk(g), start, end) for lane, _, g, start, end in trace if lane == "comm"]
    encodes = [(chunk(g), start, end) for lane, name, g, start, end in trace
               if lane == "compute" and "encode" in name]
    assert len({c for c, _, _ in comm}) >= 2 and len({c for c, _, _ in encodes}) >= 2
    overlapped = [(p, q) for p, c0, c1 in comm for q, e0, e1 in encodes
                  if q > p and e0 < c1 and e1 > c0]
    assert overlapped, f"no encode ran while an earlier chunk communicated: {trace}"


@pytest.mark.parallel
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("algo", ["onebit", "dgc"])
def test_messages_per_step_do_not_grow_with_the_number_of_tensors(tmp_path, world, algo):
    """The same bytes in 10 or in 200 tensors: the same messages per step and rank,
    as many as the graph's stages need (one chunk here), carrying what the payloads
    hold and no more (a ring forwards the message it received, not its buffer). And a
    step leaves none of the engine's objects in reference cycles: freed as they go, they
    never set off Python's full collections."""
    topologies = ["ps", "ring", "allgather", "none"]
    results = ranks.launch(world, "messages", tmp_path, {"topologies": topologies,
                                                         "algo": algo})
    # what a rank sends per step, in units of its payloads' bytes: ps and ring send about
    # 2 (N-1)/N of them, allgather N-1 copies
    share = {"ps": 2.0, "ring": 2.0, "allgather": world - 1.0}
    expected = {"ps": 2 * (world - 1), "ring": 2 * (world - 1), "allgather": world - 1,
                "none": 1}
    for rank, r in enumerate(results):
        assert r["rc"] == 0, r["log"][-3000:]
        for topo in topologies:
            few, many = r["counts"][f"{topo}/10"], r["counts"][f"{topo}/200"]
            assert few == many == [expected[topo]] * 3, (rank, topo, few, many)
            assert r["cycles"][f"{topo}/10"] == r["cycles"][f"{topo}/200"] == [], \
                (rank, topo, r["cycles"])
            if topo != "none":
                payloads = r["bytes"][f"{topo}/200/payloads"]
                assert r["bytes"][f"{topo}/200"] <= 1.1 * share[topo] * payloads + 64 * world, \
                    (rank, topo, r["bytes"])


@pytest.mark.parallel
def test_sync_benchmark_runs_end_to_end(tmp_path):
    """`hipress bench sync` on 2 loopback ranks with ResNet-50's profile at a quarter."""
    import json
    import subprocess
    import sys

    out = tmp_path / "sync.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hipress.cli", "bench", "sync", "--ranks", "2", "--scale",
         "0.25", "--steps", "1", "--algorithms", "onebit", "--topologies", "ps", "ring",
         "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    cases = {r["case"]: r for r in result["rows"]}
    assert {"allreduce", "lower bound onebit", "naive onebit", "casync onebit ps",
            "casync onebit ring"} <= set(cases)
    assert all(r["seconds"] > 0 for r in result["rows"])
    # onebit sends 1/32 of the floats it compresses; tensors under 65,536 elements go raw
    # (at this scale 6 % of the floats)
    assert cases["casync onebit ps"]["bytes_per_rank"] < cases["allreduce"]["bytes_per_rank"] / 5
    assert "vs allreduce" in proc.stdout and out.with_suffix(".png").exists()


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                    reason="shaped test hosts need root")
def test_shaped_hosts_are_removed_even_after_a_failure():
    import subprocess

    from hipress.hosts import shaped

    def namespaces() -> set[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return {line.split()[0] for line in out.splitlines() if line.strip()}

    before = namespaces()
    with pytest.raises(RuntimeError, match="boom"), shaped(2, "100mbit") as hosts:
        assert len(hosts) == 2 and hosts[0].addr != hosts[1].addr
        assert len(namespaces() - before) == 2
        raise RuntimeError("boom")
    assert namespaces() == before
    # nodes of two ranks: a namespace (and address) per node, node by node
    with shaped(2, "100mbit", per_node=2) as hosts:
        assert [h.addr for h in hosts][::2] == [h.addr for h in hosts][1::2]
        assert hosts[0].addr != hosts[2].addr and len(namespaces() - before) == 2
    assert namespaces() == before


class _Alone:
    """A transport of one rank (no process group): enough to build an engine."""

    rank, size, group, dist = 0, 1, None, None
    bytes_sent = messages_sent = collectives = 0


def _engine(algo: str = "onebit", **options):
    from casync import Synchronizer

    return Synchronizer(algo, transport=_Alone(), timeout=5, **options)


def test_engine_state_round_trips_and_refuses_what_does_not_fit():
    sync = _engine()
    sync.codecs.residuals["x"] = ErrorFeedback()
    sync.codecs.residuals["x"].site(("w", 0, 4, "worker"), 4)[:] = [1, 2, 3, 4]
    sync.step = 7
    state = sync.state_dict()
    other = _engine()
    other.load_state_dict(state)
    assert other.step == 7
    assert other.codecs.residuals["x"].residual(("w", 0, 4, "worker")).tolist() == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="world size"):
        other.load_state_dict({**state, "world": 4})
    other.load_state_dict({**state, "world": 4}, reset_residuals=True)  # a documented reset
    assert other.step == 7 and not other.codecs.residuals
    with pytest.raises(ConfigError, match="'rank'"):
        other.load_state_dict({**state, "rank": 1})
    with pytest.raises(ConfigError, match="algorithm"):
        _engine("terngrad").load_state_dict(state)
    with pytest.raises(ConfigError, match="algorithm parameters"):
        _engine("minmax8", bits=4).load_state_dict(_engine("minmax8").state_dict())
    with pytest.raises(ConfigError, match="chunk elements"):
        _engine(chunk_elems=1000).load_state_dict(state)
    with pytest.raises(ConfigError, match="format"):
        other.load_state_dict({"format": 99})
    for engine in (sync, other):
        engine.close()


def test_engine_state_is_taken_between_steps():
    sync = _engine()
    sync.steps.names.add("w")  # a tensor of the current step is in flight
    with pytest.raises(ConfigError, match="middle of step"):
        sync.state_dict()
    sync.steps.names.clear()
    sync.close()


@pytest.mark.parallel
def test_the_engine_on_the_reference_interpreter_gives_the_kernels_bits(tmp_path):
    """The NumPy interpreter runs behind the kernels' interface (``compll.reference``), so
    every topology's graphs drive it unchanged: same bits as the CPU kernels, with error
    feedback (updated at once there, deferred by the CPU kernels) over 6 steps."""
    for scenario, args in (("strategies", {"algos": ["onebit", "dgc", "cgx"]}),
                           ("feedback", {"algo": "onebit", "topology": "ring", "steps": 6})):
        host = ranks.arrays_of(scenario, tmp_path / f"{scenario}-cpu", args)
        ref = ranks.arrays_of(scenario, tmp_path / f"{scenario}-ref", {**args, "target": "ref"})
        for h, e in zip(host, ref, strict=True):
            assert sorted(h) == sorted(e) and len(h) > 1
            for key in h:
                assert h[key].tobytes() == e[key].tobytes(), (scenario, key)


@pytest.mark.parametrize("algo,params", [("dgc", {"ratio": 0.01}), ("cgx", {"bits": 4}),
                                         ("onebit", {})])
def test_building_an_engine_checks_its_program_once(monkeypatch, algo, params):
    """The wrapper's settings, the engine and its codecs all need the program: the file is
    parsed and checked once (``compll.load`` caches by file text and parameters)."""
    import compll.compiler as compiler
    from casync import engine
    from hipress.distributed import EngineOptions

    monkeypatch.setattr(compiler, "_checked", {})
    parses = []
    real = compiler.parse
    monkeypatch.setattr(compiler, "parse", lambda *a: parses.append(a[1]) or real(*a))
    options = EngineOptions(algo, **params)
    sync = engine(options.config, transport=_Alone())
    sync.codec_params()  # the codec of the plan's algorithm, built
    assert [Path(p).name for p in parses] == [f"{algo}.cll"]
    sync.close()


def test_a_cll_file_edited_on_disk_is_checked_again(tmp_path):
    import compll

    source = (Path(compll.compiler.dsl_dir()) / "onebit.cll").read_text()
    path = tmp_path / "mine.cll"
    path.write_text(source)
    first = compll.load(str(path))
    assert compll.load(str(path)) is first  # the same text: the same checked program
    path.write_text(source + "\n# edited\n")
    assert compll.load(str(path)) is not first


@pytest.mark.parametrize("field,bad", [("timeout", -1), ("min_compress", -1),
                                       ("chunk_elems", 0), ("error_feedback", "yes"),
                                       ("guard", "yes"), ("plan", "fast")])
def test_a_bad_setting_fails_in_its_one_validator(monkeypatch, field, bad):
    """Every entry (the wrappers' options, ``casync.engine``, a ``Synchronizer``) checks
    through ``EngineConfig.of``: counted, it runs once per construction."""
    from casync import Synchronizer, engine
    from casync.settings import EngineConfig
    from hipress.distributed import EngineOptions

    calls = []
    real = EngineConfig.of.__func__
    monkeypatch.setattr(EngineConfig, "of", classmethod(
        lambda cls, *a, **k: calls.append(1) or real(cls, *a, **k)))
    makers = [lambda: engine("onebit", **{field: bad}),
              lambda: Synchronizer("onebit", transport=_Alone(), **{field: bad})]
    if field != "chunk_elems":  # the engine's own knob, not a wrapper's
        makers.append(lambda: EngineOptions("onebit", **{field: bad}))
    for make in makers:
        calls.clear()
        with pytest.raises(ConfigError, match=field):
            make()
        assert len(calls) == 1


def test_every_engine_offers_the_engine_interface_and_nothing_routes_around_it():
    import ast

    from casync import Engine
    from casync.hierarchy import Hierarchical

    sync = _engine()
    assert isinstance(sync, Engine)
    assert sync.error is None and sync.bytes_sent == 0 and sync.take_trace() is None
    sync.close()
    members = {n for n in vars(Engine) if not n.startswith("_")}
    assert members <= set(dir(Hierarchical)) | {"error"}  # error: an attribute it sets
    # the plugins and the facade read an engine through the interface only
    inside = {"executor", "transport", "steps", "codecs", "links", "health", "inner", "wire"}
    root = Path(__file__).resolve().parent.parent
    reached = []
    for path in [*(root / "plugins").rglob("*.py"), *(root / "hipress").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in inside and \
                    isinstance(node.value, (ast.Name, ast.Attribute)) and \
                    getattr(node.value, "attr", getattr(node.value, "id", "")) in (
                        "sync", "engine", "replica_sync", "e", "each", "made"):
                reached.append(f"{path.relative_to(root)}:{node.lineno}: .{node.attr}")
    assert not reached, reached


def test_a_synchronizer_is_one_level_and_the_factory_builds_the_hierarchy():
    from casync import Synchronizer

    with pytest.raises(ConfigError, match="casync.engine"):
        Synchronizer("onebit", "hierarchical", transport=_Alone())
    with pytest.raises(ConfigError, match="across.*hierarchical"):
        _engine_of("onebit", "ps", across="ring")


def _engine_of(*args, **options):
    from casync import engine

    return engine(*args, transport=_Alone(), **options)
