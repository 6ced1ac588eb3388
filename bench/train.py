"""Training benchmark: time to plain DDP's held-out loss, as users run their jobs.

For each model (``--models``: the residual CNN on scikit-learn's digits, 107 gradient
tensors, SGD with momentum; the GPT-style byte-level transformer on the Python standard
library's source, 76 tensors, AdamW; optionally the wide MLP on digits) it trains
``examples/torch_train.py`` once per method, each rank in its own network namespace
behind a shaped link, launched one process per host as Slurm, mpirun or a plain
``python train.py`` launches a job: no thread or HiPress variables exported. The script
calls ``torch.set_num_threads`` with its share of this machine's cores (``--threads``:
one per rank on 2 ranks), as a job whose ranks share cores does, and HiPress's kernels
follow it.

Plain DDP runs first for the model's steps; its held-out loss at the end is the target.
Every other method trains at least as many steps and at most ``--patience`` times as many,
until its held-out loss reaches the target. Held-out losses are scored every
``--eval-every`` steps, the clock stopped meanwhile, and compared as the mean of the last
``SMOOTH`` scores: one score of a small held-out set moves by a few percent from step to
step. The table gives, per method: samples/s (steady, after the script's
warm-up steps) and the time to the target, each as a ratio to DDP and to torch's
PowerSGD measured in the same run; the held-out loss after DDP's number of steps against
DDP's; bytes sent per step; whether the replicas ended identical; the kernels' threads.
One plot per model: held-out loss against training time, every method.

Methods: plain DDP; torch's fp16 and PowerSGD (rank 4) hooks; HiPress as a user gets it
without choosing (``HookState()``) and with ``plan="auto"``; and HiPress with an algorithm
forced on every tensor (``HookState(algorithm=..., guard=False)``: onebit, dgc, terngrad,
cgx; not run unless asked).

``--breakdown`` also trains every rank alone (``--sync local``: what a step costs in
compute under the same load) and reports, per method and rank, where a step's time goes
(``hipress.breakdown``); the integration overhead is (HiPress step - compute step) / the
engine's own sync time for the same gradients.

    sudo hipress bench train                 # 2 namespaces, tc-shaped 1 Gbit/s links
    sudo hipress bench train --ranks 4       # 4 ranks sharing this machine's cores
    hipress bench train --network paced      # no root: software-paced uplinks
    sudo hipress bench train --models transformer --breakdown
    sudo hipress bench train --nodes 2 --ranks-per-node 2   # only inter-node links shaped

torch's hooks talk to torch.distributed directly and cannot be software-paced, so the
paced mode runs only plain DDP and the HiPress methods.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench._report import write_json  # noqa: E402
from hipress.breakdown import COLUMNS  # noqa: E402
from hipress.cliargs import Parser, add_nodes, count, nodes_of, number, rate  # noqa: E402
from hipress.launcher import run, run_shaped  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"
#: per model: the option that sizes it and its default, the batch per rank, the steps DDP
#: trains, and the steps between scores on held-out data
MODELS = {"mlp": ("--width", 2896, 16, 90, 10), "resnet": ("--width", 200, 16, 120, 10),
          "transformer": ("--width", 384, 2, 200, 10)}
DEFAULT_MODELS = ["resnet", "transformer"]
METHODS = {
    "DDP": ["--sync", "ddp"],
    "torch fp16": ["--sync", "fp16"],
    "torch PowerSGD": ["--sync", "powersgd"],
    "HiPress default": ["--sync", "hook"],
    "HiPress auto": ["--sync", "hook", "--plan", "auto"],
    "HiPress onebit": ["--sync", "hook", "--algorithm", "onebit", "--no-guard"],
    "HiPress dgc": ["--sync", "hook", "--algorithm", "dgc", "--no-guard"],
    "HiPress terngrad": ["--sync", "hook", "--algorithm", "terngrad", "--no-guard"],
    "HiPress cgx": ["--sync", "hook", "--algorithm", "cgx", "--no-guard"],
}
DEFAULT_METHODS = ["DDP", "torch fp16", "torch PowerSGD", "HiPress default", "HiPress auto"]
#: held-out scores averaged before they are compared (the target's too)
SMOOTH = 3
#: the compute reference of ``--breakdown``: every rank trains alone
COMPUTE = "compute only"
POWERSGD = "torch PowerSGD"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench train", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_nodes(parser, ranks=2)
    parser.add_argument("--network", choices=["shaped", "paced"], default="shaped")
    parser.add_argument("--bandwidth", type=rate, default="1gbit")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--width", type=count(1), default=MODELS["mlp"][1],
                        help="the MLP's: 8.6M parameters")
    parser.add_argument("--channels", type=count(1), default=MODELS["resnet"][1],
                        help="the residual CNN's: 12.3M parameters in 107 tensors")
    parser.add_argument("--dim", type=count(1), default=MODELS["transformer"][1],
                        help="the transformer's width: 10.7M parameters in 76 tensors")
    parser.add_argument("--batch", type=count(1),
                        help="samples per rank per step (default: 16; the transformer's 2)")
    parser.add_argument("--steps", type=count(1),
                        help="DDP's steps (default: the CNN's and MLP's 120 and 90, the "
                             "transformer's 200)")
    parser.add_argument("--eval-every", type=count(1),
                        help="steps between scores on held-out data (default 10)")
    parser.add_argument("--patience", type=number(minimum=1.0), default=1.5,
                        help="other methods train up to this many times DDP's steps to "
                             "reach its held-out loss")
    parser.add_argument("--threads", type=count(1),
                        help="torch.set_num_threads in each rank (default: this machine's "
                             "cores / the ranks, at least 1)")
    parser.add_argument("--lr", type=number(above=0),
                        help="default: the example's for each optimizer")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                        choices=list(METHODS))
    parser.add_argument("--breakdown", action="store_true",
                        help="also where each step's time goes (see above)")
    parser.add_argument("--out", type=Path, default=RESULTS / "train.json")
    args = parser.parse_args(argv)
    ranks, per_node = nodes_of(args)
    if per_node > 1 and args.network != "shaped":
        parser.error("--ranks-per-node needs --network shaped")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // ranks)
    methods = select_methods(args.methods, args.network)
    if args.breakdown:
        methods.append(COMPUTE)
    results = {}
    for model in args.models:
        rows: list[dict] = []
        steps = args.steps or MODELS[model][3]
        for method in methods:
            result = train_one(model, method, steps, rows, args, ranks, per_node)
            if result is None:
                return 1
            rows.append(result)
        results[model] = rows
    report(results, args)
    return 0


def train_one(model: str, method: str, steps: int, rows: list[dict],
              args: argparse.Namespace, ranks: int, per_node: int) -> dict | None:
    """Train ``model`` with ``method`` and return its metrics (None if it failed): DDP for
    ``steps``, the others until they reach DDP's held-out loss (``rows[0]``)."""
    metrics = args.out.parent / f"train-{model}-{method.replace(' ', '_')}.json"
    metrics.unlink(missing_ok=True)
    sync = ["--sync", "local"] if method == COMPUTE else METHODS[method]
    every = args.eval_every or MODELS[model][4]
    cmd = [str(HERE.parent / "examples" / "torch_train.py"), *sync, "--model", model,
           *_size(model, args), "--threads", str(args.threads), "--eval-every", str(every),
           "--metrics", str(metrics), "--quiet"]
    if method in ("DDP", COMPUTE):
        cmd += ["--steps", str(steps)]
    else:
        cmd += ["--steps", str(math.ceil(steps * args.patience)), "--min-steps", str(steps),
                "--target-loss", repr(target_loss(rows[0])), "--smooth", str(SMOOTH)]
    if args.lr:
        cmd += ["--lr", str(args.lr)]
    if args.breakdown:
        cmd.append("--breakdown")
    print(f"== {model}: {method}", flush=True)
    code = run_shaped(ranks, args.bandwidth, cmd, per_node) \
        if args.network == "shaped" else run(ranks, cmd, bandwidth=args.bandwidth)
    if code or not metrics.exists():
        print(f"{method} failed with exit code {code}", file=sys.stderr)
        return None
    result = json.loads(metrics.read_text())
    result["method"] = method
    return result


