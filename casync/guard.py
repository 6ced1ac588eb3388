"""What no codec is given: the engine's rules on top of any planner (``guard=True``).

A planner chooses by cost; these rules keep the information a codec would lose, whatever
the planner chose, and every rank applies them alike:

1. **Warm-up.** The first ``warmup`` steps are synchronized uncompressed, as PowerSGD's
   ``start_powerSGD_iter`` does: a model's first updates are its largest, and an adaptive
   optimizer sets its moment estimates from them.
2. **Row-sparse gradients.** During the warm-up the engine counts the exact zeros of every
   tensor's *averaged* gradient (the same bits on every rank, so every rank decides the
   same with no message). A tensor of which at least ``sparse_share``, but not all, was
   zero in every warm-up step that had it (an embedding whose untouched rows get no
   gradient) is never compressed: a quantizer's scales and a sign codec's mean would turn
   those zeros into values, and error feedback would carry them into the next steps. A
   gradient that is all zeros (a layer behind a zero-initialised scale, as in residual
   blocks that start as the identity) says nothing yet and does not count.

Reduce-scatters (``scatter``: FSDP2) keep their plans: each rank sees only its shard's
average there, so a rule on the data would differ by rank. ``HIPRESS_DUMP=plan`` prints
every tensor's plan when it changes, with the rule that chose it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

from .plan import SCATTER, Plan

__all__ = ["Guard", "WARMUP_STEPS", "SPARSE_SHARE", "dumping"]

#: Steps synchronized uncompressed at the start (``warmup``).
WARMUP_STEPS = 2
#: The share of exact zeros in an averaged warm-up gradient from which a tensor stays
#: uncompressed: a dense layer's gradient has almost none, an embedding's mostly zeros.
SPARSE_SHARE = 0.5


def dumping() -> bool:
    """Whether ``HIPRESS_DUMP`` asks for the engine's plans (``plan`` or ``all``)."""
    wanted = os.environ.get("HIPRESS_DUMP", "")
    return wanted == "all" or "plan" in wanted.split(",")


class Guard:
    """The rules above, for one engine.

    Args:
        warmup: steps synchronized uncompressed, during which gradients are counted.
        sparse_share: the share of exact zeros from which a tensor stays uncompressed.

    Example:
        >>> guard = Guard()
        >>> plans, why = guard.adjust(0, ["emb"], [Plan("ps", "cgx")])
        >>> plans[0].topology, why[0]
        ('none', 'warm-up (the first 2 steps)')
    """

    def __init__(self, warmup: int = WARMUP_STEPS, sparse_share: float = SPARSE_SHARE) -> None:
        self.warmup = int(warmup)
        self.sparse_share = float(sparse_share)
        #: tensors kept uncompressed for good: name -> the least share of zeros seen
        self.sparse: dict[str, float] = {}
        #: per tensor counted in the warm-up: [steps counted, steps row-sparse, least share]
        self.counts: dict[str, list[float]] = {}
        self._decided = False
        self._raw: dict[int, Plan] = {}  # one uncompressed plan per partition count
        self._lock = threading.Lock()  # graphs finish (and are inspected) on several threads

    def _uncompressed(self, plan: Plan) -> Plan:
        raw = self._raw.get(plan.partitions)
        if raw is None:
            raw = self._raw[plan.partitions] = Plan("none", None, plan.partitions)
        return raw

    def adjust(self, step: int, names: list[str], plans: list[Plan]
               ) -> tuple[list[Plan], list[str | None]]:
        """The plans the rules leave for ``names`` in ``step``, and each one's rule (None
        where the planner's plan stands)."""
        warming = step < self.warmup
        if not warming and not self._decided:
            self._decide()
        out: list[Plan] = []
        why: list[str | None] = []
        for name, plan in zip(names, plans, strict=True):
            if not plan.compress or plan.topology == SCATTER:
                out.append(plan)
                why.append(None)
            elif warming:
                out.append(self._uncompressed(plan))
                why.append(f"warm-up (the first {self.warmup} steps)")
            elif name in self.sparse:
                out.append(self._uncompressed(plan))
                why.append(f"row-sparse (at least {self.sparse[name]:.0%} zeros in the "
                           "warm-up)")
            else:
                out.append(plan)
                why.append(None)
        return out, why

    def _decide(self) -> None:
        """After the warm-up: the tensors that were row-sparse in every step counted."""
        with self._lock:
            self.sparse = {name: least for name, (seen, sparse, least) in self.counts.items()
                           if seen and sparse == seen}
            self._decided = True

    def watching(self, step: int) -> bool:
        """Whether ``step``'s averaged gradients are counted."""
        return step < self.warmup

    def inspect(self, name: str, averaged: Any) -> None:
        """Count the zeros of ``averaged``: a flat NumPy array, or a torch tensor (counted
        on its device)."""
        if isinstance(averaged, np.ndarray):
            n, nonzero = averaged.size, int(np.count_nonzero(averaged))
        else:
            n, nonzero = averaged.numel(), int(averaged.count_nonzero())
        if n == 0 or nonzero == 0:  # nothing, or no gradient yet: no evidence either way
            return
        share = (n - nonzero) / n
        with self._lock:
            seen, sparse, least = self.counts.get(name, (0, 0, 1.0))
            self.counts[name] = [seen + 1, sparse + (share >= self.sparse_share),
                                 min(least, share)]

    def state_dict(self) -> dict[str, Any]:
        """The rules' settings, counts and decisions: plain values (a checkpoint needs no
        pickle)."""
        return {"warmup": self.warmup, "sparse_share": self.sparse_share,
                "decided": self._decided,
                "sparse": {name: float(share) for name, share in sorted(self.sparse.items())},
                "counts": {name: [int(c[0]), int(c[1]), float(c[2])]
                           for name, c in sorted(self.counts.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sparse = {str(name): float(share) for name, share in state["sparse"].items()}
        self.counts = {str(name): [int(c[0]), int(c[1]), float(c[2])]
                       for name, c in state["counts"].items()}
        self._decided = bool(state["decided"])

    def __repr__(self) -> str:
        return f"Guard(warmup={self.warmup}, sparse_share={self.sparse_share})"


class PlanDump:
    """``HIPRESS_DUMP=plan``: prints a tensor's plan the first time and when it changes."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.last: dict[str, tuple[Plan, str | None]] = {}

    def show(self, step: int, names: list[str], numels: list[int], plans: list[Plan],
             why: list[str | None]) -> None:
        for name, numel, plan, reason in zip(names, numels, plans, why, strict=True):
            if self.last.get(name) == (plan, reason):
                continue
            self.last[name] = (plan, reason)
            what = "uncompressed" if not plan.compress else \
                f"{plan.algorithm} over {plan.topology}, {plan.partitions} part(s)"
            print(f"hipress plan: rank {self.rank} step {step}: {name} ({numel:,} elements): "
                  f"{what}" + (f" [{reason}]" if reason else ""), file=sys.stderr)
