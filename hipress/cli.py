"""The ``hipress`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
    from compll.compiler import describe_params
    from compll.payload import header_size

    for path in args.files:
        try:
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
        program = load_source(source, path, params=dict(args.param or ()))
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
    from .demo import run_roundtrip_demo

    return run_roundtrip_demo(args.size, args.seed)


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
    parser = argparse.ArgumentParser(
        prog="hipress", description="Compression-aware gradient synchronization."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("algorithms", help="list the shipped compression algorithms")
    p.set_defaults(func=_cmd_algorithms)

    p = sub.add_parser("compile", help="check a CompLL file; with --target, build its kernels")
    p.add_argument("files", nargs="+", metavar="FILE.cll")
    p.add_argument("--param", "-p", action="append", type=_param, metavar="NAME=VALUE",
                   help="override a parameter (repeatable)")
    p.add_argument("--target", choices=["cpu", "cuda"],
                   help="also generate and build kernels for this target")
    p.add_argument("-o", "--output", metavar="DIR", help="copy the source and library here")
    p.set_defaults(func=_cmd_compile)

    p = sub.add_parser("bench", help="run a benchmark from bench/ (kernels, sync)")
    p.add_argument("which", choices=["kernels", "sync"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("demo", help="round-trip every algorithm and print what it achieves")
    p.add_argument("--size", type=int, default=1 << 20, help="elements per tensor")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hipress`` console script."""
    args = _parser().parse_args(argv)
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
