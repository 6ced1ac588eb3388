"""Selective compression and partitioning from the cost model (SeCoPa, with overlap).

For each tensor, in the order tensors arrive, ``CostPlanner`` tries every candidate —
no compression, or each algorithm over ps, ring and allgather, with K = 1..N partitions
— by scheduling what the tensor adds to its chunk (its bytes and codec work, without the
fixed costs the chunk's other tensors share) on a copy of the rank's lanes
(``casync.model.timeline``) after everything already planned, and keeps the one that finishes
first. So the decision counts the work already queued on each lane: with a busy link it
compresses more, with a busy compute lane less (Espresso's lesson).

Greedy choices are myopic (an early tensor's choice can crowd the lanes for later ones)
and exploit the model's errors. So once the whole model is known (the planner observes
the engine's steps, ``observe`` and ``end_step``, and then calls ``fit``) it also
simulates the model under each topology alone and under each fixed strategy, and follows
the whole-model plan predicted fastest, preferring a fixed strategy unless a greedy plan
wins by ``GREEDY_MARGIN``, and the default topology unless another wins by
``SWITCH_MARGIN``.

Every rank computes the same plans from the same cost model and the same submission
order, so plans agree without messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..chunks import CHUNK_ELEMS
from ..plan import COMPRESSED, Plan, Planner, StaticPlanner, StepTimer
from ..transport import Transport
from .costmodel import CostModel
from .profiler import cached
from .simulate import Gradient, Result, simulate
from .timeline import Lanes, predict

__all__ = ["CostPlanner", "Decision", "GREEDY_MARGIN", "SWITCH_MARGIN", "choose_level",
           "LevelChooser"]

#: How much faster a per-tensor (greedy) whole-model plan must be predicted than the
#: best fixed strategy to be chosen: a minimum over many candidates also picks the
#: costs the model underestimates (the optimizer's curse; docs/benchmarks.md,
#: "Measurements behind the code").
GREEDY_MARGIN = 0.25

#: How much faster another fixed strategy must be predicted than the default one (the
#: first topology listed, ps) to be chosen: the same curse on a smaller scale.
SWITCH_MARGIN = 0.15


@dataclass(frozen=True)
class Decision:
    """A planned tensor: the plan, when it was ready and when it is predicted done, and
    the best uncompressed finish it was compared with."""

    name: str
    numel: int
    plan: Plan
    ready: float
    finish: float
    uncompressed: float


@dataclass
class CostPlanner:
    """Plans each tensor to minimise its predicted finish on the rank's lanes.

    Args:
        cost: the fitted cost model (``hipress profile``) or a cluster model.
        algorithms: algorithms it may compress with.
        topologies: compressed topologies it may use.
        max_partitions: cap on K (default: the world size).

    Example:
        >>> planner = CostPlanner(CostModel.load("profile.json"), ("onebit",))
        >>> Synchronizer(planner=planner)
    """

    cost: CostModel
    algorithms: tuple[str, ...] = ("onebit",)
    topologies: tuple[str, ...] = COMPRESSED
    max_partitions: int | None = None
    lanes: Lanes = field(default_factory=Lanes, repr=False)
    decisions: dict[str, Decision] = field(default_factory=dict, repr=False)
    #: the whole-model plan ``fit`` chose, which ``plan`` follows; None before a fit
    fitted: Planner | None = field(default=None, repr=False)
    #: each candidate ``fit`` simulated, with its predicted end (seconds), and the chosen
    predictions: dict[str, float] = field(default_factory=dict, repr=False)
    choice: str = field(default="", repr=False)
    #: the tensors of the step in progress as (name, elements), in submission order
    seen: list[tuple[str, int]] = field(default_factory=list, repr=False)
    #: the tensors of the last whole-model fit, and how many fits were made
    modelled: list[tuple[str, int]] | None = field(default=None, repr=False)
    fits: int = field(default=0, repr=False)
    #: whole-model fits per planner: a model whose tensors change every step keeps its
    #: last whole-model plan (tensors it has not seen are planned on first sight)
    MAX_FITS: ClassVar[int] = 3

    @classmethod
    def measured(cls, transport: Transport, algorithm: str, target: str,
                 steps: StepTimer) -> CostPlanner:
        """A planner on the costs of ``transport``'s group, profiled once and then cached
        (``casync.model.profiler.cached``): what ``plan="auto"`` runs with. ``steps`` times the
        engine's own steps for the profile (``Synchronizer.time_steps``)."""
        return cls(cached(transport, (algorithm,), target, steps=steps), (algorithm,))

    def __post_init__(self) -> None:
        self.algorithms = tuple(self.algorithms)
        self.topologies = tuple(self.topologies)
        for algo in self.algorithms:
            self.cost.encode(algo, 1)  # a clear error now if the profile lacks it

    def candidates(self, numel: int, world: int) -> list[Plan]:
        """Every plan considered for a tensor of ``numel`` elements, uncompressed first."""
        out = [Plan("none", None, 1)]
        if world < 2:
            return out
        top = min(self.max_partitions or world, world, max(numel, 1))
        for algo in self.algorithms:
            for topo in self.topologies:
                out += [Plan(topo, algo, k) for k in range(1, top + 1)]
        return out

    def choose(self, name: str, numel: int, world: int, ready: float = 0.0) -> Decision:
        """Plan one tensor that is ready at ``ready`` and commit it to the lanes."""
        best: tuple[float, Plan, Lanes] | None = None
        uncompressed = float("inf")
        for plan in self.candidates(numel, world):
            lanes = self.lanes.copy()
            finish = predict(lanes, self.cost, plan, numel, world, ready,
                             segments=plan.partitions_for(numel) if plan.compress else 1,
                             fixed=False)
            if not plan.compress:
                uncompressed = min(uncompressed, finish)
            # Strictly better only: ties keep the simpler plan listed earlier.
            if best is None or finish < best[0] * (1 - 1e-9):
                best = (finish, plan, lanes)
        assert best is not None
        self.lanes = best[2]
        decision = Decision(name, numel, best[1], ready, best[0], uncompressed)
        self.decisions[name] = decision
        return decision

    def fit(self, grads: Sequence[Any], world: int,
            chunk_elems: int = CHUNK_ELEMS) -> Planner:
        """Choose the plans of a whole model at once; ``plan`` follows them from now on.

        Simulates (``casync.model.simulate``) one iteration of ``grads`` (``Gradient``s in
        submission order, with ready times) under this planner's greedy choice over all
        its topologies, under the greedy choice restricted to each topology, and under
        each fixed strategy (``StaticPlanner``), then keeps the fastest prediction. A
        greedy plan must beat the best fixed one by ``GREEDY_MARGIN``, and a fixed
        strategy over another topology the default (the first) by ``SWITCH_MARGIN``.

        Returns:
            The planner now followed.
        """
        mixed = len(self.topologies) > 1
        candidates: dict[str, Planner] = {}
        for topos in ([self.topologies] if mixed else []) + [(t,) for t in self.topologies]:
            candidates["greedy " + "+".join(topos)] = CostPlanner(
                self.cost, self.algorithms, topos, self.max_partitions)
        for algo in self.algorithms:
            for topo in self.topologies:
                candidates[f"fixed {algo} {topo}"] = StaticPlanner(algo, topo)
        self.predictions = {
            label: simulate(self.cost, world, grads, "casync", planner=planner,
                            chunk_elems=chunk_elems).finish
            for label, planner in candidates.items()}

        default = self.topologies[0]

        def score(label: str) -> float:
            if label.startswith("greedy"):
                return self.predictions[label] / (1 - GREEDY_MARGIN)
            if not label.endswith(f" {default}"):
                return self.predictions[label] / (1 - SWITCH_MARGIN)
            return self.predictions[label]

        self.choice = min(candidates, key=score)  # ties: the first listed
        self.fitted = candidates[self.choice]
        return self.fitted

    def observe(self, tensors: list[tuple[str, int]]) -> None:
        """The engine queued ``tensors`` (name, elements) in this step."""
        self.seen.extend(tensors)

    def end_step(self, world: int, chunk_elems: int) -> None:
        """The engine closed a step: plan the whole model once its tensors are known, and
        again if they change (DDP rebuilds its buckets after the first step), at most
        ``MAX_FITS`` times. Every rank saw the same tensors, so every rank fits alike."""
        seen, self.seen = self.seen, []
        if world < 2 or not seen or seen == self.modelled or self.fits >= self.MAX_FITS:
            return
        self.fit([Gradient(name, numel) for name, numel in seen], world,
                 chunk_elems=chunk_elems)
        self.modelled = seen
        self.fits += 1

    def plan(self, name: str, numel: int, world_size: int) -> Plan:
        """The engine's interface: the plan for ``name``, decided on first sight (or by
        the whole-model plan, after ``fit``)."""
        if self.fitted is not None:
            return self.fitted.plan(name, numel, world_size)
        decision = self.decisions.get(name)
        if decision is None or decision.numel != numel:
            decision = self.choose(name, numel, world_size)
        return decision.plan

    def __repr__(self) -> str:
        # Used in the engine's config agreement check: same model, same planner.
        return (f"CostPlanner({self.algorithms}, {self.topologies}, world={self.cost.world}, "
                f"max_partitions={self.max_partitions}, "
                f"profile={self.cost.digest})")