def _size(model: str, args: argparse.Namespace) -> list[str]:
    """The example's options that size ``model``: width and batch."""
    flag, _, batch, _, _ = MODELS[model]
    width = {"mlp": args.width, "resnet": args.channels, "transformer": args.dim}[model]
    return [flag, str(width), "--batch", str(args.batch or batch)]


def smoothed(evals: list[list[float]]) -> list[tuple[float, int, float]]:
    """(seconds, step, held-out loss) with each loss the mean of the last ``SMOOTH``
    scores'. ``evals`` holds (seconds, step, loss, accuracy) rows."""
    out = []
    for i, (seconds, step, _, _) in enumerate(evals):
        window = [e[2] for e in evals[max(0, i - SMOOTH + 1):i + 1]]
        out.append((seconds, int(step), sum(window) / len(window)))
    return out


def target_loss(ddp: dict) -> float:
    """DDP's held-out loss at the end of its run (smoothed)."""
    return smoothed(ddp["evals"])[-1][2]


def time_to(target: float, evals: list[list[float]]) -> float | None:
    """Training seconds until the smoothed held-out loss is first at most ``target``;
    None if it never is."""
    return next((seconds for seconds, _, loss in smoothed(evals) if loss <= target), None)


def loss_at(step: int, evals: list[list[float]]) -> float | None:
    """The smoothed held-out loss at ``step`` (None if the run had no score there)."""
    return next((loss for _, at, loss in smoothed(evals) if at == step), None)


