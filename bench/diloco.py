"""Low-communication training benchmark: time to DDP's held-out loss across slow links.

The byte-level transformer (``examples/torch_train.py --model transformer``, 4 blocks of
width 240 by default: 2.85M parameters) on the Python standard library's source, each
rank a replica in its own network namespace behind a shaped link, launched one process
per host with nothing exported (each script takes its share of the cores with
``--threads``). Per link rate (``--bandwidths``):

- **DDP**: plain DDP every step, ``--steps`` steps; its held-out loss at the end (the mean
  of its last ``SMOOTH`` scores) is the target.
- **DDP + HiPress**: DDP with ``HookState()`` (per-step compression), until the target or
  ``--patience`` times DDP's steps.
- **DiLoCo fp32**: ``hp.DiLoCo(..., algorithm="none")``: H inner AdamW steps, then a plain
  float32 all-reduce of the pseudo-gradients (what torchft's DiLoCo does on CPUs) and the
  outer Nesterov step; **HiPress DiLoCo**: the same with HiPress's default codec;
  **HiPress Streaming DiLoCo**: with ``--fragments`` fragments whose averaging overlaps
  ``--delay`` inner steps. The DiLoCo methods train ``--diloco-steps`` steps each (the
  same tokens), scored on the global model every H steps.

The table gives the time to the target against DDP and DiLoCo fp32, the held-out loss
after the DiLoCo methods' steps against DiLoCo fp32's (equal tokens), bytes sent per inner
step, and the share of the outer averaging's time that inner steps hid. One plot per link
rate: held-out loss against training time.

    sudo hipress bench diloco                        # 2 replicas, 100 Mbit/s and 1 Gbit/s
    sudo hipress bench diloco --ranks 4 --bandwidths 100mbit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._report import write_json  # noqa: E402
from bench.train import loss_at, plot_curve, target_loss, time_to  # noqa: E402
from hipress.cliargs import Parser, count, number, rate  # noqa: E402
from hipress.launcher import run_shaped  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
DDP, FP32 = "DDP", "DiLoCo fp32"
METHODS = ["DDP", "DDP + HiPress", "DiLoCo fp32", "HiPress DiLoCo", "HiPress Streaming DiLoCo"]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench diloco", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=count(2), default=2, help="replicas, a rank each")
    parser.add_argument("--bandwidths", nargs="+", type=rate, default=["100mbit", "1gbit"])
    parser.add_argument("--dim", type=count(6), default=240,
                        help="the transformer's width (a multiple of its 6 heads)")
    parser.add_argument("--layers", type=count(1), default=4)
    parser.add_argument("--batch", type=count(1), default=2, help="sequences per rank")
    parser.add_argument("--steps", type=count(1), default=150, help="DDP's steps")
    parser.add_argument("--diloco-steps", type=count(1), default=600,
                        help="each DiLoCo method's inner steps")
    parser.add_argument("--patience", type=number(minimum=1.0), default=1.5,
                        help="DDP + HiPress trains up to this many times DDP's steps")
    parser.add_argument("--sync-every", type=count(1), default=20, help="H")
    parser.add_argument("--fragments", type=count(1), default=4)
    parser.add_argument("--delay", type=count(0), default=2)
    parser.add_argument("--eval-every", type=count(1), default=20)
    parser.add_argument("--threads", type=count(1),
                        help="torch.set_num_threads per rank (default: cores / ranks)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--out", type=Path, default=RESULTS / "diloco.json")
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.ranks)
    methods = [DDP, *(m for m in dict.fromkeys(args.methods) if m != DDP)]
    results: dict[str, list[dict]] = {}
    for bandwidth in args.bandwidths:
        rows: list[dict] = []
        for method in methods:
            result = _train(method, bandwidth, rows, args)
            if result is None:
                return 1
            rows.append(result)
        results[bandwidth] = rows
    report(results, args)
    return 0


def _command(method: str, args: argparse.Namespace, target: float | None) -> list[str]:
    """``examples/torch_train.py``'s options for ``method``."""
    diloco = ["--sync", "diloco", "--sync-every", str(args.sync_every),
              "--steps", str(args.diloco_steps)]
    options = {
        DDP: ["--sync", "ddp", "--steps", str(args.steps)],
        "DDP + HiPress": ["--sync", "hook", "--steps",
                          str(math.ceil(args.steps * args.patience)),
                          "--min-steps", str(args.steps)],
        FP32: [*diloco, "--algorithm", "none"],
        "HiPress DiLoCo": diloco,
        "HiPress Streaming DiLoCo": [*diloco, "--fragments", str(args.fragments),
                                     "--delay", str(args.delay)],
    }[method]
    if method == "DDP + HiPress" and target is not None:
        options += ["--target-loss", repr(target), "--smooth", "3"]
    return [str(HERE.parent / "examples" / "torch_train.py"), "--model", "transformer",
            "--width", str(args.dim), "--layers", str(args.layers), "--batch",
            str(args.batch), "--threads", str(args.threads), "--eval-every",
            str(args.eval_every), "--quiet", *options]


