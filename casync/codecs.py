"""The codecs an engine compresses with and the residuals of its error feedback."""

from __future__ import annotations

from typing import Any

from compll import Codec, codec

from .feedback import ErrorFeedback
from .plan import Plan
from .settings import Settings

__all__ = ["Codecs"]


class Codecs:
    """One ``Codec`` per algorithm and parameters, built on first use and kept, and one
    ``ErrorFeedback`` per codec that keeps residuals.

    Args:
        settings: the engine's settings (its algorithm and parameters, error feedback).
        target: where the kernels run (``compll.codec``'s ``target``).
        seed: the RNG seed of stochastic algorithms, the same on every rank.
    """

    def __init__(self, settings: Settings, target: str, seed: int) -> None:
        self.settings = settings
        self.target = target
        self.seed = seed
        #: built codecs, by (algorithm, parameters)
        self.built: dict[tuple[str, tuple[tuple[str, Any], ...]], Codec] = {}
        #: residuals, by the codec's ``repr`` (what ``casync.state`` saves them under)
        self.residuals: dict[str, ErrorFeedback] = {}

    def of(self, plan: Plan) -> Codec:
        """The codec ``plan`` compresses with."""
        assert plan.algorithm is not None
        key = (plan.algorithm, plan.params)
        if key not in self.built:
            self.built[key] = codec(plan.algorithm, target=self.target, seed=self.seed,
                                    **dict(plan.params))
        return self.built[key]

    def feedback(self, codec: Codec) -> ErrorFeedback | None:
        """The residuals of ``codec``, or None where the settings keep none for it."""
        if not self.settings.feedback_for(codec.unbiased):
            return None
        return self.residuals.setdefault(repr(codec), ErrorFeedback())

    def probe(self) -> Codec | None:
        """The codec of the engine's own algorithm and parameters; None without one."""
        settings = self.settings
        if settings.algorithm is None:
            return None
        return self.of(Plan(settings.topology, settings.algorithm, 1, settings.params))
