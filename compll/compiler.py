"""CompLL's stages in one place: find and read a program, parse, check, then lower,
schedule and render it for a target (``generate``); ``compll.build`` compiles the
source, ``compll.codec`` loads it."""

from __future__ import annotations

import difflib
import os
import threading
from pathlib import Path
from typing import Any

from hipress_base.errors import CompileError, ConfigError

from . import ir
from .declarations import check
from .diagnostics import dump_stage
from .lower import lower
from .parser import parse
from .render import render, renderer_for
from .scheduling import schedule

__all__ = ["dsl_dir", "algorithms", "algorithm_path", "describe_params", "dump_stage", "load",
           "load_source", "read_source", "generate"]


def dsl_dir() -> Path:
    """Where the shipped ``.cll`` files live (source tree, or inside an installed wheel)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "dsl", here.parent / "hipress" / "dsl"):
        if candidate.is_dir():
            return candidate
    raise ConfigError(f"no dsl/ folder next to {here}; reinstall hipress")


def algorithms() -> list[str]:
    """Names of the shipped algorithms, sorted."""
    return sorted(p.stem for p in dsl_dir().glob("*.cll"))


def algorithm_path(name_or_path: str | os.PathLike[str]) -> Path:
    """Resolve a shipped algorithm name or a path to a ``.cll`` file."""
    text = str(name_or_path)
    if text.endswith(".cll") or os.sep in text:
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"no DSL file at {path}")
        return path
    path = dsl_dir() / f"{text}.cll"
    if not path.is_file():
        close = difflib.get_close_matches(text, algorithms(), 1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"unknown algorithm {text!r}; {hint}choose one of {', '.join(algorithms())} "
            "or pass the path of a .cll file"
        )
    return path


def describe_params(program: ir.Program) -> str:
    """``name=value, ...`` with f32 values printed at f32 precision (``0.1``, not ``0.1000...``)."""
    import numpy as np

    shown = []
    for p in program.params:
        value = program.param(p.name)
        text = str(np.float32(value)) if p.ty.elem == "f32" else str(value).lower()
        shown.append(f"{p.name}={text}")
    return ", ".join(shown)


def load_source(source: str, path: str = "<string>", name: str | None = None,
                params: dict[str, Any] | None = None) -> ir.Program:
    """Parse and check DSL source text.

    Args:
        source: the program text.
        path: shown in error messages.
        name: the algorithm name; defaults to the file stem of ``path``.
        params: parameter overrides.

    Returns:
        The checked ``Program``.

    Example:
        >>> prog = load_source(open("dsl/onebit.cll").read(), "dsl/onebit.cll")
    """
    name = name or Path(path).stem
    try:
        key: Any = (source, path, name, tuple(sorted((params or {}).items())))
        hash(key)
    except TypeError:  # an unhashable parameter value: the checker will say what is wrong
        key = None
    with _checked_lock:
        cached = _checked.get(key) if key is not None else None
    if cached is not None:
        return cached
    items, smap = parse(source, path)
    dump_stage("parse", items)
    program = check(items, smap, name, params)
    dump_stage("check", program)
    if key is not None:
        with _checked_lock:
            _checked[key] = program
    return program


# Checked programs by source text, path, name and parameters: every layer that needs the
# program (the settings' check, the engine's codecs, the planner) asks for it, and a file
# edited on disk has new text, so it is checked again. Programs are frozen.
_checked: dict[Any, ir.Program] = {}
_checked_lock = threading.Lock()


def read_source(path: str | os.PathLike[str]) -> str:
    """A ``.cll`` file's text.

    Raises:
        ConfigError: the file cannot be read.
        CompileError: it is not UTF-8 text (a binary file, another encoding), at 1:1.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CompileError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                           f"{exc.start}); a .cll file is UTF-8", str(path), 1, 1) from None


def load(name_or_path: str | os.PathLike[str], **params: Any) -> ir.Program:
    """Load a shipped algorithm by name, or a ``.cll`` file by path, and check it."""
    path = algorithm_path(name_or_path)
    return load_source(read_source(path), str(path), path.stem, params)


def generate(program: ir.Program, target: str) -> str:
    """The kernel source of a checked program for ``target`` (``"cpu"`` or ``"cuda"``):
    lower, schedule with the target's options, render. ``HIPRESS_DUMP`` shows each
    stage's output.

    Raises:
        BuildError: no renderer for ``target``.
    """
    options = renderer_for(target).options
    lowered = lower(program)
    dump_stage("lower", lowered)
    encode, decode = schedule(lowered, options)
    dump_stage("schedule", f"{encode}\n{decode}")
    source = render(program, encode, decode, target)
    dump_stage("render", source)
    return source
