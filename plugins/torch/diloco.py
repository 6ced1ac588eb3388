"""Low-communication training: ``hp.DiLoCo`` (DiLoCo and Streaming DiLoCo) with the outer
synchronization through CaSync, compressed, with error feedback, in the background.

Each replica takes ``sync_every`` (H) steps of its own optimizer (the *inner* one) alone;
then the replicas average each parameter's *pseudo-gradient*, the saved global value
minus the local one, and an *outer* optimizer applies the average to the global values,
which every replica then takes (by default SGD with lr 1: the replicas' average becomes
the global model; DiLoCo's Nesterov SGD is one argument away). Streaming DiLoCo cuts
the model into ``fragments`` synchronized at staggered steps (fragment f at steps
(f + 1) H / F, then every H), and lets each fragment's averaging run in the background
for ``fragment_sync_delay`` (tau) inner steps before its outer step.

The merge rule when a fragment lands tau steps after it was sent: the outer step gives
the new global value G' from the saved G and the averaged pseudo-gradient; the replica's
parameter becomes ``alpha * local + (1 - alpha) * G'`` with ``alpha`` =
``fragment_update_alpha``: 0 (the default) takes G' (the tau local steps on that fragment
are dropped, every replica ends with the same bits), 0.5 keeps half of them (Streaming
DiLoCo's choice; replicas then differ by what they learned meanwhile).

The pseudo-gradients travel through a CaSync engine on the replicas' group, compressed by
``algorithm`` (any CompLL codec; ``"none"`` is a plain float32 all-reduce) with error
feedback: each parameter keeps its residual from one synchronization to the next.

    with hp.DiLoCo(model, inner_opt, sync_every=32):
        for x, y in data:
            loss_fn(model(x), y).backward()
            inner_opt.step()          # every 32nd step also synchronizes
            inner_opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from casync import Engine
from casync.settings import agree
from hipress import distributed as core
from hipress.errors import ConfigError

from .diloco_settings import (
    DEFAULT_ALGORITHM,
    DEFAULT_PARAMS,
    MIN_COMPRESS,
    OUTER_LR,
    OUTER_MOMENTUM,
    algorithm_of,
    fragments_of,
    schedule,
    shapes_digest,
)
from .state import plain

__all__ = ["DiLoCo", "OUTER_LR", "OUTER_MOMENTUM", "DEFAULT_ALGORITHM", "DEFAULT_PARAMS"]

#: the state's layout; another is refused
FORMAT = 1


class _Pending:
    """A fragment's synchronization in flight: sent after inner step ``sent``, applied
    after step ``due``; ``deltas`` hold the pseudo-gradients, averaged once it lands.
    ``began`` and ``finished`` time the averaging (``perf_counter``), for the share of it
    the inner steps hid."""

    def __init__(self, fragment: int, sent: int, due: int,
                 deltas: list[torch.Tensor], landed: bool = False) -> None:
        self.fragment, self.sent, self.due = fragment, sent, due
        self.deltas = deltas
        self.landed = landed
        self.began = time.perf_counter()
        self.finished: float | None = None


class DiLoCo:
    """DiLoCo around a training loop: a context manager that synchronizes through the
    inner optimizer's step (``torchft.local_sgd.DiLoCo``'s shape and names).

    Args:
        model: the replica's model; its parameters are made equal on every replica here
            (from the group's first rank).
        inner_optimizer: the optimizer the loop steps (AdamW in DiLoCo).
        sync_every: H, inner steps between two synchronizations of a fragment.
        outer_optimizer: an optimizer over ``model.parameters()`` that applies the averaged
            pseudo-gradients; default SGD with ``OUTER_LR`` and ``OUTER_MOMENTUM`` (the
            paper's: ``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)``).
        fragments: how many fragments (Streaming DiLoCo), or the modules that make them
            (torchft's ``model_fragments``); an int strides the model's modules that own
            parameters over the fragments (module j to fragment j mod F), so each fragment
            spans the model's depth (its parameter tensors, if it has fewer modules than
            fragments). ``sync_every`` must be a multiple of their number.
        fragment_sync_delay: tau, inner steps a fragment's averaging runs in the background
            before its outer step (below ``sync_every / fragments``).
        fragment_update_alpha: how much of the local value a landing fragment keeps
            (module docstring).
        algorithm: the pseudo-gradients' CompLL codec, or ``"none"`` (float32); default
            ``HIPRESS_ALGORITHM`` (``hipress run --algorithm``) if set, else
            ``DEFAULT_ALGORITHM`` with ``DEFAULT_PARAMS``.
        error_feedback: ``None`` = on for biased codecs.
        topology: ``ps``, ``ring`` or ``allgather``.
        min_compress: parameters below this many elements go uncompressed (default:
            none).
        timeout: seconds before a silent replica raises ``SyncError``.
        group: the replicas' Gloo group (default: every rank, one rank a replica); with
            several ranks a replica, this rank's peers in the other replicas (the
            ``replicate`` dimension of a 2-D mesh). Under FSDP2 inside a replica each rank
            averages its own shards with its peers'.
        replica_group: with DDP inside a replica (every rank of it holds the whole
            model): the replica's own ranks (the fast dimension). Each rank then
            synchronizes a share of the parameters and hands the new values to the others
            over this group.
        guard: the engine's rules (``casync.guard``; off by default here: H steps of
            updates make dense pseudo-gradients).
        **codec_params: the codec's parameters (``bits=2`` for cgx).

    Raises:
        ConfigError: a bad setting, or replicas that disagree on one (the field named,
            before anything is averaged).

    Example:
        >>> with hp.DiLoCo(model, torch.optim.AdamW(model.parameters(), 1e-3),
        ...                sync_every=32, fragments=4, fragment_sync_delay=2):
        ...     train(model)
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int, *, outer_optimizer: torch.optim.Optimizer | None = None,
                 fragments: int | Sequence[nn.Module] = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, algorithm: str | None = None,
                 error_feedback: bool | None = None, topology: str = "ps",
                 min_compress: int = MIN_COMPRESS, timeout: float | None = None,
                 group: Any = None, replica_group: Any = None, guard: bool = False,
                 **codec_params: Any) -> None:
        # user knobs, validated here (a ConfigError says why)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.fragments = fragments_of(model, fragments)
        count = len(self.fragments)
        self.sync_every, self.fragment_sync_delay, self.fragment_update_alpha = schedule(
            sync_every, fragment_sync_delay, fragment_update_alpha, count)
        algorithm, codec_params = algorithm_of(algorithm, codec_params)
        if not core.is_initialized():
            core.init()
        self.group = group if group is not None else core.gloo_group()
        options = core.EngineOptions(algorithm, "static", topology,
                                     min_compress, error_feedback, timeout, guard=guard,
                                     group=self.group, **codec_params)
        self.algorithm = options.algorithm
        self.replica_group = replica_group
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        params = [p for p in model.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(params)}
        self._params = params
        self._owners = _owners(params, replica_group)
        self._local_rank = dist.get_rank(replica_group) if replica_group is not None else 0
        # Replicas that disagree fail here, naming the field, before any collective.
        agree({"sync_every": self.sync_every, "fragments": count,
               "fragment_sync_delay": self.fragment_sync_delay,
               "fragment_update_alpha": self.fragment_update_alpha,
               "parameters": shapes_digest(self.fragments)},
              self.group, self.rank, self.size, options.settings.timeout)
        self.engine: Engine = options.engine()
        self.outer_optimizer = outer_optimizer if outer_optimizer is not None else \
            torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                            nesterov=OUTER_MOMENTUM > 0)
        with torch.no_grad():  # one starting point on every replica
            _broadcast([_shard(p) for p in params], self.group)
        # internal state
        self.step = 0  # inner steps taken
        # G: the last global values (of this rank's shards, under FSDP2)
        self.globals = [_shard(p).detach().clone() for p in params]
        self._pending: _Pending | None = None
        self._hook: Any = None
        # statistics
        self.syncs = 0
        self.outer_seconds = 0.0  # the averagings' own time, sent to landed
        self.waited_seconds = 0.0  # the part of it the training loop waited for

    # -- the context manager ------------------------------------------------------------

    def __enter__(self) -> DiLoCo:
        self._hook = self.inner_optimizer.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._hook is not None:
            self._hook.remove()  # the optimizer steps alone again
            self._hook = None

    def _after_step(self, *_: Any) -> None:
        self.step += 1
        pending = self._pending
        if pending is not None and pending.due == self.step:
            self._apply(pending)
        per = self.sync_every // len(self.fragments)
        if self.step % per == 0:  # fragment f leaves at (f + 1) * per, then every H
            self._send((self.step // per - 1) % len(self.fragments))

    # -- one fragment's synchronization ---------------------------------------------------

    def _owned(self, fragment: int) -> list[torch.nn.Parameter]:
        return [p for p in self.fragments[fragment]
                if self._owners[self._index[id(p)]] == self._local_rank]

    def _send(self, fragment: int) -> None:
        """Average the fragment's pseudo-gradients (G - local) in the background; applied
        now, or ``fragment_sync_delay`` steps from now."""
        owned = self._owned(fragment)
        deltas = []
        with torch.no_grad():
            for p in owned:
                i = self._index[id(p)]
                deltas.append((self.globals[i] - _shard(p).detach()).float().contiguous()
                              .view(-1))
        pending = _Pending(fragment, self.step, self.step + self.fragment_sync_delay, deltas)
        if deltas:
            future = self.engine.submit_many((f"diloco.{self._index[id(p)]}", d)
                                             for p, d in zip(owned, deltas, strict=True))
            future.add_done_callback(
                lambda _: setattr(pending, "finished", time.perf_counter()))
            self.engine.flush()  # the chunks leave now; the step ends when it lands
        self._pending = pending
        if self.fragment_sync_delay == 0:
            self._apply(pending)

    def _land(self, pending: _Pending) -> None:
        """Wait for the fragment's average (a ``SyncError`` if a replica is gone)."""
        if not pending.landed:
            if pending.deltas:
                begin = time.perf_counter()
                self.engine.synchronize()
                end = time.perf_counter()
                self.waited_seconds += end - begin
                self.outer_seconds += (pending.finished or end) - pending.began
            pending.landed = True

    def _apply(self, pending: _Pending) -> None:
        """The outer step on the landed fragment, the merge, and the new global values."""
        self._land(pending)
        self._pending = None
        fragment = self.fragments[pending.fragment]
        owned = self._owned(pending.fragment)
        alpha = self.fragment_update_alpha
        params = self._params
        with torch.no_grad():
            grads = [p.grad for p in params]
            local = {id(p): _shard(p).detach().clone() for p in fragment} if alpha else {}
            for p in params:
                p.grad = None
            for p, d in zip(owned, pending.deltas, strict=True):
                g = self.globals[self._index[id(p)]]
                _shard(p).copy_(g)
                p.grad = _like(p, d.view_as(g).to(g.dtype))
            if owned:
                self.outer_optimizer.step()  # only the fragment's have gradients
            for p in owned:
                self.globals[self._index[id(p)]].copy_(_shard(p))
            if self.replica_group is not None:  # the owners hand the new values over
                for p in fragment:
                    i = self._index[id(p)]
                    _broadcast([self.globals[i]], self.replica_group, self._owners[i])
            for p in fragment:
                g = self.globals[self._index[id(p)]]
                if alpha:
                    _shard(p).copy_(local[id(p)].mul_(alpha).add_(g, alpha=1.0 - alpha))
                else:
                    _shard(p).copy_(g)
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad
        self.syncs += 1

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """The model holds the global weights (each fragment's last synchronized values,
        the same on every replica) inside the block, its own after: evaluate the global
        model as DiLoCo does.

        Example:
            >>> with diloco.global_weights():
            ...     held_out = evaluate(model)
        """
        with torch.no_grad():
            local = [_shard(p).detach().clone() for p in self._params]
            for p, g in zip(self._params, self.globals, strict=True):
                _shard(p).copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, saved in zip(self._params, local, strict=True):
                    _shard(p).copy_(saved)

    @property
    def hidden(self) -> float:
        """The share of the outer averaging's time that inner steps hid (1: none was
        waited for)."""
        if self.outer_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - self.waited_seconds / self.outer_seconds)

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The saved global values, the outer optimizer, the engine's residuals and the
        step counters, and a fragment in flight (waited for: its average is kept): each
        rank saves its own. Call it between steps.

        Example:
            >>> torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
            ...             "diloco": diloco.state_dict()}, f"ckpt/rank{rank}.pt")
        """
        pending = self._pending
        if pending is not None:
            self._land(pending)
        return {"format": FORMAT, "step": self.step, "syncs": self.syncs,
                "globals": [g.clone() for g in self.globals],
                "outer": self.outer_optimizer.state_dict(),
                "engine": plain(self.engine.state_dict()),
                "pending": None if pending is None else {
                    "fragment": pending.fragment, "sent": pending.sent, "due": pending.due,
                    "deltas": [d.clone() for d in pending.deltas]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()`` of the same rank, after the model's and the inner
        optimizer's own states are loaded: the run goes on bit for bit."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ConfigError(f"not a DiLoCo state of format {FORMAT}; save one with "
                              "DiLoCo.state_dict()")
        if len(state["globals"]) != len(self.globals):
            raise ConfigError(f"the state holds {len(state['globals'])} parameters, this "
                              f"model {len(self.globals)} (field 'globals')")
        with torch.no_grad():
            for g, saved in zip(self.globals, state["globals"], strict=True):
                g.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer"])
        self.engine.load_state_dict(state["engine"])
        self.step, self.syncs = int(state["step"]), int(state["syncs"])
        saved = state["pending"]
        self._pending = None if saved is None else _Pending(
            int(saved["fragment"]), int(saved["sent"]), int(saved["due"]),
            [d.clone() for d in saved["deltas"]], landed=True)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent for the outer synchronization so far."""
        return int(self.engine.bytes_sent)


