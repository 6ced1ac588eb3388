"""Kernel benchmark: encode/decode throughput per algorithm and target.

Every figure is a ratio against a reference measured in the same run:

* vs copy: effective bandwidth, (bytes read + bytes written) / time, divided by that of
  ``numpy.copyto`` on the same tensor. Outputs are preallocated and reused, as the
  copy's destination is and as CaSync's buffers are (no first-touch page faults).
* vs torch: time of the idiomatic torch-ops implementation in ``bench/baselines``
  divided by ours (encode + decode).
* dgc and topk encode against ``torch.topk`` of the same k on the same tensor.
* first build of each kernel (fresh cache) and a cached load.

    hipress bench kernels                       # 25M floats, target cpu
    hipress bench kernels --sweep               # also 2**10 .. 2**26, plotted
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import hipress
from hipress.codec import TARGETS

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gradient(size: int) -> np.ndarray:
    """Heavy-tailed values at the scale of real gradients (~1e-3), which is the scale the
    defaults of threshold-based codecs (tbq, threshold: tau = 0.01) are meant for."""
    r = np.random.default_rng(0)
    return (r.standard_normal(size) * r.exponential(1.0, size) * 1e-3).astype(np.float32)


def copy_bandwidth(g: np.ndarray, repeats: int) -> float:
    dst = np.empty_like(g)
    return 2 * g.nbytes / _median_seconds(lambda: np.copyto(dst, g), repeats)


def time_codec(name: str, target: str, g: np.ndarray, repeats: int) -> dict:
    c = hipress.codec(name, target=target)
    payload = c.encode(g).copy()
    enc_buf = np.empty(payload.size + payload.size // 4 + 64, dtype=np.uint8)
    dec_buf = np.empty(g.size, dtype=np.float32)
    enc_s = _median_seconds(lambda: c.encode(g, step=0, out=enc_buf), repeats)
    dec_s = _median_seconds(lambda: c.decode(payload, g.size, out=dec_buf), repeats)
    return {"payload_bytes": int(payload.nbytes), "encode_s": enc_s, "decode_s": dec_s,
            "moved_bytes": int(g.nbytes + payload.nbytes)}


def time_torch(name: str, g: np.ndarray, repeats: int) -> dict:
    import torch

    from bench.baselines.torch_ops import BASELINES

    enc, dec = BASELINES[name]
    x = torch.from_numpy(g)
    payload = enc(x)
    return {"torch_encode_s": _median_seconds(lambda: enc(x), repeats),
            "torch_decode_s": _median_seconds(lambda: dec(payload, x.numel()), repeats)}


def time_torch_topk(g: np.ndarray, ratio: float, repeats: int) -> float:
    import torch

    x = torch.from_numpy(g)
    k = max(1, int(g.size * ratio))
    return _median_seconds(lambda: torch.topk(x.abs(), k, sorted=False), repeats)


def build_times(names: list[str], target: str) -> dict:
    """First build into a fresh cache, then a cached load, per algorithm."""
    from compll import load
    from compll.build import build
    from compll.loaders import load_kernel

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("HIPRESS_CACHE_DIR")
        os.environ["HIPRESS_CACHE_DIR"] = cache
        try:
            for name in names:
                t0 = time.perf_counter()
                build(load(name), target)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                load_kernel(load(name), target)
                out[name] = {"first_build_s": first, "cached_load_s": time.perf_counter() - t0}
        finally:
            if old is None:
                os.environ.pop("HIPRESS_CACHE_DIR", None)
            else:
                os.environ["HIPRESS_CACHE_DIR"] = old
    return out


def sweep(names: list[str], target: str, repeats: int) -> dict:
    rows: dict[str, list] = {n: [] for n in names}
    for exp in range(10, 27, 2):
        g = gradient(2**exp)
        bw = copy_bandwidth(g, repeats)
        for name in names:
            t = time_codec(name, target, g, repeats)
            rows[name].append({"elements": 2**exp,
                               "encode_vs_copy": t["moved_bytes"] / t["encode_s"] / bw,
                               "decode_vs_copy": t["moved_bytes"] / t["decode_s"] / bw})
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = 2 if "sweep" in result else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    names = [r["algorithm"] for r in rows]
    pos = np.arange(len(names))
    ax.bar(pos - 0.2, [r["encode_vs_copy"] for r in rows], 0.4, label="encode")
    ax.bar(pos + 0.2, [r["decode_vs_copy"] for r in rows], 0.4, label="decode")
    ax.axhline(0.6, color="k", lw=0.8, ls="--", label="0.6 x copy")
    ax.set_xticks(pos, names, rotation=45, ha="right")
    ax.set_ylabel("effective bandwidth / numpy.copyto")
    ax.set_yscale("log")
    ax.set_title(f"{result['elements']:,} float32, target {result['target']}")
    ax.legend()
    if panels == 2:
        ax = axes[0][1]
        for name, pts in result["sweep"].items():
            ax.plot([p["elements"] for p in pts], [p["encode_vs_copy"] for p in pts], label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("elements")
        ax.set_ylabel("encode bandwidth / numpy.copyto")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hipress bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=25_000_000)
    parser.add_argument("--target", default="cpu", choices=[t for t in TARGETS if t != "auto"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--algorithms", nargs="*", default=hipress.algorithms())
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    parser.add_argument("--sweep", action="store_true", help="also sweep 2**10 .. 2**26")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args(argv)

    console = Console()
    g = gradient(args.size)
    result: dict = {"host": platform.node(), "target": args.target, "elements": args.size,
                    "threads": os.cpu_count(), "rows": []}
    with console.status("building kernels"):
        builds = build_times(args.algorithms, args.target) if args.target != "ref" else {}
    with console.status("timing numpy.copyto"):
        bw = copy_bandwidth(g, args.repeats)
    result["copy_GBps"] = bw / 1e9
    for name in args.algorithms:
        with console.status(f"timing {name}"):
            row = {"algorithm": name, **time_codec(name, args.target, g, args.repeats)}
            row["encode_vs_copy"] = row["moved_bytes"] / row["encode_s"] / bw
            row["decode_vs_copy"] = row["moved_bytes"] / row["decode_s"] / bw
            row.update(builds.get(name, {}))
            if not args.no_torch:
                row.update(time_torch(name, g, args.repeats))
                row["vs_torch"] = (row["torch_encode_s"] + row["torch_decode_s"]) / (
                    row["encode_s"] + row["decode_s"])
                if name in ("dgc", "topk"):
                    topk_s = time_torch_topk(g, hipress.codec(name, target="ref").params["ratio"],
                                             args.repeats)
                    row["vs_torch_topk"] = topk_s / row["encode_s"]
        result["rows"].append(row)
    if args.sweep:
        with console.status("sweeping sizes"):
            result["sweep"] = sweep(args.algorithms, args.target, max(3, args.repeats // 2))

    table = Table(title=f"encode/decode on {args.size:,} float32, target {args.target}; "
                        f"numpy.copyto {result['copy_GBps']:.1f} GB/s (read+write)")
    cols = ["algorithm", "payload", "enc ms", "dec ms", "enc/copy", "dec/copy", "vs torch",
            "vs topk", "build s", "load ms"]
    for col in cols:
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    for r in result["rows"]:
        table.add_row(
            r["algorithm"], f"{r['payload_bytes']:,}", f"{r['encode_s'] * 1e3:.1f}",
            f"{r['decode_s'] * 1e3:.1f}", f"{r['encode_vs_copy']:.2f}",
            f"{r['decode_vs_copy']:.2f}",
            f"{r['vs_torch']:.1f}x" if "vs_torch" in r else "-",
            f"{r['vs_torch_topk']:.1f}x" if "vs_torch_topk" in r else "-",
            f"{r['first_build_s']:.1f}" if "first_build_s" in r else "-",
            f"{r['cached_load_s'] * 1e3:.0f}" if "cached_load_s" in r else "-",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