def choose_level(cost: CostModel, nodes: int, grads: Sequence[Any],
                 algorithms: tuple[str, ...] = ("onebit",),
                 chunk_elems: int = CHUNK_ELEMS) -> tuple[CostPlanner, Result]:
    """Flat or hierarchical, for nodes of ``cost.gpus`` ranks: the hierarchical topology
    (``casync.hierarchy``: the node's level priced by ``intra``, ``nodes`` ranks across)
    and a flat one over every rank (``CostModel.flat``: a node's ranks share its link),
    each with its own whole-model plan (``CostPlanner.fit``); the one predicted to end
    first. Returns its planner and its simulated iteration (``Result.level`` says which;
    empty with one rank per node, where the two are the same).

    Example:
        >>> planner, result = choose_level(CostModel.cluster(16, 8, 100e9), 16, grads)
        >>> result.level
        'hierarchical'
    """
    options: list[tuple[str, CostModel, int]] = [("hierarchical", cost, nodes)]
    if cost.gpus > 1:
        flat = cost.flat()
        options.append(("flat", flat, flat.world))
    best: tuple[CostPlanner, Result] | None = None
    for level, model, world in options:
        # a flat job's K stops at the node count: more pieces only add messages there
        planner = CostPlanner(model, algorithms, max_partitions=nodes)
        planner.fit(grads, world, chunk_elems)
        result = simulate(model, world, grads, "casync", planner=planner,
                          chunk_elems=chunk_elems)
        result.level = level if cost.gpus > 1 else ""
        if best is None or result.finish < best[1].finish:
            best = (planner, result)
    assert best is not None
    return best