def _shard(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``p``: its local shard under FSDP2 (a DTensor; in-place
    writes to it are writes to the parameter), else ``p``."""
    return p.to_local() if isinstance(p, DTensor) else p


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient of ``p``: a DTensor of ``p``'s layout under FSDP2."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return local


def _owners(params: list[nn.Parameter], replica_group: Any) -> list[int]:
    """Which rank of the replica synchronizes each parameter: the least loaded so far, by
    elements (every rank when the replica is one rank)."""
    if replica_group is None:
        return [0] * len(params)
    load = [0] * dist.get_world_size(replica_group)
    owners = []
    for p in params:
        rank = min(range(len(load)), key=lambda r: load[r])
        owners.append(rank)
        load[rank] += p.numel()
    return owners


def _broadcast(tensors: Iterable[torch.Tensor], group: Any, root: int = 0) -> None:
    """Overwrite ``tensors`` with the values of ``group``'s rank ``root``, in order
    (through host memory: the group is Gloo)."""
    src = dist.get_global_rank(group, root) if group is not None else root
    for t in tensors:
        if t.numel() == 0:
            continue
        host = t.detach() if t.device.type == "cpu" and t.is_contiguous() else \
            t.detach().to("cpu").contiguous()
        dist.broadcast(host, src, group=group)
        if host.data_ptr() != t.data_ptr():
            t.copy_(host)
