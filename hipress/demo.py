"""``hipress demo``: DDP against HiPress on 4 local ranks; ``--codecs``: every algorithm
round-tripping one gradient."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from casync.settings import default_algorithm
from casync.transport import parse_rate
from compll import algorithms, codec, load

from .errors import ConfigError
from .launcher import run, run_shaped
from .output import console as make_console

__all__ = ["run_roundtrip_demo", "run_training_demo"]


def run_roundtrip_demo(size: int, seed: int) -> int:
    """Encode and decode a synthetic gradient with every algorithm; print a table.

    Every figure is measured in this run, with the compiled C++ kernels (built on
    first use and cached) and, for comparison, the NumPy reference interpreter that they
    match bit for bit.
    """
    console = make_console()
    rng = np.random.default_rng(seed)
    # A heavy-tailed gradient, as real ones are: most entries small, a few large.
    g = (rng.standard_normal(size) * rng.exponential(1.0, size) * 1e-3).astype(np.float32)
    table = Table(title=f"CompLL round trip on {size:,} float32 elements (compiled kernels)")
    for col in ("algorithm", "bytes", "vs fp32", "rel err", "bias", "enc ms", "dec ms",
                "ref ms"):
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    norm = float(np.linalg.norm(g))
    unbiased = []
    with console.status("round-tripping...") as status:
        for name in algorithms():
            status.update(f"round-tripping {name}...")
            status.update(f"building and round-tripping {name}...")
            c = codec(name, target="cpu", seed=seed)
            if c.program.unbiased:
                unbiased.append(name)
            t0 = time.perf_counter()
            payload = c.encode(g)
            t1 = time.perf_counter()
            out = c.decode(payload, size)
            t2 = time.perf_counter()
            ref = codec(name, target="ref", seed=seed)
            r0 = time.perf_counter()
            ref.decode(ref.encode(g), size)
            ref_ms = (time.perf_counter() - r0) * 1e3
            err = out.astype(np.float64) - g
            table.add_row(
                name, f"{payload.size:,}", f"{payload.size / (4 * size):.4f}",
                f"{np.linalg.norm(err) / norm:.3f}", f"{err.mean():+.2e}",
                f"{(t1 - t0) * 1e3:.1f}", f"{(t2 - t1) * 1e3:.1f}", f"{ref_ms:.0f}",
            )
    console.print(table)
    console.print(
        "rel err = ||decode(encode(g)) - g|| / ||g||; bias = mean of the error; "
        "ref ms = encode + decode in the NumPy reference interpreter. "
        f"Unbiased by declaration: {', '.join(unbiased)}; the others rely on error feedback."
    )
    return 0


def _repo_file(*parts: str) -> Path:
    path = Path(__file__).resolve().parent.parent.joinpath(*parts)
    if not path.exists():
        raise ConfigError(f"{path} is missing: the training demo runs from a clone of the "
                          "HiPress repository (make demo)")
    return path


def run_training_demo(ranks: int = 4, bandwidth: str = "1gbit", algorithm: str | None = None,
                      epochs: int = 3, width: int = 2048, batch: int = 16, lr: float = 0.05,
                      shaped: bool = False, out: Path | None = None) -> int:
    """Train examples/torch_train.py twice — plain DDP, then HiPress — and compare.

    Both runs use the same ranks, model, data and link: a software-paced uplink of
    ``bandwidth`` per rank (emulation), or with ``shaped`` real namespaces and tc links.
    HiPress runs as ``HookState()`` gives it to a user who chooses nothing, unless
    ``algorithm`` is given. Its kernels are built first, not inside the timed steps (a
    first run compiles them, once).
    """
    parse_rate(bandwidth)
    console = make_console(max(Console().width, 100))
    script = _repo_file("examples", "torch_train.py")
    out = out or _repo_file("bench") / "results" / "demo"
    out.mkdir(parents=True, exist_ok=True)
    link = (f"{bandwidth} per rank, shaped with tc in network namespaces" if shaped else
            f"{bandwidth} per rank, software-paced in the transport (emulation)")
    chosen = algorithm or default_algorithm()
    console.rule("[bold]HiPress demo")
    console.print(f"{ranks} local ranks train a {width}-wide MLP on scikit-learn's digits "
                  f"for {epochs} epochs, {batch} samples per rank per step.\nLink: {link}.")
    _build_first(console, chosen)
    hipress = ["--sync", "hook"] + (["--algorithm", algorithm] if algorithm else [])
    runs = [("plain DDP", ["--sync", "ddp"]),
            (f"HiPress {chosen}{'' if algorithm else ' (default)'}", hipress)]
    results = []
    for label, extra in runs:
        console.print(f"\n[bold]{label}[/bold]")
        log = out / (extra[1] + ".json")
        log.unlink(missing_ok=True)
        args = [str(script), *extra, "--epochs", str(epochs), "--width", str(width),
                "--batch", str(batch), "--lr", str(lr), "--metrics", str(log)]
        code = run_shaped(ranks, bandwidth, args) if shaped else \
            run(ranks, args, bandwidth=bandwidth)
        if code != 0 or not log.exists():
            console.print(f"[red]{label} failed (exit code {code})")
            return 1
        results.append((label, json.loads(log.read_text())))

    base, base_all = results[0][1]["steady_samples_per_s"], results[0][1]["samples_per_s"]
    warm = results[0][1]["warmup_steps"]
    table = Table(title=f"{ranks} ranks, {results[0][1]['params']:,} parameters, {link}")
    for col in ("run", "samples/s", "speedup", "all steps", "speedup ", "MB sent/step/rank",
                "held-out loss", "accuracy", "replicas identical"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for label, r in results:
        table.add_row(label, f"{r['steady_samples_per_s']:.0f}",
                      f"{r['steady_samples_per_s'] / base:.2f}x", f"{r['samples_per_s']:.0f}",
                      f"{r['samples_per_s'] / base_all:.2f}x",
                      f"{r['bytes_per_step'] / 1e6:.2f}", f"{r['heldout_loss']:.3f}",
                      f"{r['accuracy']:.3f}", "yes" if r["replicas_identical"] else "NO")
    console.print()
    console.print(table)
    console.print(f"samples/s: the steady rate after {warm} warm-up steps (one-time set-up: "
                  "DDP's buckets, HiPress's engine); all steps: from the first step. "
                  "held-out loss: on digits neither run trained on.")
    plot = out / "loss.png"
    _plot_losses(results, plot)
    console.print(f"loss against wall-clock time: {plot}")
    return 0


def _build_first(console: Console, algorithm: str) -> None:
    """Build (or find in the cache) the CPU kernels of ``algorithm`` before anything is
    timed, saying so when it is a first run."""
    from compll.build import build

    program = load(algorithm)
    with console.status(f"building the {program.name} kernels (a first run only)..."):
        artifact = build(program, "cpu")
    if not artifact.cached:
        console.print(f"built the {program.name} kernels in {artifact.seconds:.1f} s "
                      "(cached for later runs)")


def _plot_losses(results: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results:
        t, loss = zip(*r["losses"], strict=True)
        ax.plot(t, loss, label=f"{label}: {r['samples_per_s']:.0f} samples/s")
    ax.set_xlabel("wall-clock seconds")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title("same model, data and link")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