class LevelChooser:
    """Per tensor, flat or hierarchical: the engine's ``plan="auto"`` on a job of
    ``nodes`` nodes of ``cost.gpus`` ranks (a profile that fitted both links,
    ``casync.model.profiler.measure(per_node=...)``). A tensor goes the way its best plan is
    predicted to end first, alone on the lanes; the same on every rank for the same
    profile.

    Example:
        >>> chooser = LevelChooser(cost, nodes=2, algorithms=("onebit",))
        >>> chooser.hierarchical(25_000_000)
        False
    """

    def __init__(self, cost: CostModel, nodes: int,
                 algorithms: tuple[str, ...] = ("onebit",)) -> None:
        self.cost, self.nodes = cost, nodes
        self.flat_cost = cost.flat()
        self.world = nodes * cost.gpus
        self.options = {True: (cost, nodes, CostPlanner(cost, algorithms, max_partitions=nodes)),
                        False: (self.flat_cost, self.world,
                                CostPlanner(self.flat_cost, algorithms,
                                            max_partitions=self.world))}
        self._by_size: dict[int, bool] = {}

    def predicted(self, numel: int, hierarchical: bool) -> float:
        """The earliest predicted end of a tensor of ``numel`` alone, in one level."""
        cost, world, planner = self.options[hierarchical]
        return min(predict(Lanes(), cost, plan, numel, world, 0.0,
                           segments=plan.partitions_for(numel) if plan.compress else 1)
                   for plan in planner.candidates(numel, world))

    def hierarchical(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements goes through the hierarchical levels."""
        choice = self._by_size.get(numel)
        if choice is None:
            choice = self.predicted(numel, True) < self.predicted(numel, False)
            if len(self._by_size) < 4096:
                self._by_size[numel] = choice
        return choice
