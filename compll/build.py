"""Compile rendered kernels and cache the artifacts.

``build(program, target)`` renders, compiles and returns the path of a shared
library. Artifacts live under ``$HIPRESS_CACHE_DIR`` (default ``~/.cache/hipress``),
keyed by a hash of the rendered source, the runtime headers, the compiler's version,
the flags and the target. Concurrent builds of one key (several ranks starting at
once) wait on a file lock, and every file lands with an atomic ``os.replace``.
``HIPRESS_NO_CACHE=1`` builds into a fresh temporary folder instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import ir
from .compiler import generate
from .constants import header_text
from .diagnostics import BuildError

__all__ = ["Artifact", "build", "cache_dir", "compiler_for", "cuda_archs", "pip_nvcc",
           "CPU_FLAGS", "CUDA_ARCHS", "EMU_FLAGS", "TARGETS"]

_TEMPLATES = Path(__file__).parent / "templates"
#: No -ffast-math and no FMA contraction: kernels must round exactly like the interpreter.
#: -fno-trapping-math only lets GCC evaluate both sides of a select (no FP traps are ever
#: enabled), which is what turns selects into vector blends; no result changes.
CPU_FLAGS = ("-std=c++17", "-O3", "-pthread", "-fPIC", "-ffp-contract=off",
             "-fno-math-errno", "-fno-trapping-math", "-march=native", "-w")
#: The CPU source compiles as two objects at once (encoder, decoder), then links.
CPU_PARTS = ("-DHP_PART=1", "-DHP_PART=2")
#: cuda-emu: the CUDA target's source as host C++ against templates/emu/cuda_runtime.h
#: (the launches run on the CPU under a deterministic scheduler). -O2, not the CPU
#: target's -O3 -march=native: an emulator's speed matters less than a quick build, and
#: rounding is the same without FMA contraction.
EMU_FLAGS = ("-x", "c++", "-std=c++17", "-O2", "-fPIC", "-shared", "-ffp-contract=off",
             "-fno-math-errno", "-w")
#: ``HIPRESS_EMU_ASAN=1`` adds AddressSanitizer (out-of-bounds and use-after-free reads
#: of emulated device memory); the process must then load libasan first (LD_PRELOAD).
EMU_ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer")
#: What ``build`` takes.
TARGETS = ("cpu", "cuda", "cuda-emu")
#: Architectures built when no device says which (``cuda_archs``).
CUDA_ARCHS = ("80", "90")
#: ``--threads 0``: nvcc compiles the architectures at once, one thread each, so a
#: build takes about as long as its slowest architecture, not their sum.
CUDA_FLAGS = ("-std=c++17", "-O3", "--extended-lambda", "--fmad=false", "--threads", "0",
              "-Xcompiler", "-fPIC", "-shared", "-w")


@dataclass(frozen=True)
class Artifact:
    """A built kernel library and where its source is."""

    library: Path
    source: Path
    key: str
    cached: bool
    seconds: float


def cache_dir() -> Path:
    """Where artifacts are cached: ``$HIPRESS_CACHE_DIR`` or ``~/.cache/hipress``."""
    root = os.environ.get("HIPRESS_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "hipress"


def pip_nvcc() -> str | None:
    """NVIDIA's pip-packaged nvcc in this environment (``pip install 'hipress[cuda]'``
    installs ``nvidia-cuda-nvcc``: ``nvidia/cu13/bin/nvcc``, or ``nvidia/cuda_nvcc/bin``
    for CUDA 12's wheels), or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for found in sorted(Path(root).glob("*/bin/nvcc"), reverse=True):  # newest cuXY
            if os.access(found, os.X_OK):
                return str(found)
    return None


