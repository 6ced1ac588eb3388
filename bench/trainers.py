"""HiPress inside the trainers people use: its speed-up over plain DDP within each.

``examples/trainers_train.py`` (the byte-level GPT, AdamW, 2 sequences per rank) as a
user writes it for each framework — a plain DDP loop, Lightning, Accelerate,
``transformers.Trainer`` — run with plain DDP and with HiPress's one added line, each rank
a shaped test host launched one process per host with nothing exported (the script calls
``torch.set_num_threads`` with its share of the cores). The table gives samples/s after
the warm-up steps, HiPress's speed-up inside each framework, and that speed-up against the
plain loop's (1.00 = the framework costs HiPress nothing).

    sudo hipress bench trainers                      # 2 ranks, 1 Gbit/s
    sudo hipress bench trainers --frameworks loop lightning --steps 40
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._report import write_json  # noqa: E402
from hipress.cliargs import Parser, count, rate  # noqa: E402
from hipress.launcher import run_shaped  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
FRAMEWORKS = ["loop", "lightning", "accelerate", "trainer"]
MODULES = {"lightning": "lightning", "accelerate": "accelerate", "trainer": "transformers"}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench trainers", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=count(2), default=2)
    parser.add_argument("--bandwidth", type=rate, default="1gbit")
    parser.add_argument("--frameworks", nargs="+", default=FRAMEWORKS, choices=FRAMEWORKS)
    parser.add_argument("--steps", type=count(8), default=30)
    parser.add_argument("--warmup", type=count(1), default=5)
    parser.add_argument("--width", type=count(6), default=384,
                        help="the GPT's width (a multiple of its 6 heads)")
    parser.add_argument("--layers", type=count(1), default=6)
    parser.add_argument("--threads", type=count(1),
                        help="torch.set_num_threads per rank (default: cores / ranks)")
    parser.add_argument("--out", type=Path, default=RESULTS / "trainers.json")
    args = parser.parse_args(argv)
    if args.warmup >= args.steps - 1:
        parser.error(f"--warmup ({args.warmup}) must leave steps to time (--steps "
                     f"{args.steps})")
    missing = [f for f in args.frameworks
               if f in MODULES and importlib.util.find_spec(MODULES[f]) is None]
    if missing:
        parser.error(f"not installed: {', '.join(MODULES[f] for f in missing)} (pip "
                     "install '.[trainers]')")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.ranks)
    frameworks = ["loop", *(f for f in dict.fromkeys(args.frameworks) if f != "loop")]
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for framework in frameworks:
        row = {"framework": framework}
        for hipress in (False, True):
            metrics = args.out.parent / f"trainers-{framework}-{int(hipress)}.json"
            metrics.unlink(missing_ok=True)
            print(f"== {framework}{' + HiPress' if hipress else ''}", flush=True)
            command = [str(HERE.parent / "examples" / "trainers_train.py"), "--framework",
                       framework, "--steps", str(args.steps), "--warmup", str(args.warmup),
                       "--width", str(args.width), "--layers", str(args.layers),
                       "--threads", str(args.threads), "--metrics", str(metrics),
                       *(["--hipress"] if hipress else [])]
            code = run_shaped(args.ranks, args.bandwidth, command)
            if code or not metrics.exists():
                print(f"{framework} failed with exit code {code}", file=sys.stderr)
                return 1
            row["hipress" if hipress else "ddp"] = json.loads(metrics.read_text())
        rows.append(row)
    report(rows, args)
    return 0


def report(rows: list[dict], args: argparse.Namespace) -> None:
    from rich.table import Table

    loop = rows[0]["hipress"]["samples_per_s"] / rows[0]["ddp"]["samples_per_s"]
    table = Table(title=f"{args.ranks} ranks, {args.bandwidth} shaped links, "
                        f"{rows[0]['ddp']['params']:,}-parameter GPT, {args.steps} steps "
                        f"({args.warmup} warm-up)")
    for col in ("framework", "DDP samples/s", "HiPress samples/s", "speed-up",
                "vs the plain loop's", "HiPress MB sent/step"):
        table.add_column(col, justify="left" if col == "framework" else "right")
    for row in rows:
        ddp, hp = row["ddp"]["samples_per_s"], row["hipress"]["samples_per_s"]
        row["speedup"] = hp / ddp
        row["vs_loop"] = row["speedup"] / loop
        table.add_row(row["framework"], f"{ddp:.2f}", f"{hp:.2f}", f"{hp / ddp:.2f}x",
                      f"{row['vs_loop']:.2f}",
                      f"{row['hipress']['bytes_sent'] / row['hipress']['steps'] / 1e6:.2f}")
    make_console(120).print(table)
    write_json(args, rows=rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
