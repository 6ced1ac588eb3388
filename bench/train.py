"""Training benchmark: the example on N ranks per synchronization method, same link.

For each model (``--models``: the wide MLP, six gradient tensors; the residual CNN, 107;
the GPT-style transformer, 76, trained with AdamW) and each method it trains
``examples/torch_train.py`` for the same steps and reports samples/s as a ratio to plain
DDP measured in the same run, the wall-clock time to reach a target loss (the loss plain
DDP reaches three quarters into its run, on the curves smoothed over 10 steps: a faster
step that needs more steps is not faster training), final accuracy, bytes sent per step,
and whether the replicas ended identical. samples/s is the steady rate after the
example's warm-up steps (one-time set-up, left out for every method alike, as Horovod's
benchmarks do); the ratio over all steps, warm-up included, is shown beside it. Methods:
plain DDP, HiPress with onebit, dgc, terngrad and cgx (4 bits; CaSync via the DDP comm
hook), and torch's own PowerSGD (rank 4) and fp16 compression hooks.

``--breakdown`` also trains every rank alone (``--sync local``: what the step costs in
compute under the same load) and reports, per method and rank, where a step's time goes
(``hipress.breakdown``): forward, backward, optimizer; for HiPress also the hook's calls on
the autograd thread, the wait at backward's end, codec and wire time, the share of the
synchronization that overlapped backward, and the integration overhead, (HiPress step -
compute step) / the engine's own sync time for the same gradients.

    sudo hipress bench train                 # 4 namespaces, tc-shaped 1 Gbit/s links
    hipress bench train --network paced      # no root: software-paced uplinks
    sudo hipress bench train --ranks 2 --models transformer --breakdown
    sudo hipress bench train --nodes 2 --ranks-per-node 2   # only inter-node links shaped

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

from hipress.breakdown import COLUMNS  # noqa: E402
from hipress.cliargs import Parser, add_nodes, count, nodes_of, number, rate  # noqa: E402
from hipress.launcher import run, run_shaped  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
#: per model: the option that sizes it, its default, the batch per rank and the steps
MODELS = {"mlp": ("--width", 2896, 16, 0), "resnet": ("--width", 200, 16, 0),
          "transformer": ("--width", 384, 2, 80)}
METHODS = {
    "DDP": ["--sync", "ddp"],
    "HiPress onebit": ["--sync", "hook", "--algorithm", "onebit"],
    "HiPress dgc": ["--sync", "hook", "--algorithm", "dgc"],
    "HiPress terngrad": ["--sync", "hook", "--algorithm", "terngrad"],
    "HiPress cgx": ["--sync", "hook", "--algorithm", "cgx"],
    "torch PowerSGD": ["--sync", "powersgd"],
    "torch fp16": ["--sync", "fp16"],
}
#: the compute reference of ``--breakdown``: every rank trains alone
COMPUTE = "compute only"
#: losses are smoothed over this many steps before they are compared with a target
SMOOTH = 10


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench train", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_nodes(parser)
    parser.add_argument("--network", choices=["shaped", "paced"], default="shaped")
    parser.add_argument("--bandwidth", type=rate, default="1gbit")
    parser.add_argument("--models", nargs="+", default=["mlp", "resnet", "transformer"],
                        choices=list(MODELS))
    parser.add_argument("--width", type=count(1), default=MODELS["mlp"][1],
                        help="the MLP's: 8.6M parameters")
    parser.add_argument("--channels", type=count(1), default=MODELS["resnet"][1],
                        help="the residual CNN's: 12.3M parameters in 107 tensors")
    parser.add_argument("--dim", type=count(1), default=MODELS["transformer"][1],
                        help="the transformer's width: 13.8M parameters in 76 tensors")
    parser.add_argument("--batch", type=count(1),
                        help="samples per rank per step (default: 16; the transformer's 2)")
    parser.add_argument("--epochs", type=count(1), default=2,
                        help="the MLP's and the CNN's (the transformer runs --lm-steps)")
    parser.add_argument("--lm-steps", type=count(1), default=MODELS["transformer"][3])
    parser.add_argument("--lr", type=number(above=0),
                        help="default: the example's for each optimizer")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--breakdown", action="store_true",
                        help="also where each step's time goes (see above)")
    parser.add_argument("--out", type=Path, default=RESULTS / "train.json")
    args = parser.parse_args(argv)
    ranks, per_node = nodes_of(args)
    if per_node > 1 and args.network != "shaped":
        parser.error("--ranks-per-node needs --network shaped")
    methods = select_methods(args.methods, args.network)
    if args.breakdown:
        methods.append(COMPUTE)
    results = {}
    for model in args.models:
        rows = []
        for method in methods:
            metrics = args.out.parent / f"train-{model}-{method.replace(' ', '_')}.json"
            metrics.unlink(missing_ok=True)
            sync = ["--sync", "local"] if method == COMPUTE else METHODS[method]
            cmd = [str(HERE.parent / "examples" / "torch_train.py"), *sync, "--model", model,
                   *_size(model, args), "--metrics", str(metrics), "--quiet"]
            if args.lr:
                cmd += ["--lr", str(args.lr)]
            if args.breakdown:
                cmd.append("--breakdown")
            print(f"== {model}: {method}", flush=True)
            code = run_shaped(ranks, args.bandwidth, cmd, per_node) \
                if args.network == "shaped" else run(ranks, cmd, bandwidth=args.bandwidth)
            if code or not metrics.exists():
                print(f"{method} failed with exit code {code}", file=sys.stderr)
                return 1
            result = json.loads(metrics.read_text())
            result["method"] = method
            rows.append(result)
        results[model] = rows
    report(results, args)
    return 0


def _size(model: str, args: argparse.Namespace) -> list[str]:
    """The example's options that size ``model``: width, batch, and epochs or steps."""
    flag, _, batch, steps = MODELS[model]
    width = {"mlp": args.width, "resnet": args.channels, "transformer": args.dim}[model]
    out = [flag, str(width), "--batch", str(args.batch or batch)]
    return out + (["--steps", str(args.lm_steps)] if steps else ["--epochs", str(args.epochs)])


