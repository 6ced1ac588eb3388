"""What an engine carries from step to step, as a checkpoint: ``Synchronizer.state_dict``.

Compression with error feedback keeps state between steps: every encode site's residual
(per tensor segment on a worker, per re-encode on an aggregator or a ring hop), which
rank reduces each segment, the step counter that keys the stochastic codecs' random
streams, and, with ``planner="auto"``, the whole-model plan in force. Reset any of it
and a resumed job diverges from the one that ran straight through (torch's PowerSGD hook
users met this: pytorch#102717). Each rank saves its own state (residuals differ by
rank) and loads it into a job of the same world size started afresh; the continuation
is then bit-identical to the straight run.
"""

from __future__ import annotations

from typing import Any

from hipress_base.errors import ConfigError

from .feedback import ErrorFeedback
from .model.costmodel import CostModel
from .model.planner import CostPlanner
from .model.simulate import Gradient

__all__ = ["FORMAT", "state_dict", "load_state_dict"]

#: the layout of an engine's state; a state of another format is refused
FORMAT = 1


def _config(sync: Any) -> dict[str, Any]:
    """The settings a state only makes sense with (loading checks them)."""
    probe = sync.codec_params()
    planner = sync.planner
    kind = "auto" if hasattr(planner, "fit") else repr(planner)
    config = sync.config
    settings = config.settings
    return {"algorithm": settings.algorithm, "algorithm parameters": probe,
            "topology": settings.topology, "error feedback": settings.error_feedback,
            "seed": config.seed, "chunk elements": config.chunk_elems, "planner": kind,
            "guard": settings.guard}


def state_dict(sync: Any) -> dict[str, Any]:
    """The engine's state between steps (see the module docstring)."""
    planner = sync.planner
    plan: dict[str, Any] | None = None
    if hasattr(planner, "fit"):  # the cost-model planner: its model and whole-model plan
        plan = {"cost": planner.cost.to_json(), "algorithms": list(planner.algorithms),
                "topologies": list(planner.topologies), "seen": planner.modelled,
                "fits": planner.fits}
    guard = sync.steps.guard
    return {"format": FORMAT, "world": sync.size, "rank": sync.rank, "step": sync.step,
            "config": _config(sync),
            "residuals": {key: ef.state_dict()
                          for key, ef in sync.codecs.residuals.items()},
            "owners": dict(sync.steps.chunker.owners), "plan": plan,
            "guard": guard.state_dict() if guard is not None else None}


def load_state_dict(sync: Any, state: dict[str, Any], reset_residuals: bool = False) -> None:
    """Continue from ``state``; a mismatch is a ConfigError naming what differs.

    Args:
        sync: the engine, between steps.
        state: a ``state_dict`` saved by the same rank of a job of the same size.
        reset_residuals: start the residuals afresh instead (a job of another size, where
            another rank's residuals would be wrong); the step and plan still load.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"not a HiPress engine state of format {FORMAT} (got "
                          f"{state.get('format') if isinstance(state, dict) else state!r}); "
                          "save one with state_dict()")
    if not reset_residuals:
        if state["world"] != sync.size:
            raise ConfigError(
                f"the state was saved by a job of {state['world']} ranks, this one has "
                f"{sync.size} (field 'world size'): residuals are per rank; start "
                f"{state['world']} ranks, or load with reset_residuals=True")
        if state["rank"] != sync.rank:
            raise ConfigError(f"the state was saved by rank {state['rank']}, not rank "
                              f"{sync.rank} (field 'rank'): each rank loads its own")
    mine = _config(sync)
    for name, value in state["config"].items():
        if mine.get(name) != value:
            raise ConfigError(f"the state was saved with {name} = {value!r}, this engine has "
                              f"{mine.get(name)!r} (field {name!r}); load it into an engine "
                              "with the same settings")
    plan = state.get("plan")
    if plan is not None:
        planner = CostPlanner(CostModel.from_json(plan["cost"]), tuple(plan["algorithms"]),
                              tuple(plan["topologies"]))
        planner.modelled = [(name, int(n)) for name, n in plan["seen"]] if plan["seen"] \
            else None
        planner.fits = int(plan["fits"])
        if planner.modelled:
            planner.fit([Gradient(name, numel) for name, numel in planner.modelled],
                        sync.size, chunk_elems=sync.config.chunk_elems)
        sync.planner = planner
    if sync.steps.guard is not None and state.get("guard") is not None:
        sync.steps.guard.load_state_dict(state["guard"])
    sync.step = int(state["step"])
    sync.steps.chunker.owners = {tuple(k): int(v)
                                 for k, v in state.get("owners", {}).items()}
    sync.codecs.residuals = {}
    if not reset_residuals:
        for key, residuals in state["residuals"].items():
            sync.codecs.residuals[key] = ErrorFeedback()
            sync.codecs.residuals[key].load_state_dict(residuals)