def compiler_for(target: str) -> str:
    """The compiler executable for a target, or BuildError saying which variable to set.

    CUDA: ``NVCC`` if set, else the environment's pip nvcc (it matches the toolkit the
    user installed with HiPress), else ``nvcc`` on the PATH. NVRTC is no option: the
    generated CUDA source holds host code (launches, the scalar logic) as well as kernels,
    and NVRTC compiles device code only."""
    if target in ("cpu", "cuda-emu"):
        names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
        var = "CXX"
    else:
        names = [os.environ["NVCC"]] if os.environ.get("NVCC") else ["nvcc"]
        var = "NVCC"
        if not os.environ.get("NVCC"):
            found = pip_nvcc()
            if found:
                return found
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    hint = " (or pip install 'hipress[cuda]')" if target == "cuda" else ""
    raise BuildError(
        f"no {'CUDA' if target == 'cuda' else 'C++'} compiler found (tried {', '.join(names)}); "
        f"install one{hint} or set {var} to its path"
    )


def cuda_archs() -> tuple[str, ...]:
    """The SM architectures to build: ``HIPRESS_CUDA_ARCHS`` (``"80,90"``), else the
    visible devices' compute capabilities, else ``CUDA_ARCHS``."""
    raw = os.environ.get("HIPRESS_CUDA_ARCHS", "").replace(" ", "")
    if raw:
        archs = tuple(dict.fromkeys(raw.split(",")))
        if not all(a.isdigit() and len(a) in (2, 3) for a in archs):
            raise BuildError(f"HIPRESS_CUDA_ARCHS={raw!r}: give SM numbers such as 80,90")
        return archs
    try:
        import torch

        if torch.cuda.is_available():
            caps = {torch.cuda.get_device_capability(d) for d in range(torch.cuda.device_count())}
            return tuple(sorted(f"{major}{minor}" for major, minor in caps))
    except Exception:  # noqa: BLE001  (no torch, or no driver: build the default set)
        pass
    return CUDA_ARCHS


@functools.lru_cache(maxsize=8)
def _compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60, check=False)
    except OSError as exc:
        raise BuildError(f"cannot run {compiler}: {exc}") from None
    return out.stdout.strip()


