"""Kernel benchmark: encode/decode throughput per algorithm and target.

Every figure is a ratio against a reference measured in the same run:

* vs copy: effective bandwidth, (bytes read + bytes written) / time, divided by that of
  ``numpy.copyto`` on the same tensor. Outputs are preallocated and reused, as the
  copy's destination is and as CaSync's buffers are (no first-touch page faults).
  Each round times the copy, the encode, the decode and the torch baselines in turn,
  and every figure is a median over rounds, so noise from outside the VM lands on the
  reference and the subject alike.
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
from rich.table import Table

import hipress
from compll import TARGETS
from hipress.cliargs import Parser, algorithm, count
from hipress.output import console as make_console  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, timed in turn in every round, so that a burst of
    noise from outside this VM slows the reference and the subject alike."""
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults and lazy initialisation
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def gradient(size: int) -> np.ndarray:
    """Heavy-tailed values at the scale of real gradients (~1e-3), which is the scale the
    defaults of threshold-based codecs (tbq, threshold: tau = 0.01) are meant for."""
    r = np.random.default_rng(0)
    return (r.standard_normal(size) * r.exponential(1.0, size) * 1e-3).astype(np.float32)


def torch_baseline(name: str) -> tuple[Callable[..., object], Callable[..., object]] | None:
    """The idiomatic torch (encode, decode) of a shipped algorithm; None for a ``.cll``
    file of the user's (no baseline to compare with)."""
    from bench.baselines.torch_ops import BASELINES

    return BASELINES.get(name)


def time_codec(name: str, target: str, g: np.ndarray, repeats: int,
               torch_baselines: bool = False) -> dict:
    """Encode and decode times, timed in turn with ``numpy.copyto`` of the same tensor
    (``copy_Bps``: its effective bandwidth, read + write, in those rounds) and, with
    ``torch_baselines``, with the idiomatic torch implementation (and ``torch.topk`` for
    the top-k codecs)."""
    c = hipress.codec(name, target=target)
    payload = c.encode(g).copy()
    enc_buf = np.empty(payload.size + payload.size // 4 + 64, dtype=np.uint8)
    dec_buf = np.empty(g.size, dtype=np.float32)
    dst = np.empty_like(g)
    fns: dict[str, Callable[[], object]] = {
        "copy": lambda: np.copyto(dst, g),
        "encode": lambda: c.encode(g, step=0, out=enc_buf),
        "decode": lambda: c.decode(payload, g.size, out=dec_buf)}
    baseline = torch_baseline(name) if torch_baselines else None
    if baseline is not None:
        import torch

        enc, dec = baseline
        x = torch.from_numpy(g)
        torch_payload = enc(x)
        fns["torch_encode"] = lambda: enc(x)
        fns["torch_decode"] = lambda: dec(torch_payload, x.numel())
        if name in ("dgc", "topk"):
            k = max(1, int(g.size * hipress.codec(name, target="ref").params["ratio"]))
            fns["torch_topk"] = lambda: torch.topk(x.abs(), k, sorted=False)
    t = _interleaved(fns, repeats)
    row = {"payload_bytes": int(payload.nbytes), "encode_s": t["encode"],
           "decode_s": t["decode"], "moved_bytes": int(g.nbytes + payload.nbytes),
           "copy_Bps": 2 * g.nbytes / t["copy"]}
    row["encode_vs_copy"] = row["moved_bytes"] / row["encode_s"] / row["copy_Bps"]
    row["decode_vs_copy"] = row["moved_bytes"] / row["decode_s"] / row["copy_Bps"]
    if baseline is not None:
        row["torch_encode_s"], row["torch_decode_s"] = t["torch_encode"], t["torch_decode"]
        row["vs_torch"] = (t["torch_encode"] + t["torch_decode"]) / (t["encode"] + t["decode"])
        if "torch_topk" in t:
            row["vs_torch_topk"] = t["torch_topk"] / t["encode"]
    return row


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
        for name in names:
            t = time_codec(name, target, g, repeats)
            rows[name].append({"elements": 2**exp, "encode_vs_copy": t["encode_vs_copy"],
                               "decode_vs_copy": t["decode_vs_copy"]})
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
    parser = Parser(prog="hipress bench kernels", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=count(1), default=25_000_000)
    parser.add_argument("--target", default="cpu", choices=[t for t in TARGETS if t != "auto"])
    parser.add_argument("--repeats", type=count(1), default=5)
    parser.add_argument("--algorithms", nargs="*", type=algorithm, default=hipress.algorithms())
    parser.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    parser.add_argument("--no-builds", action="store_true",
                        help="skip timing each kernel's first build in a fresh cache")
    parser.add_argument("--sweep", action="store_true", help="also sweep 2**10 .. 2**26")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args(argv)

    console = make_console()
    g = gradient(args.size)
    result: dict = {"host": platform.node(), "target": args.target, "elements": args.size,
                    "threads": os.cpu_count(), "rows": []}
    with console.status("building kernels"):
        builds = build_times(args.algorithms, args.target) \
            if args.target != "ref" and not args.no_builds else {}
    for name in args.algorithms:
        with console.status(f"timing {name}"):
            row = {"algorithm": name, **time_codec(name, args.target, g, args.repeats,
                                                   torch_baselines=not args.no_torch)}
            row.update(builds.get(name, {}))
        result["rows"].append(row)
    result["copy_GBps"] = statistics.median(r["copy_Bps"] for r in result["rows"]) / 1e9
    if args.sweep:
        with console.status("sweeping sizes"):
            result["sweep"] = sweep(args.algorithms, args.target, max(3, args.repeats // 2))

    table = Table(title=f"encode/decode on {args.size:,} float32, target {args.target}; "
                        f"numpy.copyto {result['copy_GBps']:.1f} GB/s (read+write, "
                        f"median of the rows)")
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
    missing = [n for n in args.algorithms if torch_baseline(n) is None]
    if missing and not args.no_torch:
        console.print(f"no idiomatic torch baseline for {', '.join(missing)} (vs torch: -)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    console.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
