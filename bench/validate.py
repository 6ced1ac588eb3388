"""Cost-model validation: the simulator's predictions against `bench sync` on this host.

For every world size (``--ranks``) and network (``--networks``) this runs
``bench/sync.py --validate``: profile the primitives on those ranks, measure every case,
and predict each from that profile (``casync.model.simulate``). The errors go into one table,
``measured ms / predicted ms (error)``, with how many cases fall within ``--bound``
(25 %, issue 6) and the median absolute error. With ``--repeat N`` the configurations
run N times in turn, and each cell holds the medians of its measured and predicted
times; the counts of every single run are reported as well, since on a shared host the
same case's time can move between runs by more than the bound.

    hipress bench validate                      # 2 and 4 ranks on loopback
    sudo hipress bench validate --networks loopback shaped --repeat 3

On shaped networks it also runs ``--layouts`` (default 2x2: two nodes of two ranks,
only the link between them shaped), with the hierarchical topology among the cases; the
profile there fits the links inside and between nodes apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from casync.plan import COMPRESSED, HIERARCHICAL  # noqa: E402
from hipress.cliargs import Parser, algorithm, count, number  # noqa: E402
from hipress.output import console as make_console  # noqa: E402

RESULTS = HERE / "results"


def _config(run: dict[str, Any]) -> str:
    per_node = run.get("per_node", 1)
    if per_node > 1:
        return f"{run['network']}, {run['world'] // per_node} x {per_node} ranks"
    return f"{run['network']}, {run['world']} ranks"


def summarize(runs: list[list[dict[str, Any]]], bound: float = 0.25) -> dict[str, Any]:
    """The validation table from ``bench sync --validate`` results: ``runs[r]`` holds
    repetition r's result for every configuration. Cells keep the medians over
    repetitions of the measured and predicted seconds, and their error."""
    configs: list[str] = []
    cases: list[str] = []
    times: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    per_run = []
    for results in runs:
        within = total = 0
        for result in results:
            config = _config(result)
            if config not in configs:
                configs.append(config)
            for row in result["rows"]:
                if "predicted_s" not in row:
                    continue
                if row["case"] not in cases:
                    cases.append(row["case"])
                measured, predicted = times.setdefault((row["case"], config), ([], []))
                measured.append(row["seconds"])
                predicted.append(row["predicted_s"])
                total += 1
                within += abs(row["predicted_s"] / row["seconds"] - 1) <= bound
        per_run.append({"within": within, "cases": total})
    cells = []
    for (case, config), (measured, predicted) in times.items():
        m, p = statistics.median(measured), statistics.median(predicted)
        cells.append({"case": case, "config": config, "measured_s": m, "predicted_s": p,
                      "error": p / m - 1, "runs": len(measured)})
    errors = [abs(c["error"]) for c in cells]
    return {"bound": bound, "configs": configs, "cases": cases, "cells": cells,
            "within": sum(e <= bound for e in errors), "total": len(cells),
            "median_error": statistics.median(errors) if errors else 0.0,
            "per_run": per_run}


def markdown(summary: dict[str, Any]) -> str:
    """The table as docs/benchmarks.md shows it, with the counts under it."""
    cells = {(c["case"], c["config"]): c for c in summary["cells"]}
    lines = ["| case | " + " | ".join(summary["configs"]) + " |",
             "|---|" + "---:|" * len(summary["configs"])]
    for case in summary["cases"]:
        row = []
        for config in summary["configs"]:
            c = cells.get((case, config))
            row.append("-" if c is None else f"{c['measured_s'] * 1e3:.0f} / "
                       f"{c['predicted_s'] * 1e3:.0f} ({c['error'] * 100:+.0f}%)")
        lines.append(f"| {case} | " + " | ".join(row) + " |")
    runs = ", ".join(f"{r['within']} of {r['cases']}" for r in summary["per_run"])
    lines += ["", f"{summary['within']} of {summary['total']} within "
              f"{summary['bound'] * 100:.0f} %, median error "
              f"{summary['median_error'] * 100:.0f} % (single runs: {runs})"]
    return "\n".join(lines)


def _sync(args: argparse.Namespace, world: int, network: str, out: Path,
          per_node: int = 1) -> dict[str, Any]:
    where = ["--ranks", str(world)] if per_node == 1 else \
        ["--nodes", str(world // per_node), "--ranks-per-node", str(per_node)]
    topologies = args.topologies + ([HIERARCHICAL] if per_node > 1 else [])
    command = [sys.executable, str(HERE / "sync.py"), *where,
               "--network", network, "--validate", "--steps", str(args.steps),
               "--scale", str(args.scale), "--algorithms", *args.algorithms,
               "--topologies", *topologies, "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench sync on {world} {network} ranks failed "
                         f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return {**json.loads(out.read_text()), "per_node": per_node}


def _layout(text: str) -> tuple[int, int]:
    """``NxL``: N nodes of L ranks."""
    try:
        nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NODESxRANKS, e.g. 2x2") from None
    if nodes < 2 or per_node < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 2 nodes of 2 ranks")
    return nodes, per_node


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="hipress bench validate", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=count(2), nargs="+", default=[2, 4])
    parser.add_argument("--networks", nargs="+", choices=["loopback", "shaped"],
                        default=["loopback"], help="shaped links need root (tc, netns)")
    parser.add_argument("--algorithms", nargs="+", type=algorithm, default=["onebit", "dgc"])
    parser.add_argument("--topologies", nargs="+", default=[*COMPRESSED, "auto"],
                        choices=[*COMPRESSED, "auto"])
    parser.add_argument("--layouts", nargs="*", type=_layout, default=[(2, 2)],
                        help="on shaped networks, also NODESxRANKS jobs whose ranks share "
                             "nodes (the hierarchical cases too); default 2x2")
    parser.add_argument("--steps", type=count(1), default=10, help="timed steps per case")
    parser.add_argument("--scale", type=number(above=0), default=1.0,
                        help="multiply tensor sizes")
    parser.add_argument("--repeat", type=count(1), default=1,
                        help="runs of every configuration")
    parser.add_argument("--bound", type=number(above=0), default=0.25,
                        help="the error counted as met")
    parser.add_argument("--out", type=Path, default=RESULTS / "validate.json")
    args = parser.parse_args(argv)
    if "shaped" in args.networks and os.geteuid() != 0:
        parser.error("--networks shaped builds network namespaces: run as root (sudo)")
    console = make_console()
    runs = []
    with tempfile.TemporaryDirectory(prefix="hipress-validate-") as tmp:
        for r in range(args.repeat):
            results = []
            for network in args.networks:
                jobs = [(world, 1) for world in args.ranks]
                if network == "shaped":
                    jobs += [(n * k, k) for n, k in args.layouts]
                for world, per_node in jobs:
                    console.print(f"run {r + 1}/{args.repeat}: {world} ranks "
                                  f"({per_node} per node), {network}")
                    out = Path(tmp) / f"{r}_{network}_{world}_{per_node}.json"
                    results.append(_sync(args, world, network, out, per_node))
            runs.append(results)
    summary = summarize(runs, args.bound)
    summary["runs"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    print(markdown(summary))
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
