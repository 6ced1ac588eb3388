"""Training benchmark: the example on N ranks per synchronization method, same link.

For each model (``--models``: the wide MLP, six gradient tensors, and the residual CNN,
107) and each method it trains ``examples/torch_train.py`` for the same epochs and reports
samples/s as a ratio to plain DDP measured in the same run, final accuracy, bytes sent
per step, and whether the replicas ended identical. samples/s is the steady rate after
the example's warm-up steps (one-time set-up, left out for every method alike, as
Horovod's benchmarks do); the ratio over all steps, warm-up included, is shown beside it.
Methods: plain DDP, HiPress with onebit, dgc and terngrad (CaSync via the DDP comm
hook), and torch's own PowerSGD (rank 1) and fp16 compression hooks.

    sudo hipress bench train                 # 4 namespaces, tc-shaped 1 Gbit/s links
    hipress bench train --network paced      # no root: software-paced uplinks

torch's hooks talk to torch.distributed directly and cannot be software-paced, so the
paced mode runs only plain DDP and the HiPress methods.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hipress.cliargs import Parser, count, number, rate  # noqa: E402
from hipress.launcher import run, run_shaped  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
METHODS = {
    "DDP": ["--sync", "ddp"],
    "HiPress onebit": ["--sync", "hook", "--algorithm", "onebit"],
    "HiPress dgc": ["--sync", "hook", "--algorithm", "dgc"],
    "HiPress terngrad": ["--sync", "hook", "--algorithm", "terngrad"],
    "torch PowerSGD": ["--sync", "powersgd"],
    "torch fp16": ["--sync", "fp16"],
}


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench train", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=count(2), default=4)
    parser.add_argument("--network", choices=["shaped", "paced"], default="shaped")
    parser.add_argument("--bandwidth", type=rate, default="1gbit")
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet"],
                        choices=["mlp", "resnet"])
    parser.add_argument("--width", type=count(1), default=2896,
                        help="the MLP's: 8.6M parameters")
    parser.add_argument("--channels", type=count(1), default=128,
                        help="the residual CNN's: 5.0M parameters in 107 tensors")
    parser.add_argument("--batch", type=count(1), default=16)
    parser.add_argument("--epochs", type=count(1), default=2)
    parser.add_argument("--lr", type=number(above=0), default=0.05)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=RESULTS / "train.json")
    args = parser.parse_args(argv)
    methods = select_methods(args.methods, args.network)
    results = {}
    for model in args.models:
        rows = []
        width = args.channels if model == "resnet" else args.width
        for method in methods:
            metrics = args.out.parent / f"train-{model}-{method.replace(' ', '_')}.json"
            metrics.unlink(missing_ok=True)
            cmd = [str(HERE.parent / "examples" / "torch_train.py"), *METHODS[method],
                   "--model", model, "--epochs", str(args.epochs), "--width", str(width),
                   "--batch", str(args.batch), "--lr", str(args.lr), "--metrics",
                   str(metrics), "--quiet"]
            print(f"== {model}: {method}", flush=True)
            code = run_shaped(args.ranks, args.bandwidth, cmd) if args.network == "shaped" \
                else run(args.ranks, cmd, bandwidth=args.bandwidth)
            if code or not metrics.exists():
                print(f"{method} failed with exit code {code}", file=sys.stderr)
                return 1
            result = json.loads(metrics.read_text())
            result["method"] = method
            rows.append(result)
        results[model] = rows
    report(results, args)
    return 0


def select_methods(requested: list[str], network: str) -> list[str]:
    """The methods to run, in order: plain DDP first, since every ratio is to it."""
    methods = [m for m in dict.fromkeys(requested)
               if network == "shaped" or not m.startswith("torch")]
    if "DDP" not in methods:
        print("DDP is the reference of every ratio: running it as well", flush=True)
    return ["DDP", *(m for m in methods if m != "DDP")]


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items(), strict=True):
        make_console(110).print(_table(model, rows, args))
        base = next(r["steady_samples_per_s"] for r in rows if r["method"] == "DDP")
        for r in rows:
            t, loss = zip(*r["losses"], strict=True)
            ax.plot(t, loss, label=f"{r['method']} ({r['steady_samples_per_s'] / base:.2f}x)")
        ax.set_title(f"{model}: {rows[0]['params']:,} parameters, {rows[0]['tensors']} tensors")
        ax.set_xlabel("wall-clock seconds")
        ax.set_ylabel("training loss (rank 0)")
        ax.legend(fontsize=8)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "models": results}, indent=2))
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _table(model: str, rows: list[dict], args: argparse.Namespace) -> object:
    from rich.table import Table

    base = next(r["steady_samples_per_s"] for r in rows if r["method"] == "DDP")
    base_all = next(r["samples_per_s"] for r in rows if r["method"] == "DDP")
    table = Table(title=f"{model}: {args.ranks} ranks, {rows[0]['params']:,} parameters in "
                        f"{rows[0]['tensors']} tensors, {args.bandwidth} {args.network} "
                        f"links, {args.epochs} epochs")
    for col in ("method", "samples/s", "vs DDP", "all steps", "accuracy", "MB sent/step",
                "identical"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        table.add_row(r["method"], f"{r['steady_samples_per_s']:.0f}",
                      f"{r['steady_samples_per_s'] / base:.2f}x",
                      f"{r['samples_per_s'] / base_all:.2f}x", f"{r['accuracy']:.3f}",
                      f"{r['bytes_per_step'] / 1e6:.2f}" if r["bytes_per_step"] else "-",
                      "yes" if r["replicas_identical"] else "NO")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
