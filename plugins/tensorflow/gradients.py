"""Averaging TensorFlow gradients through the shared engine, eagerly or in a graph.

Gradients leave TensorFlow once per step as NumPy arrays: in eager mode through
``Tensor.numpy()``, inside ``tf.function`` through one ``tf.numpy_function`` for the
whole list. Either way each gradient is copied once into a buffer HiPress owns before
it is averaged in place — a gradient can alias an input or another gradient (the
gradient of ``w * x`` with respect to ``w`` is ``x``), so averaging TensorFlow's own
buffers in place could corrupt the user's data — and the averaged arrays go back as new
tensors. ``docs/frameworks.md`` has the measured cost of both routes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from casync import Engine
from hipress import distributed as core
from hipress.errors import SyncError

__all__ = ["Averager", "DistributedGradientTape", "sync_errors"]

#: every SyncError an averaging step raised, in order (``sync_errors`` looks them up)
_RAISED: list[SyncError] = []


@contextlib.contextmanager
def sync_errors() -> Iterator[None]:
    """Give back the ``SyncError`` that TensorFlow wrapped.

    Eagerly, a failed synchronization raises ``hipress.SyncError`` from
    ``tape.gradient`` or ``optimizer.apply``. Inside ``tf.function`` (and so in Keras's
    ``model.fit``) TensorFlow runs HiPress's step as a ``tf.numpy_function`` and turns
    any Python exception raised there into a ``tf.errors.UnknownError``; within this
    block such an error caused by a SyncError is raised as that SyncError.

    Example:
        >>> try:
        ...     with hp.sync_errors():
        ...         loss = train_step(x, y)          # a tf.function
        ... except hipress.SyncError:
        ...     hp.shutdown(); sys.exit(1)
    """
    seen = len(_RAISED)
    try:
        yield
    except tf.errors.OpError as exc:
        if len(_RAISED) > seen:
            raise _RAISED[-1] from exc
        raise


class Averager:
    """Averages lists of gradients over ranks with one engine (created on first use)."""

    def __init__(self, options: core.EngineOptions) -> None:
        self.options = options
        self._engine = core.LazyEngine(options)

    @property
    def engine(self) -> Engine | None:
        return self._engine.engine

    def state_dict(self) -> dict[str, Any]:
        """HiPress's state (residuals, step, plan) for a checkpoint; each rank its own."""
        return self._engine.state_dict()

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()`` (same rank, same world size)."""
        self._engine.load_state_dict(state, reset_residuals)

    def _average_arrays(self, names: list[str], arrays: list[np.ndarray]) -> list[np.ndarray]:
        owned = [np.array(a, dtype=np.float32, order="C", copy=True) for a in arrays]
        try:
            return core.average_arrays(self._engine.get(), list(zip(names, owned, strict=True)))
        except SyncError as exc:
            _RAISED.append(exc)
            raise

    def average(self, grads: list[Any], names: list[str]) -> list[Any]:
        """The averaged gradients; ``None`` entries stay ``None``.

        Works eagerly and inside ``tf.function`` (one ``tf.numpy_function`` per call).
        Sparse gradients (``tf.IndexedSlices``) are densified first.
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return list(grads)
        dense = [tf.convert_to_tensor(grads[i]) for i in present]
        chosen = [names[i] for i in present]
        if tf.executing_eagerly():
            averaged = [tf.convert_to_tensor(a) for a in
                        self._average_arrays(chosen, [d.numpy() for d in dense])]
        else:
            flat = [tf.cast(d, tf.float32) for d in dense]
            averaged = tf.numpy_function(
                lambda *arrays: self._average_arrays(chosen, list(arrays)), flat,
                [tf.float32] * len(flat), stateful=True, name="hipress_average")
        out = list(grads)
        for i, d, a in zip(present, dense, averaged, strict=True):
            a = tf.reshape(a, tf.shape(d))
            a.set_shape(d.shape)
            out[i] = tf.cast(a, d.dtype) if d.dtype != tf.float32 else a
        return out


_AVERAGERS: dict[tuple[Any, ...], Averager] = {}


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over ranks.

    Args:
        tape: the tape that recorded the forward pass.
        algorithm, plan, topology, min_compress, error_feedback, timeout, guard, **params:
            as for ``hipress.torch.DistributedOptimizer`` (see ``EngineOptions``).

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(model(x), y)
        >>> tape = hp.DistributedGradientTape(tape, algorithm="dgc", ratio=0.01)
        >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(self, tape: tf.GradientTape, algorithm: str | None = None,
                 **options: Any) -> None:
        self._tape = tape
        config = core.EngineOptions(algorithm, **options)
        # Loops build a tape per step: they share one engine (and its residuals).
        self._averager = _AVERAGERS.setdefault(config.key, Averager(config))

    def state_dict(self) -> dict[str, Any]:
        """HiPress's state for a checkpoint, shared by every tape of these options (the
        engine's residuals, step and plan); each rank saves its own."""
        return self._averager.state_dict()

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()``, now or at the first ``gradient``."""
        self._averager.load_state_dict(state, reset_residuals)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 **kwargs: Any) -> Any:
        """``tape.gradient`` averaged over ranks, in the structure of ``sources``."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        names = [_name(i, s) for i, s in enumerate(tf.nest.flatten(sources))]
        return tf.nest.pack_sequence_as(grads, self._averager.average(flat, names))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def _name(index: int, source: Any) -> str:
    """A per-rank-stable gradient name: position plus the variable's path when known."""
    path = getattr(source, "path", None) or getattr(source, "name", None)
    return f"{index}:{path}" if path else str(index)