def plot_curve(ax: Any, r: dict) -> None:
    """``r``'s smoothed held-out loss against training seconds, labelled with its
    ``time_to_target_s``."""
    t, _, loss = zip(*smoothed(r["evals"]), strict=True)
    reach = r["time_to_target_s"]
    ax.plot(t, loss, marker=".", label=f"{r['method']}: "
            + (f"{reach:.0f} s" if reach is not None else "never"))


def select_methods(requested: list[str], network: str) -> list[str]:
    """The methods to run, in order: plain DDP first, since every target and ratio is
    its."""
    methods = [m for m in dict.fromkeys(requested)
               if network == "shaped" or not m.startswith("torch")]
    if "DDP" not in methods:
        print("DDP is the reference of every ratio: running it as well", flush=True)
    return ["DDP", *(m for m in methods if m != "DDP")]


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4.5), squeeze=False)
    for ax, (model, rows) in zip(axes[0], results.items(), strict=True):
        trained = [r for r in rows if r["method"] != COMPUTE]
        ddp = trained[0]
        target = target_loss(ddp)
        for r in trained:
            r["target_loss"] = target
            r["time_to_target_s"] = time_to(target, r["evals"])
            r["loss_at_ddp_steps"] = loss_at(ddp["steps"], r["evals"])
        make_console(130).print(_table(model, trained, args))
        if args.breakdown:
            make_console(150).print(_breakdown(model, rows))
        for r in trained:
            plot_curve(ax, r)
        ax.axhline(target, color="gray", linewidth=0.5)
        ax.set_title(f"{model}: {ddp['params']:,} parameters, {ddp['tensors']} tensors, "
                     f"{args.ranks} ranks, {args.bandwidth}", fontsize=10)
        ax.set_xlabel("training seconds (scoring left out)")
        ax.set_ylabel(f"held-out loss (mean of {SMOOTH} scores)")
        ax.legend(fontsize=8)
    write_json(args, models=results)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def _ratio(value: float | None, reference: float | None, invert: bool = False) -> str:
    if not value or not reference:
        return "-"
    return f"{(reference / value if invert else value / reference):.2f}x"


def _table(model: str, rows: list[dict], args: argparse.Namespace) -> object:
    from rich.table import Table

    ddp = rows[0]
    psgd = next((r for r in rows if r["method"] == POWERSGD), None)
    threads = ddp["threads"]["torch"]
    table = Table(title=f"{model}: {args.ranks} ranks ({threads} torch thread(s) each), "
                        f"{ddp['params']:,} parameters in {ddp['tensors']} tensors, "
                        f"{args.bandwidth} {args.network} links; target: DDP's held-out "
                        f"loss after {ddp['steps']} steps, {ddp['target_loss']:.3f}")
    for col in ("method", "samples/s", "vs DDP", "vs PowerSGD", "to target s", "vs DDP ",
                "vs PowerSGD ", f"loss @{ddp['steps']}", "vs DDP  ", "MB/step",
                "identical", "kernel threads"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        sps, reach, at = r["steady_samples_per_s"], r["time_to_target_s"], \
            r["loss_at_ddp_steps"]
        kernels = r["threads"]["kernels"].split(":")[0] if r["sync"] == "hook" else "-"
        table.add_row(
            r["method"], f"{sps:.1f}", _ratio(sps, ddp["steady_samples_per_s"]),
            _ratio(sps, psgd["steady_samples_per_s"]) if psgd else "-",
            f"{reach:.1f}" if reach is not None else "never",
            _ratio(reach, ddp["time_to_target_s"], invert=True),
            _ratio(reach, psgd["time_to_target_s"], invert=True) if psgd else "-",
            f"{at:.3f}" if at is not None else "-",
            f"{(at / ddp['target_loss'] - 1):+.1%}" if at is not None else "-",
            f"{r['bytes_per_step'] / 1e6:.2f}" if r["bytes_per_step"] else "-",
            "yes" if r["replicas_identical"] else "NO", kernels)
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