@functools.lru_cache(maxsize=1)
def _host_signature() -> str:
    """What -march=native depends on: the processor model and its feature flags."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return text


def _runtime_text(target: str) -> str:
    runtime = (["cpu_runtime.h", "cpu_blocks.h", "cpu_pool.h"] if target == "cpu"
               else ["cuda_runtime.cuh", "cuda_blocks.cuh"])
    if target == "cuda-emu":
        runtime.append("emu/cuda_runtime.h")
    names = ["common.h", "host.h", *runtime]
    return header_text() + "".join((_TEMPLATES / n).read_text() for n in names)


def _steps(target: str, compiler: str, source: Path, library: Path,
           archs: tuple[str, ...] = CUDA_ARCHS) -> list[list[list[str]]]:
    """The compiler runs for one build: steps run in order, the commands of a step at once."""
    # hp_constants.h is rendered next to the source, so the folder goes on the path too
    include = [f"-I{source.parent}", f"-I{_TEMPLATES}"]
    if target == "cpu":
        objects = [library.with_suffix(f".{k}.o") for k in range(len(CPU_PARTS))]
        compile_step = [[compiler, *CPU_FLAGS, part, *include, "-c", str(source), "-o", str(obj)]
                        for part, obj in zip(CPU_PARTS, objects, strict=True)]
        link = [compiler, "-shared", "-pthread", *map(str, objects), "-o", str(library)]
        return [compile_step, [link]]
    if target == "cuda-emu":
        # the emulator's header comes first, standing in for <cuda_runtime.h>
        return [[[compiler, *_emu_flags(), f"-I{_TEMPLATES / 'emu'}", *include, str(source),
                  "-o", str(library)]]]
    arch = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return [[[compiler, *CUDA_FLAGS, *arch, *include, str(source), "-o", str(library)]]]


def _run_all(cmds: list[list[str]]) -> tuple[list[str], str] | None:
    """Run commands at once; the first failing one and its output, or None."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for c in cmds:
            procs.append(subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
    except OSError as exc:
        for proc in procs:  # do not leave the ones already started running
            proc.kill()
            proc.wait()
        raise BuildError(f"cannot run {cmds[0][0]}: {exc}") from None
    failed = None
    for cmd, proc in zip(cmds, procs, strict=True):
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0 and failed is None:
            failed = (cmd, (err or out).strip())
    return failed


def _emu_flags() -> tuple[str, ...]:
    asan = os.environ.get("HIPRESS_EMU_ASAN", "") not in ("", "0")
    return EMU_FLAGS + (EMU_ASAN_FLAGS if asan else ())


def _suffix(target: str) -> str:
    return ".cpp" if target == "cpu" else ".cu"


def build(program: ir.Program, target: str, use_cache: bool | None = None) -> Artifact:
    """Render ``program`` for ``target`` and compile it, reusing a cached build.

    Args:
        program: a checked program (parameters are compiled in).
        target: ``"cpu"``, ``"cuda"`` or ``"cuda-emu"`` (the CUDA source, emulated on
            the CPU).
        use_cache: default: on unless ``HIPRESS_NO_CACHE`` is set.

    Returns:
        The ``Artifact`` with the library path.

    Raises:
        BuildError: no compiler, or the compiler failed (its message is included).
    """
    if use_cache is None:
        use_cache = os.environ.get("HIPRESS_NO_CACHE", "") in ("", "0")
    if target not in TARGETS:
        raise BuildError(f"no build target {target!r}; choose one of {', '.join(TARGETS)}")
    source = generate(program, "cuda" if target == "cuda-emu" else target)
    compiler = compiler_for(target)
    archs = cuda_archs() if target == "cuda" else ()
    flags = {"cpu": CPU_FLAGS + CPU_PARTS, "cuda": CUDA_FLAGS + archs,
             "cuda-emu": _emu_flags()}[target]
    key = hashlib.sha256("\0".join([
        source, _runtime_text(target), _compiler_version(compiler), " ".join(flags), target,
        _host_signature() if target == "cpu" else "",
    ]).encode()).hexdigest()[:32]
    if not use_cache:
        folder = Path(tempfile.mkdtemp(prefix="hipress-build-"))
        return _compile(target, compiler, source, folder, key, program.name, archs)
    folder = cache_dir() / target / key
    library = folder / f"{program.name}.so"
    if library.exists():
        return Artifact(library, folder / f"{program.name}{_suffix(target)}", key, True, 0.0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building this key
        try:
            if library.exists():
                return Artifact(library, folder / f"{program.name}{_suffix(target)}", key,
                                True, 0.0)
            return _compile(target, compiler, source, folder, key, program.name, archs)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _compile(target: str, compiler: str, source: str, folder: Path, key: str,
             name: str, archs: tuple[str, ...]) -> Artifact:
    started = time.perf_counter()
    src_path = folder / f"{name}{_suffix(target)}"
    lib_path = folder / f"{name}.so"
    tmp_src = folder / f".{name}.{os.getpid()}{_suffix(target)}"
    tmp_lib = folder / f".{name}.{os.getpid()}.so"
    tmp_src.write_text(source)
    (folder / "hp_constants.h").write_text(header_text())
    try:
        for step in _steps(target, compiler, tmp_src, tmp_lib, archs):
            failed = _run_all(step)
            if failed is not None:
                tmp_lib.unlink(missing_ok=True)
                cmd, message = failed
                raise BuildError(
                    f"building {name} for {target} failed; the source is {tmp_src}\n"
                    f"$ {' '.join(cmd)}\n{message[-4000:]}"
                )
    finally:
        for obj in folder.glob(f".{name}.{os.getpid()}.*.o"):
            obj.unlink(missing_ok=True)
    os.replace(tmp_src, src_path)
    os.replace(tmp_lib, lib_path)
    return Artifact(lib_path, src_path, key, False, time.perf_counter() - started)
