"""The CPU kernels' threads: as many as the process was given (compll.parallelism), on a
pool whose idle threads sleep (templates/cpu_pool.h)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from compll import parallelism
from hipress import ConfigError

LAUNCHERS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE")


@pytest.fixture
def node(monkeypatch):
    """A process allowed ``cores`` cores, with ``env`` as its launcher left it and torch's
    intra-op setting ``torch``."""
    import torch

    before = torch.get_num_threads()

    def make(cores: int, torch_threads: int, **env: str) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        for name in ("HIPRESS_THREADS", *LAUNCHERS):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        torch.set_num_threads(torch_threads)

    monkeypatch.setattr(parallelism, "_followed", [])
    yield make
    torch.set_num_threads(before)


@pytest.mark.pure
def test_a_rank_that_set_torch_to_one_thread_runs_its_kernels_on_one(node):
    node(cores=8, torch_threads=1)
    chosen = parallelism.threads()
    assert chosen.count == 1 and chosen.source == "torch.get_num_threads()"


@pytest.mark.pure
def test_hipress_threads_is_taken_as_it_is(node):
    node(cores=8, torch_threads=1, HIPRESS_THREADS="3")
    assert parallelism.count() == 3
    assert str(parallelism.threads()).startswith("3: HIPRESS_THREADS = 3")


@pytest.mark.pure
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_four_ranks_on_eight_allowed_cores_never_get_more_than_two_each(node, launcher):
    node(cores=8, torch_threads=8, **{launcher: "4"})
    chosen = parallelism.threads()
    assert chosen.count == 2 and chosen.ranks_per_node == 4 and chosen.ranks_from == launcher
    node(cores=8, torch_threads=1, **{launcher: "4"})
    assert parallelism.count() == 1


@pytest.mark.pure
def test_slurms_heterogeneous_layout_counts_the_first_nodes_tasks(node):
    node(cores=8, torch_threads=8, SLURM_NTASKS_PER_NODE="4(x2),2")
    assert parallelism.count() == 2


@pytest.mark.pure
def test_a_framework_without_a_setting_gets_the_cores_share(node):
    node(cores=6, torch_threads=4, LOCAL_WORLD_SIZE="2")
    parallelism.follow("tf.config.threading.get_intra_op_parallelism_threads()", lambda: 0)
    chosen = parallelism.threads()
    assert chosen.count == 3 and chosen.source == "cores"
    parallelism.follow("tf.config.threading.get_intra_op_parallelism_threads()", lambda: 2)
    assert parallelism.threads().source.startswith("tf.config") and parallelism.count() == 2


@pytest.mark.pure
@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_hipress_threads_is_a_config_error_naming_it(node, value):
    node(cores=2, torch_threads=1, HIPRESS_THREADS=value)
    with pytest.raises(ConfigError, match="HIPRESS_THREADS"):
        parallelism.threads()


#: A fresh process (the pool is the process's): encodes on the threads torch was given,
#: then with HIPRESS_THREADS=3, reporting the library's count, the pool's workers, the
#: process's threads, the payloads and the CPU time the process took between calls.
_PROBE = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import torch
    import hipress

    torch.set_num_threads(1)
    c = hipress.codec(sys.argv[1], target="cpu", seed=3)
    kernel = c._kernel("cpu")
    x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)
    tasks = lambda: len(os.listdir("/proc/self/task"))
    before = tasks()
    one = c.encode(x, step=0)
    report = {"one": [kernel.lib.hp_threads(), kernel.lib.hp_pool_workers(),
                      tasks() - before]}
    os.environ["HIPRESS_THREADS"] = "3"
    three = c.encode(x, step=0)
    report["three"] = [kernel.lib.hp_threads(), kernel.lib.hp_pool_workers(),
                       tasks() - before]
    report["same_bits"] = bool(np.array_equal(one, three))
    # the CPU the process takes in the 10 ms after each of 20 calls, while it sleeps
    idle = 0.0
    for _ in range(20):
        c.encode(x, step=0)
        start = time.process_time()
        time.sleep(0.01)
        idle += time.process_time() - start
    report["idle_cpu_s"] = idle
    print(json.dumps(report))
""")


@pytest.mark.cpu
@pytest.mark.parametrize("algorithm", ["onebit", "cgx", "dgc"])
def test_kernels_run_on_the_chosen_threads_and_idle_threads_sleep(algorithm):
    env = {k: v for k, v in os.environ.items() if k not in ("HIPRESS_THREADS", *LAUNCHERS)}
    proc = subprocess.run([sys.executable, "-c", _PROBE, algorithm], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    # torch.set_num_threads(1): one thread, and the pool never started a worker
    assert report["one"] == [1, 0, 0]
    # three threads: the caller and two workers, which stay (asleep) after the call
    assert report["three"] == [3, 2, 2]
    assert report["same_bits"], "the payload depends on the thread count"
    # The workers sleep between calls: at most microseconds of spinning after each. (With
    # OpenMP's teams, idle threads spun on 85 % of the 200 ms: 170 ms.)
    assert report["idle_cpu_s"] < 0.04, report
