"""Kernel benchmark: encode/decode throughput per algorithm and target.

Throughput is effective bandwidth, (bytes read + bytes written) / time, reported
as a ratio to ``numpy.copyto`` of the same tensor measured in the same run, so the
figures are comparable across noisy machines.

    python bench/kernels.py --size 4194304 --target ref
    hipress bench kernels --target ref
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import hipress
from hipress.codec import TARGETS

RESULTS = Path(__file__).resolve().parent / "results"


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(names: list[str], target: str, size: int, repeats: int) -> dict:
    """Time encode and decode of every algorithm on one float32 tensor."""
    r = np.random.default_rng(0)
    g = (r.standard_normal(size) * r.exponential(1.0, size)).astype(np.float32)
    dst = np.empty_like(g)
    copy_s = _median_seconds(lambda: np.copyto(dst, g), repeats)
    copy_bw = 2 * g.nbytes / copy_s
    rows = []
    for name in names:
        c = hipress.codec(name, target=target)
        payload = c.encode(g).copy()
        # Outputs are preallocated and reused, as numpy.copyto's destination is and as
        # CaSync's buffers are: the figures exclude first-touch page faults.
        enc_buf = np.empty(payload.size + payload.size // 4 + 64, dtype=np.uint8)
        dec_buf = np.empty(size, dtype=np.float32)
        enc_s = _median_seconds(lambda c=c, b=enc_buf: c.encode(g, step=0, out=b), repeats)
        dec_s = _median_seconds(lambda c=c, p=payload, b=dec_buf: c.decode(p, size, out=b),
                                repeats)
        moved = g.nbytes + payload.nbytes
        rows.append({
            "algorithm": name, "target": target, "elements": size,
            "payload_bytes": int(payload.nbytes),
            "encode_s": enc_s, "decode_s": dec_s,
            "encode_vs_copy": moved / enc_s / copy_bw,
            "decode_vs_copy": moved / dec_s / copy_bw,
        })
    return {"host": platform.node(), "elements": size, "copy_s": copy_s,
            "copy_GBps": copy_bw / 1e9, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hipress bench kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1 << 22, help="elements (default 2**22)")
    parser.add_argument("--target", default="ref", choices=TARGETS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--algorithms", nargs="*", default=hipress.algorithms())
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args(argv)

    console = Console()
    with console.status(f"timing {len(args.algorithms)} algorithms on {args.size:,} floats"):
        result = measure(args.algorithms, args.target, args.size, args.repeats)
    table = Table(title=f"encode/decode on {args.size:,} float32, target {args.target} "
                        f"(numpy.copyto: {result['copy_GBps']:.1f} GB/s read+write)")
    for col in ("algorithm", "payload", "encode ms", "decode ms", "enc/copy", "dec/copy"):
        table.add_column(col, justify="left" if col == "algorithm" else "right")
    for row in result["rows"]:
        table.add_row(row["algorithm"], f"{row['payload_bytes']:,}",
                      f"{row['encode_s'] * 1e3:.1f}", f"{row['decode_s'] * 1e3:.1f}",
                      f"{row['encode_vs_copy']:.3f}", f"{row['decode_vs_copy']:.3f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
