"""``hp.DiLoCo``'s settings: its defaults, and the checks of its schedule, fragments and
algorithm (``plugins/torch/diloco.py`` runs them)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from hipress.errors import ConfigError

__all__ = ["OUTER_LR", "OUTER_MOMENTUM", "DEFAULT_ALGORITHM", "DEFAULT_PARAMS", "MIN_COMPRESS",
           "schedule", "algorithm_of", "fragments_of", "shapes_digest"]

#: the outer optimizer when none is given: SGD with these, i.e. the replicas' plain average
#: becomes the global model. DiLoCo's Nesterov 0.7/0.9 (Douillard et al., 2023, tuned
#: for H = 500) never reached DDP's loss at H = 20 where this did (docs/diloco.md).
OUTER_LR = 1.0
OUTER_MOMENTUM = 0.0
#: the pseudo-gradients' codec when none is named, and its parameters (docs/diloco.md:
#: chosen by measurement; error feedback keeps 2 bits within 1 % of float32)
DEFAULT_ALGORITHM = "cgx"
DEFAULT_PARAMS = {"bits": 2}
#: every parameter is compressed when no min_compress is given: sent once per H steps,
#: even the small ones are worth it, and error feedback keeps what they lose
MIN_COMPRESS = 0


def schedule(sync_every: Any, delay: Any, alpha: Any, count: int) -> tuple[int, int, float]:
    """``sync_every``, ``fragment_sync_delay`` and ``fragment_update_alpha``, checked
    against each other and the ``count`` fragments."""
    every = _count("sync_every", sync_every, 1)
    delay = _count("fragment_sync_delay", delay, 0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ConfigError(f"fragment_update_alpha must be a number in [0, 1], not {alpha!r}")
    if every % count:
        raise ConfigError(f"sync_every ({every}) must be a multiple of the {count} "
                          "fragments: fragment f syncs at steps (f + 1) * sync_every / "
                          "fragments")
    if delay >= every // count:
        raise ConfigError(f"fragment_sync_delay ({delay}) must be below sync_every / "
                          f"fragments ({every // count}): a fragment lands before the next "
                          "one leaves")
    return every, delay, float(alpha)


def algorithm_of(algorithm: str | None, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The algorithm and its parameters: the caller's, else ``HIPRESS_ALGORITHM`` (``hipress
    run --algorithm``), else DiLoCo's default (``DEFAULT_ALGORITHM``, ``DEFAULT_PARAMS``)."""
    if algorithm is not None:
        return algorithm, params
    if os.environ.get("HIPRESS_ALGORITHM", "").strip():
        return os.environ["HIPRESS_ALGORITHM"].strip(), params
    return DEFAULT_ALGORITHM, {**DEFAULT_PARAMS, **params}


def _count(what: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{what} must be an integer >= {least}, not {value!r}")
    return value


def fragments_of(model: nn.Module, fragments: int | Sequence[nn.Module]
               ) -> list[list[nn.Parameter]]:
    """The parameters of each fragment, in the model's order."""
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(fragments, int):  # a bool is refused here
        count = _count("fragments", fragments, 1)
        # the modules that own parameters, or the tensors where there are fewer modules
        groups = [[p for p in m.parameters(recurse=False) if p.requires_grad]
                  for m in model.modules()]
        groups = [g for g in groups if g]
        if len(groups) < count:
            groups = [[p] for p in params]
        split: list[list[nn.Parameter]] = [[] for _ in range(count)]
        for j, group in enumerate(groups):
            split[j % count].extend(group)
    else:
        split = [[p for p in m.parameters() if p.requires_grad] for m in fragments]
    seen = [id(p) for part in split for p in part]
    if len(seen) != len(set(seen)) or set(seen) != {id(p) for p in params}:
        raise ConfigError("fragments must hold every trainable parameter of the model "
                          "exactly once")
    if any(not part for part in split):
        raise ConfigError(f"a fragment has no parameters: {len(split)} fragments for a "
                          f"model whose modules own parameters in {len(params)} tensors")
    order = {id(p): i for i, p in enumerate(params)}
    return [sorted(part, key=lambda p: order[id(p)]) for part in split]


def shapes_digest(fragments: list[list[nn.Parameter]]) -> str:
    """A digest of every fragment's parameter shapes (replicas must cut alike)."""
    text = repr([[tuple(p.shape) for p in part] for part in fragments])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