def _train(method: str, bandwidth: str, rows: list[dict],
           args: argparse.Namespace) -> dict | None:
    metrics = args.out.parent / f"diloco-{bandwidth}-{method.replace(' ', '_')}.json"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.unlink(missing_ok=True)
    target = target_loss(rows[0]) if rows else None
    print(f"== {bandwidth}: {method}", flush=True)
    code = run_shaped(args.ranks, bandwidth, [*_command(method, args, target), "--metrics",
                                              str(metrics)])
    if code or not metrics.exists():
        print(f"{method} failed with exit code {code}", file=sys.stderr)
        return None
    result = json.loads(metrics.read_text())
    result["method"] = method
    return result


def _ratio(value: float | None, reference: float | None) -> str:
    return f"{reference / value:.2f}x" if value and reference else "-"


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.table import Table

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (bandwidth, rows) in zip(axes[0], results.items(), strict=True):
        ddp = rows[0]
        target = target_loss(ddp)
        fp32 = next((r for r in rows if r["method"] == FP32), None)
        for r in rows:
            r["target_loss"] = target
            r["time_to_target_s"] = time_to(target, r["evals"])
        table = Table(title=f"{bandwidth}, {args.ranks} replicas, {ddp['params']:,} "
                            f"parameters; target: DDP's held-out loss after {ddp['steps']} "
                            f"steps, {target:.3f}; H = {args.sync_every}")
        for col in ("method", "s/step", "to target s", "vs DDP", "vs fp32 DiLoCo",
                    f"loss @{args.diloco_steps}", "vs fp32 DiLoCo ", "KB/inner step",
                    "outer hidden", "identical"):
            table.add_column(col, justify="left" if col == "method" else "right")
        base = loss_at(args.diloco_steps, fp32["evals"]) if fp32 else None
        for r in rows:
            reach = r["time_to_target_s"]
            at = loss_at(args.diloco_steps, r["evals"]) if r["sync"] == "diloco" else None
            outer = r.get("diloco")
            table.add_row(
                r["method"], f"{r['seconds'] / r['steps']:.3f}",
                f"{reach:.1f}" if reach is not None else "never",
                _ratio(reach, ddp["time_to_target_s"]),
                _ratio(reach, fp32["time_to_target_s"]) if fp32 else "-",
                f"{at:.3f}" if at is not None else "-",
                f"{at / base - 1:+.2%}" if at is not None and base else "-",
                f"{r['bytes_per_step'] / 1e3:.1f}" if r["bytes_per_step"] else "-",
                f"{outer['hidden']:.0%}" if outer else "-",
                "yes" if r["replicas_identical"] else "NO")
            plot_curve(ax, r)
        make_console(140).print(table)
        ax.axhline(target, color="gray", linewidth=0.5)
        ax.set_title(f"{bandwidth}, {args.ranks} replicas", fontsize=10)
        ax.set_xlabel("training seconds (scoring left out)")
        ax.set_ylabel("held-out loss (mean of 3 scores)")
        ax.legend(fontsize=8)
    write_json(args, links=results)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    raise SystemExit(main())
