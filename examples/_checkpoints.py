"""Per-rank checkpoints for the training examples: each rank saves its own state every
few steps (atomically, the newest ``keep`` kept), and a (re)started job resumes from the
newest step that every rank saved (a rank may have died between its save and the
others')."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hipress.distributed import allgather_object

__all__ = ["save", "newest", "save_training", "resume"]


def save(folder: Path, rank: int, step: int, state: dict[str, Any], keep: int = 2) -> None:
    """Write this rank's ``state`` after ``step`` steps; prune its older checkpoints."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}-step{step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in sorted(folder.glob(f"rank{rank}-step*.pt"))[:-keep]:
        old.unlink()


def newest(folder: Path, rank: int) -> tuple[int, dict[str, Any] | None]:
    """The newest step every rank saved and this rank's state there; (0, None) without."""
    mine = sorted(int(p.stem.split("step")[1]) for p in folder.glob(f"rank{rank}-step*.pt"))
    everyone = set.intersection(*(set(steps) for steps in allgather_object(mine)))
    if not everyone:
        return 0, None
    step = max(everyone)
    return step, torch.load(folder / f"rank{rank}-step{step:07d}.pt", weights_only=True)


def save_training(folder: Path, rank: int, step: int, model: Any, opt: Any,
                  engine: Any) -> None:
    """This rank's model (or shards), optimizer and HiPress state (``engine``: a DDP hook's
    or FSDP's state; None where the optimizer's state_dict holds it) after ``step``."""
    save(folder, rank, step, {"step": step, "model": model.state_dict(),
                              "opt": opt.state_dict(),
                              "hipress": engine.state_dict() if engine is not None else None})


def resume(folder: Path, rank: int, model: Any, opt: Any, engine: Any) -> int:
    """Load what ``save_training`` saved at the newest step every rank saved; the step to
    continue from, 0 without checkpoints."""
    step, saved = newest(folder, rank)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        if engine is not None and saved["hipress"] is not None:
            engine.load_state_dict(saved["hipress"])
    return step