def smoothed(losses: list[list[float]]) -> list[tuple[float, float]]:
    """(seconds, loss) with each loss the mean of the last ``SMOOTH`` steps'."""
    out = []
    for i in range(len(losses)):
        window = losses[max(0, i - SMOOTH + 1):i + 1]
        out.append((losses[i][0], sum(v for _, v in window) / len(window)))
    return out


def time_to(target: float, losses: list[list[float]]) -> float | None:
    """Seconds until the smoothed loss first reaches ``target``; None if it never does."""
    for t, loss in smoothed(losses)[SMOOTH - 1:]:
        if loss <= target:
            return t
    return None


def target_loss(rows: list[dict]) -> float:
    """The loss plain DDP reaches three quarters into its run (smoothed)."""
    ddp = smoothed(next(r["losses"] for r in rows if r["method"] == "DDP"))
    return ddp[max(SMOOTH - 1, (3 * len(ddp)) // 4 - 1)][1]


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
        trained = [r for r in rows if r["method"] != COMPUTE]
        target = target_loss(trained)
        for r in trained:
            r["target_loss"] = target
            r["time_to_target_s"] = time_to(target, r["losses"])
        make_console(110).print(_table(model, trained, args))
        if args.breakdown:
            make_console(150).print(_breakdown(model, rows))
        base = next(r["steady_samples_per_s"] for r in rows if r["method"] == "DDP")
        for r in trained:
            t, loss = zip(*smoothed(r["losses"]), strict=True)
            ax.plot(t, loss, label=f"{r['method']} ({r['steady_samples_per_s'] / base:.2f}x)")
        ax.axhline(target, color="gray", linewidth=0.5)
        ax.set_title(f"{model}: {rows[0]['params']:,} parameters, {rows[0]['tensors']} tensors")
        ax.set_xlabel("wall-clock seconds")
        ax.set_ylabel(f"training loss (rank 0, mean of {SMOOTH} steps)")
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
    ddp_time = next(r["time_to_target_s"] for r in rows if r["method"] == "DDP")
    table = Table(title=f"{model}: {args.ranks} ranks, {rows[0]['params']:,} parameters in "
                        f"{rows[0]['tensors']} tensors, {args.bandwidth} {args.network} "
                        f"links, {rows[0]['steps']} steps; target loss "
                        f"{rows[0]['target_loss']:.3f}")
    for col in ("method", "samples/s", "vs DDP", "all steps", "to target s", "vs DDP ",
                "accuracy", "MB sent/step", "identical"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        reach = r["time_to_target_s"]
        table.add_row(r["method"], f"{r['steady_samples_per_s']:.0f}",
                      f"{r['steady_samples_per_s'] / base:.2f}x",
                      f"{r['samples_per_s'] / base_all:.2f}x",
                      f"{reach:.1f}" if reach is not None else "never",
                      f"{ddp_time / reach:.2f}x" if reach and ddp_time else "-",
                      f"{r['accuracy']:.3f}",
                      f"{r['bytes_per_step'] / 1e6:.2f}" if r["bytes_per_step"] else "-",
                      "yes" if r["replicas_identical"] else "NO")
    return table


def _breakdown(model: str, rows: list[dict]) -> object:
    """Medians per step and rank (ms); the overhead is the step minus the compute-only
    step of the same rank, in units of the engine's own sync time."""
    from rich.table import Table

    compute = next((r for r in rows if r["method"] == COMPUTE), None)
    table = Table(title=f"{model}: where a step's time goes (median ms per rank)")
    cols = ["method", "rank", *(c.replace("_ms", "") for c in COLUMNS), "engine alone",
            "overhead"]
    for col in cols:
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        alone = r.get("engine_alone_ms") or []
        for rank, b in enumerate(r.get("breakdown") or []):
            cells = ["-" if c not in b else f"{b[c]:.0%}" if c == "overlap" else f"{b[c]:.1f}"
                     for c in COLUMNS]
            extra = "-"
            if compute is not None and rank < len(alone) and alone[rank] > 0:
                own = compute["breakdown"][rank]["step_ms"]
                extra = f"{(b['step_ms'] - own) / alone[rank]:.2f}x"
            table.add_row(r["method"], str(rank), *cells,
                          f"{alone[rank]:.1f}" if rank < len(alone) else "-", extra)
    return table


if __name__ == "__main__":
    raise SystemExit(main())
