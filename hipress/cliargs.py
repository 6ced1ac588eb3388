"""Argument checks shared by every ``hipress`` subcommand and benchmark.

A bad value on the command line is one line on stderr (``hipress run: error: argument
--timeout: must be a number > 0, not '-5'``) and exit code 2, as argparse's own errors,
but without the usage block that pushes the reason off a narrow log.

Example:
    >>> parser = Parser(prog="hipress plan")
    >>> parser.add_argument("--nodes", type=count(1))
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["Parser", "count", "number", "rate", "algorithm", "algorithm_or_none", "port",
           "add_nodes", "nodes_of"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (its subparsers too)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def count(minimum: int = 0) -> Callable[[str], int]:
    """An integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(above: float | None = None, minimum: float | None = None) -> Callable[[str], float]:
    """A finite number greater than ``above`` (or at least ``minimum``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text!r}")
        if above is not None and not value > above:
            raise argparse.ArgumentTypeError(f"must be a number > {above:g}, not {text!r}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be a number >= {minimum:g}, not {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def port(text: str) -> int:
    """A TCP port, 1 to 65535."""
    value = count(1)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 1 to 65535, not {value}")
    return value


def rate(text: str) -> str:
    """A link rate in tc's syntax (``1gbit``, ``100mbit``), checked, kept as text."""
    from casync.transport import parse_rate

    try:
        value = parse_rate(text)
    except Exception:  # noqa: BLE001 - parse_rate's own message is less direct
        raise argparse.ArgumentTypeError(f"must be a rate such as 1gbit or 100mbit, not "
                                         f"{text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive rate, not {text!r}")
    return text


def algorithm(text: str) -> str:
    """A shipped algorithm's name or the path of a ``.cll`` file."""
    from compll.compiler import algorithm_path

    from .errors import ConfigError

    try:
        algorithm_path(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def algorithm_or_none(text: str) -> str:
    """``none`` (no compression) or what ``algorithm`` takes."""
    return text if text == "none" else algorithm(text)


def choices_of(kind: str, allowed: Any) -> Callable[[str], str]:
    """One of ``allowed``, with a "did you mean" for a near miss."""
    import difflib

    def parse(text: str) -> str:
        if text in allowed:
            return text
        close = difflib.get_close_matches(text, list(allowed), 1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise argparse.ArgumentTypeError(f"unknown {kind} {text!r}{hint}; choose from "
                                         f"{', '.join(allowed)}")

    parse.__name__ = kind
    return parse


def add_nodes(parser: argparse.ArgumentParser, ranks: int = 4) -> None:
    """``--ranks`` (one per shaped node), or ``--nodes`` with ``--ranks-per-node``: nodes
    whose ranks share a namespace, only the links between nodes shaped."""
    parser.add_argument("--ranks", type=count(2), default=ranks,
                        help="ranks, each a node of its own")
    parser.add_argument("--nodes", type=count(1),
                        help="shaped nodes (with --ranks-per-node; replaces --ranks)")
    parser.add_argument("--ranks-per-node", type=count(1), default=1,
                        help="ranks sharing each node's namespace (unshaped between them)")


def nodes_of(args: argparse.Namespace) -> tuple[int, int]:
    """(ranks, ranks per node) from ``add_nodes``'s options; sets ``args.ranks``."""
    if args.nodes is not None:
        args.ranks = args.nodes * args.ranks_per_node
        if args.ranks < 2:
            raise SystemExit("--nodes x --ranks-per-node must make at least 2 ranks")
        return args.ranks, args.ranks_per_node
    if args.ranks_per_node != 1:
        raise SystemExit("--ranks-per-node needs --nodes")
    return args.ranks, 1
