"""The ``hipress`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .cliargs import Parser, algorithm, algorithm_or_none, count, number, port, rate
from .errors import CompileError, ConfigError, HiPressError

__all__ = ["main"]


def _cmd_algorithms(args: argparse.Namespace) -> int:
    import compll
    from compll.compiler import describe_params

    for name in compll.algorithms():
        program = compll.load(name)
        params = describe_params(program)
        print(f"{name:<10} {params}" if params else name)
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    from compll import load_source
    from compll.compiler import describe_params, read_source
    from compll.payload import header_size

    for path in args.files:
        program = load_source(read_source(path), path, params=dict(args.param or ()))
        params = describe_params(program) or "none"
        layout = ", ".join(str(s.ty) for s in program.layout)
        print(f"{path}: ok: {program.name} (params: {params})")
        print(f"  payload: {header_size(len(program.layout))}-byte header + {layout}")
        if args.target:
            _emit(program, args.target, args.output)
    return 0


def _emit(program, target: str, output: str | None) -> None:
    """Build a checked program and say where the source and library are."""
    import shutil
    from pathlib import Path

    from compll.build import build

    art = build(program, target)
    source, library = art.source, art.library
    if output:
        folder = Path(output)
        folder.mkdir(parents=True, exist_ok=True)
        source = Path(shutil.copy2(art.source, folder / art.source.name))
        library = Path(shutil.copy2(art.library, folder / art.library.name))
        shutil.copy2(art.source.parent / "hp_constants.h", folder / "hp_constants.h")
    how = "cached" if art.cached else f"built in {art.seconds:.1f} s"
    print(f"  {target}: {how}")
    print(f"    source:  {source}")
    print(f"    library: {library}")


def _param(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    value: object
    if raw in ("true", "false"):
        value = raw == "true"
    else:
        try:
            value = int(raw, 0)
        except ValueError:
            try:
                value = float(raw)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{key}: {raw!r} is not a number") from None
    return key, value


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_roundtrip_demo, run_training_demo

    if args.codecs:
        return run_roundtrip_demo(args.size, args.seed)
    return run_training_demo(args.ranks, args.bandwidth, args.algorithm, args.epochs,
                             args.width, args.batch, args.lr, args.shaped)


def _cmd_run(args: argparse.Namespace) -> int:
    from .launcher import JOIN_TIMEOUT, run

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return run(args.np, command, args.nnodes, args.node_rank, args.master_addr,
               args.master_port, args.algorithm, args.bandwidth, args.timeout,
               args.max_restarts, args.join_timeout or JOIN_TIMEOUT)


def _cmd_profile(args: argparse.Namespace) -> int:
    from .planning import profile_main

    return profile_main(args.rest)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .planning import plan_main

    return plan_main(args.rest)


def _cmd_bench(args: argparse.Namespace) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / f"{args.which}.py"
    if not script.is_file():
        raise ConfigError(f"benchmark {args.which!r} lives in the source tree ({script} is "
                          "missing); run it from a clone of the HiPress repository")
    sys.argv = [f"hipress bench {args.which}", *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hipress", description="Compression-aware gradient synchronization.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("algorithms", help="list the shipped compression algorithms")
    p.set_defaults(func=_cmd_algorithms)
    _compile_args(sub.add_parser(
        "compile", help="check a CompLL file; with --target, build its kernels"))
    _run_args(sub.add_parser(
        "run", help="start a job on N ranks per node (torchrun underneath)"))
    for name, help_, func in (
            ("profile", "measure the primitives' costs on N ranks (JSON)", _cmd_profile),
            ("plan", "plan a model's gradients from a profile or a cluster", _cmd_plan)):
        p = sub.add_parser(name, help=help_, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER, help=f"see hipress {name} --help")
        p.set_defaults(func=func)
    p = sub.add_parser("bench", help="run a benchmark from bench/ "
                                     "(kernels, sync, validate, train, fsdp, diloco, "
                                     "trainers, simulate)")
    p.add_argument("which", choices=["kernels", "sync", "validate", "train", "fsdp", "diloco",
                                     "trainers", "simulate"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=_cmd_bench)
    _demo_args(sub.add_parser("demo", help="train on 4 local ranks with plain DDP, then "
                                           "HiPress"))
    return parser


def _compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE.cll")
    p.add_argument("--param", "-p", action="append", type=_param, metavar="NAME=VALUE",
                   help="override a parameter (repeatable)")
    p.add_argument("--target", choices=["cpu", "cuda", "cuda-emu"],
                   help="also generate and build kernels for this target (cuda-emu: the "
                        "CUDA source built to run on the CPU under the emulator)")
    p.add_argument("-o", "--output", metavar="DIR", help="copy the source and library here")
    p.set_defaults(func=_cmd_compile)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-np", "--nproc-per-node", "--nproc", dest="np", type=count(1),
                   required=True, help="ranks on this node (per node, as torchrun's "
                                       "--nproc-per-node: -np 2 --nnodes 2 is 4 ranks)")
    p.add_argument("--nnodes", type=count(1), default=1)
    p.add_argument("--node-rank", type=count(0), default=0)
    p.add_argument("--master-addr", help="address of node 0 (multi-node)")
    p.add_argument("--master-port", type=port, default=29500)
    p.add_argument("--join-timeout", type=number(above=0),
                   help="seconds to wait for every node of a multi-node job, then name the "
                        "ones that never came (default: 180)")
    p.add_argument("--algorithm", type=algorithm_or_none,
                   help="default compression algorithm (HIPRESS_ALGORITHM)")
    p.add_argument("--bandwidth", type=rate, help="software-paced uplink per rank, e.g. 1gbit")
    p.add_argument("--timeout", type=number(above=0),
                   help="seconds before a silent peer is an error")
    p.add_argument("--max-restarts", type=count(0), default=0,
                   help="restart every rank this many times after one fails (torchrun's "
                        "elastic agent; the script resumes from its checkpoint)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD ...",
                   help="a .py script with its arguments, or any command")
    p.set_defaults(func=_cmd_run)


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=count(2), default=4)
    p.add_argument("--bandwidth", type=rate, default="1gbit", help="link rate per rank")
    p.add_argument("--algorithm", type=algorithm, default=None,
                   help="default: what HookState() gives a user who chooses none")
    p.add_argument("--epochs", type=count(1), default=3)
    p.add_argument("--width", type=count(1), default=2048, help="MLP hidden width")
    p.add_argument("--batch", type=count(1), default=16, help="samples per rank per step")
    p.add_argument("--lr", type=number(above=0), default=0.05)
    p.add_argument("--shaped", action="store_true",
                   help="real tc-shaped links in network namespaces (root) instead of pacing")
    p.add_argument("--codecs", action="store_true",
                   help="instead: round-trip every algorithm on one gradient")
    p.add_argument("--size", type=count(1), default=1 << 20, help="--codecs: elements")
    p.add_argument("--seed", type=count(0), default=0, help="--codecs: data seed")
    p.set_defaults(func=_cmd_demo)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hipress`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv[:1] in (["profile"], ["plan"]):
        # These parse their own options (argparse's REMAINDER drops a leading option).
        args = parser.parse_args(argv[:1])
        args.rest = argv[1:]
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CompileError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except HiPressError as exc:
        print(f"hipress: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
