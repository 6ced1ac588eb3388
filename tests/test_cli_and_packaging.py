"""The hipress command, the plugin import names and what an installed wheel ships."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import hipress
from hipress.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_algorithms_command(capsys):
    assert main(["algorithms"]) == 0
    out = capsys.readouterr().out
    for name in hipress.algorithms():
        assert name in out
    assert "ratio=0.001" in out


def test_compile_reports_layout(capsys):
    assert main(["compile", str(ROOT / "dsl" / "minmax8.cll"), "-p", "bits=4"]) == 0
    out = capsys.readouterr().out
    assert "ok: minmax8 (params: bits=4)" in out
    assert "f32, f32, u4[n]" in out


def test_compile_error_is_file_line_col_without_traceback(tmp_path):
    bad = tmp_path / "bad.cll"
    bad.write_text("encode(g: f32[]) -> bytes:\n    let s = reduce(g, mux)\n")
    proc = subprocess.run([sys.executable, "-m", "hipress", "compile", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{bad}:2:23: reduce's operator must be sum, max or min")
    assert "Traceback" not in proc.stderr


def test_config_errors_exit_2(capsys):
    assert main(["compile", str(ROOT / "dsl" / "qsgd.cll"), "-p", "bits=3"]) == 2
    assert "bits must be 2, 4 or 8" in capsys.readouterr().err


def _hipress(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hipress", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


BAD_ARGUMENTS = [
    ["plan", "--nodes", "0", "--gpus", "0"], ["plan", "--gpus", "-2"],
    ["plan", "--backward-ms", "-5"], ["plan", "--backward-ms", "nan"],
    ["plan", "--algorithms", "nosuch"], ["plan", "--bandwidth", "fast"],
    ["profile", "--ranks", "1"], ["profile", "--reps", "0"],
    ["run", "-np", "2", "--timeout", "-5", "x.py"], ["run", "-np", "2", "--algorithm",
                                                     "nosuch", "x.py"],
    ["run", "-np", "0", "x.py"], ["run", "-np", "2", "--master-port", "70000", "x.py"],
    ["run", "-np", "2", "--join-timeout", "0", "x.py"],
    ["demo", "--ranks", "1"], ["demo", "--lr", "nan"], ["demo", "--algorithm", "zap"],
    ["bench", "kernels", "--size", "0"], ["bench", "kernels", "--algorithms", "nosuch"],
    ["bench", "sync", "--steps", "0"], ["bench", "sync", "--scale", "-1"],
    ["bench", "train", "--lr", "-1"], ["bench", "validate", "--ranks", "1"],
    ["bench", "simulate", "--nodes", "0"], ["bench", "nosuch"],
    ["bench", "diloco", "--ranks", "1"], ["bench", "diloco", "--delay", "-1"],
    ["bench", "trainers", "--steps", "3"], ["bench", "trainers", "--frameworks", "keras"],
    ["compile", str(ROOT / "dsl" / "dgc.cll"), "-p", "ratio"],
]


@pytest.mark.parametrize("args", BAD_ARGUMENTS, ids=[" ".join(a[:3]) for a in BAD_ARGUMENTS])
def test_every_subcommand_refuses_a_bad_value_in_one_line(args):
    proc = _hipress(*args)
    assert proc.returncode == 2, (args, proc.stdout[-500:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], proc.stderr


@pytest.mark.parametrize("data", [b"\xff\xfe\x00\x01binary", "encode() -> ¿\n".encode("latin-1")])
def test_compile_of_a_file_that_is_not_utf8_is_a_compile_error_at_1_1(tmp_path, data):
    bad = tmp_path / "bad.cll"
    bad.write_bytes(data)
    proc = _hipress("compile", str(bad))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{bad}:1:1: not UTF-8 text"), proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(hipress.CompileError, match="not UTF-8"):
        hipress.codec(str(bad))


def test_every_shipped_algorithm_has_a_torch_baseline():
    sys.path.insert(0, str(ROOT))
    from bench.baselines.torch_ops import BASELINES

    assert sorted(BASELINES) == hipress.algorithms()


@pytest.mark.cpu
def test_the_kernel_benchmark_runs_with_its_torch_baselines(tmp_path):
    """``make bench``'s command, on a small tensor, with every baseline; written to a file
    (not a terminal), the table keeps whole cells."""
    out = tmp_path / "kernels.json"
    proc = _hipress("bench", "kernels", "--size", "5000", "--repeats", "1", "--no-builds",
                    "--out", str(out), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = __import__("json").loads(out.read_text())["rows"]
    assert [r["algorithm"] for r in rows] == hipress.algorithms()
    assert all(r["vs_torch"] > 0 for r in rows)
    assert "…" not in proc.stdout and "threshold" in proc.stdout and "vs torch" in proc.stdout


@pytest.mark.parallel
def test_a_node_that_never_joins_is_named_within_the_join_timeout():
    """Two nodes on loopback: each alone gives up after --join-timeout naming the other;
    together they run the job."""
    import time

    from hipress.network import free_port

    port = free_port()

    def node(rank: int, timeout: float = 3.0) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "hipress", "run", "-np", "1", "--nnodes", "2",
             "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port",
             str(port), "--join-timeout", str(timeout), "python", "-c", "pass"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    for alone, missing in ((0, "node(s) 1 of 2 never joined within 3 s"),
                           (1, "node 0 (127.0.0.1:")):
        start = time.monotonic()
        proc = node(alone)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and missing in err, err[-2000:]
        assert time.monotonic() - start < 3 + 20
    both = [node(0, 60), node(1, 60)]
    for p in both:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]


def test_demo_prints_measured_rows(capsys):
    assert main(["demo", "--codecs", "--size", "5000"]) == 0
    out = capsys.readouterr().out
    for name in hipress.algorithms():
        assert name in out


def test_torch_plugin_imports_under_hipress():
    import hipress.torch as hp

    assert hp.torch.__name__ == "torch"


def test_missing_framework_gives_an_install_hint():
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "try:\n    import hipress.mxnet\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.startswith("ConfigError hipress.mxnet needs mxnet")
    assert "pip install" in out


@pytest.mark.slow
def test_wheel_ships_dsl_files_and_plugins(tmp_path):
    # Built from a copy of what a wheel is made of: setuptools never empties ``build/``,
    # so a checkout's stale build output would otherwise ship with it.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("hipress_base", "hipress", "compll", "casync", "plugins", "dsl"):
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(src)],
        capture_output=True, text=True,
    )
    if proc.returncode and "setuptools" in proc.stderr and "No module" in proc.stderr:
        pytest.skip("setuptools is not installed in this environment")
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("hipress-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for algo in hipress.algorithms():
        assert f"hipress/dsl/{algo}.cll" in names
    assert "hipress/torch/__init__.py" in names
    assert "compll/grammar.lark" in names
    assert "compll/templates/emu/cuda_runtime.h" in names  # the cuda-emu target's runtime
    assert "hipress_base/errors.py" in names and "hipress/errors.py" in names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info",
                                                                            ".data"))}
    assert tops == {"hipress_base", "hipress", "compll", "casync"}, tops  # no modules


@pytest.mark.cpu
def test_compile_emits_and_builds(tmp_path, capsys):
    assert main(["compile", str(ROOT / "dsl" / "onebit.cll"), "--target", "cpu",
                 "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"library: {tmp_path}" in out
    assert (tmp_path / "onebit.so").exists() and (tmp_path / "onebit.cpp").exists()
    assert main(["compile", str(ROOT / "dsl" / "onebit.cll"), "--target", "cuda-emu",
                 "-o", str(tmp_path / "emu")]) == 0
    assert "cuda-emu: built" in capsys.readouterr().out
    assert (tmp_path / "emu" / "onebit.so").exists() and (tmp_path / "emu" / "onebit.cu").exists()


#: The layers, lowest first: each may import only those before it.
LAYERS = ("hipress_base", "compll", "casync", "hipress")


@pytest.mark.parametrize("module,forbidden", [
    ("hipress_base", ("compll", "casync", "hipress")),  # the ground floor: errors, version
    ("compll", ("casync", "hipress")),                  # the compiler imports nothing above
    ("hipress.errors", ("compll", "casync")),           # what users catch loads no layer
    ("hipress", ("compll", "casync")),                  # the facade loads them on first use
    ("casync", ("hipress",)),                           # the engine: compll and the base
    ("casync.model", ("hipress",)),                     # the cost model likewise
])
def test_layers_import_only_the_layers_below(module, forbidden):
    code = (f"import sys, {module}\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_cost_model_never_imports_the_engine():
    """``casync.model`` prices and plans steps; the engine imports its planner, never the
    other way round (the profiler is handed the engine's step timer)."""
    import ast

    engine = {"synchronizer", "hierarchy", "interface", "executor", "steps", "staging",
              "nodelevels", "settings", "links", "codecs"}
    wrong = []
    for path in sorted((ROOT / "casync" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level != 1 else []
                if node.level == 2 and node.module is None:
                    names = [a.name for a in node.names]
                elif node.level == 2:
                    names = [node.module.split(".")[0]]
                elif node.level == 0 and (node.module or "").startswith("casync."):
                    names = [node.module.split(".")[1]]
                wrong += [f"{path.name}: {n}" for n in names if n in engine]
    assert not wrong, wrong


def test_the_runtime_path_leaves_the_test_hosts_out():
    """A training process (the torch plugin, the engine) never loads the module that
    builds shaped test networks."""
    code = "import sys, hipress.torch\nprint('hipress.hosts' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == "False"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever in the file (lazy imports included)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_module_of_a_layer_imports_one_above_it(layer):
    above = LAYERS[LAYERS.index(layer) + 1:]
    wrong = {f"{path.relative_to(ROOT)}: {name}"
             for path in sorted((ROOT / layer).rglob("*.py"))
             for name in _imports(path) if name.split(".")[0] in above}
    assert not wrong, sorted(wrong)


def test_errors_are_named_as_users_import_them_and_nothing_else_is_installed():
    code = ("import hipress, pickle\n"
            "e = pickle.loads(pickle.dumps(hipress.SyncError('x')))\n"
            "print(hipress.SyncError.__module__, type(e).__module__, hipress.__version__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.split()[:2] == ["hipress.errors", "hipress.errors"]
    assert not list(ROOT.glob("hipress*.py"))  # no top-level modules beside the packages


def test_the_facade_re_exports_the_compiler_on_first_use():
    assert hipress.codec("onebit", target="ref").name == "onebit"
    assert "onebit" in hipress.algorithms() and hipress.Codec.__module__ == "compll.codec"
    assert hipress.SyncError.__mro__[1] is hipress.HiPressError


def test_the_examples_read_scikit_learns_own_digits():
    """The examples read the digits' CSV straight from scikit-learn's folder (its import
    costs every rank seconds): the same images and labels, to the bit."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from _digits import load_digits
    finally:
        sys.path.remove(str(ROOT / "examples"))
    x, y = load_digits()
    reference = sklearn_digits()
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (1797, 64)
    assert x.tobytes() == (reference.data / 16.0).astype(np.float32).tobytes()
    assert y.tobytes() == reference.target.astype(np.int64).tobytes()


def test_interface_to_finds_the_route_to_an_address():
    from hipress.network import interface_to

    assert interface_to("127.0.0.1") == "lo"
    assert interface_to("no-such-host.invalid") is None


_TWO_NODES = """
import os, sys
import torch, torch.distributed as dist
import hipress.torch as hp
hp.init()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
open(sys.argv[1] + f"/rank{dist.get_rank()}", "w").write(
    f"{t.item()} {os.environ.get('GLOO_SOCKET_IFNAME')}")
hp.shutdown()
"""


def _node_command(launcher: str, r: int, addrs: list[str], port: str,
                  job: list[str]) -> list[str]:
    """Node ``r``'s command as README and docs/benchmarks.md write it."""
    if launcher == "hipress run":
        return [sys.executable, "-m", "hipress", "run", "-np", "1", "--nnodes", "2",
                "--node-rank", str(r), "--master-addr", addrs[0], "--master-port", port,
                "--join-timeout", "60", *job]
    # torchrun's c10d rendezvous, with the two options a node whose hostname does not
    # name it needs (docs/benchmarks.md, "Cluster mode")
    return [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{addrs[0]}:{port}", "--rdzv-id", "job", "--local-addr", addrs[r],
            "--rdzv-conf", f"is_host={int(r == 0)}", *job]


@pytest.mark.parallel
@pytest.mark.parametrize("launcher", ["hipress run", "torchrun"])
def test_two_nodes_join_on_the_interface_that_routes_to_node_0(tmp_path, launcher):
    """Two network namespaces as two nodes whose hostname resolves to loopback: as the
    README writes the command, without GLOO_SOCKET_IFNAME, each node's rank binds to its
    route to node 0 (``hipress run``, or ``hp.init`` under torchrun) and the job runs."""
    import os

    from hipress.hosts import shaped
    from hipress.network import free_port

    script = tmp_path / "job.py"
    script.write_text(_TWO_NODES)
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env["PYTHONPATH"] = str(ROOT)
    port = str(free_port())
    with shaped(2, "1gbit") as hosts:
        addrs = [h.addr for h in hosts]
        procs = [subprocess.Popen([*h.prefix, *_node_command(launcher, r, addrs, port,
                                                             [str(script), str(tmp_path)])],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True)
                 for r, h in enumerate(hosts)]
        try:
            logs = [p.communicate(timeout=240)[0] for p in procs]
        finally:  # a job that hangs must not outlive its namespaces
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    for r, h in enumerate(hosts):
        total, ifname = (tmp_path / f"rank{r}").read_text().split()
        assert float(total) == 3.0 and ifname == h.ifname
