"""Compressed gradient reduce-scatter for FSDP2: ``hp.compress_fsdp(model, ...)``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters each FSDP module's
gradients as one flat, padded buffer: rank j keeps the mean of every rank's shard j.
``compress_fsdp`` installs a ``ReduceScatter`` on every FSDP module that owns parameters
(``FSDPModule.set_custom_reduce_scatter``) which runs that collective through CaSync's
``scatter`` topology (``casync.graphs.build_scatter``): shard j of the buffer is encoded
and sent to rank j, which adds the N - 1 payloads it receives to its own shard, exact,
and scales the sum to the mean. Buffers below ``min_compress`` elements, and every
buffer with ``algorithm="none"``, take FSDP's own reduce-scatter.

With ``all_gather="int8"`` (or ``"int4"``, or a fixed-size codec's name) the parameter
all-gather is compressed too, as ZeRO++'s qwZ: each rank quantizes its own shard
blockwise, the payloads are all-gathered, and every rank decodes every payload, its own
included, so all ranks compute with the same quantized weights while the optimizer
updates the exact float32 shards.

HSDP (``mesh=``, a 2-D ``(replicate, shard)`` DeviceMesh; the modules sharded over
``mesh["shard"]``, one node): after FSDP's reduce-scatter inside the node, each reduced
shard is all-reduced across the replicas through CaSync, compressed (``ps``, ``ring`` or
``allgather``), from FSDP's all-reduce hook; the reduce-scatter inside the node stays
FSDP's own unless ``reduce_scatter=True``.
"""

# No "from __future__ import annotations": FSDP's comm interface is checked at run time.

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from casync import Engine
from casync.guard import WARMUP_STEPS
from casync.plan import COMPRESSED, MIN_COMPRESS, SCATTER, StaticPlanner
from compll.codec import Codec, codec
from compll.ir import LengthKind
from hipress import distributed as core
from hipress.errors import ConfigError, SyncError

from .internals import AllGather, ReduceScatter, at_backward_end
from .state import plain

#: ``all_gather=`` shorthands: ZeRO++'s symmetric blockwise quantization (qwZ: int8)
GATHER_CODECS: dict[str, tuple[str, dict[str, Any]]] = {
    "int8": ("zeropp", {"bits": 8}), "int4": ("zeropp", {"bits": 4})}

__all__ = ["FSDPState", "compress_fsdp"]


class _ScatterOptions(core.EngineOptions):
    """The wrapper's options; its engine, on ``group`` (the job's, or an HSDP node's),
    plans every buffer it is given as a compressed reduce-scatter (smaller ones never
    reach it, see ``_Comm``)."""

    def engine(self, planner: Any = None) -> Engine:
        if planner is None:
            planner = StaticPlanner(None if self.algorithm == "none" else self.algorithm,
                                    SCATTER, min_compress=self.min_compress, **self.params)
        return super().engine(planner)


class FSDPState:
    """What ``compress_fsdp`` installed: the settings, the engine, and its state.

    Args:
        algorithm: a CompLL algorithm (``hipress.algorithms()``; blockwise ones such as
            ``cgx``, ``zeropp`` and ``qsgd`` keep a scale per block of the flat buffer)
            or ``"none"`` (FSDP's own reduce-scatter, bit for bit); default
            ``HIPRESS_ALGORITHM``, else ``casync.plan.DEFAULT_ALGORITHM`` (cgx).
        error_feedback: ``None`` = on for biased algorithms. Each rank keeps a residual
            of the part of each FSDP module's unsharded gradient that it sends, (N - 1) / N
            of its elements in float32; ``False`` saves that memory.
        min_compress: flat buffers below this many elements take FSDP's own reduce-scatter
            (and all-gather).
        all_gather: ``None`` (FSDP's own, exact), ``"int8"``, ``"int4"`` or the name of a
            codec whose payload size depends only on the element count (``cgx``): the
            compressed parameter all-gather described in the module docstring.
        timeout: seconds before a silent peer raises ``SyncError``.
        trace: the engine records its tasks (``take_trace``).
        reduce_scatter: whether the reduce-scatter is compressed (default: yes, but not
            inside an HSDP node, whose links are fast).
        topology: HSDP's replica all-reduce: ``ps``, ``ring`` or ``allgather``.
        guard: the engine's rules (``casync.guard``): the first ``WARMUP_STEPS`` steps
            take FSDP's own reduce-scatter; HSDP's replica all-reduce keeps row-sparse
            shards uncompressed too.
        mesh: HSDP's 2-D ``(replicate, shard)`` DeviceMesh (``compress_fsdp``'s).
        **codec_params: the algorithm's parameters (``bits=4`` for cgx).
    """

    def __init__(self, algorithm: str | None = None, error_feedback: bool | None = None,
                 min_compress: int = MIN_COMPRESS, timeout: float | None = None,
                 trace: bool = False, all_gather: str | None = None,
                 reduce_scatter: bool | None = None, topology: str = "ps",
                 guard: bool = True, mesh: Any = None, **codec_params: Any) -> None:
        # user knobs, validated here (a ConfigError says why)
        if topology not in COMPRESSED:  # HSDP's mesh is already the two levels
            raise ConfigError(f"compress_fsdp's topology (HSDP's replica all-reduce) must be "
                              f"one of {', '.join(COMPRESSED)}, not {topology!r}")
        shard, replicas = _hsdp_groups(mesh) if mesh is not None else (None, None)
        self.replicate_group: Any = replicas  # HSDP: this rank's replicas
        self.options = _ScatterOptions(algorithm, "static", "ps", min_compress, error_feedback,
                                       timeout, trace=trace, guard=guard, group=shard,
                                       **codec_params)
        # HSDP's: an allreduce engine (static plan over ``topology``) on the replicas' group
        self.replica_options = core.EngineOptions(algorithm, "static", topology, min_compress,
                                                  error_feedback, timeout, trace=trace,
                                                  guard=guard, group=replicas, **codec_params)
        self.warmup = WARMUP_STEPS if guard else 0
        self.algorithm = self.options.algorithm
        self.min_compress = min_compress
        self.all_gather = all_gather
        self.gather_codec = _gather_codec(all_gather)
        self.reduce_scatter = reduce_scatter
        # internal state: the engines, created at the first collective
        self._engine = core.LazyEngine(self.options)
        self._replica_engine = core.LazyEngine(self.replica_options)
        self.sync: Engine | None = None
        self.replica_sync: Engine | None = None
        self._in_backward = False
        #: FSDP modules given a compressed reduce-scatter, in the order of ``modules()``
        self.modules: list[str] = []
        # statistics
        self.steps = 0
        self.gathered_bytes = 0  # what this rank contributed to compressed all-gathers

    @property
    def scatters(self) -> bool:
        """Whether the reduce-scatter is compressed."""
        wanted = self.replicate_group is None if self.reduce_scatter is None \
            else self.reduce_scatter
        return wanted and self.algorithm != "none"

    def synchronizer(self) -> Engine:
        """The engine, created (and the settings agreed by every rank) on first use;
        with HSDP, the replicas' engine too."""
        if self.sync is None or not core.is_live(self.sync):
            self.sync = self._engine.get()
            # the engines check the rest of the settings (each over its group)
            seen = core.allgather_object((self.all_gather, self.reduce_scatter,
                                          self.replicate_group is not None))
            if len(set(seen)) > 1:
                raise ConfigError("ranks disagree on all_gather, reduce_scatter or mesh: "
                                  f"{seen} (by rank)")
            if self.replicate_group is not None:
                self.replica_sync = self._replica_engine.get()
        return self.sync

    def state_dict(self) -> dict[str, Any]:
        """HiPress's state for a checkpoint: the residuals, the engine's step and this
        state's statistics. Each rank saves its own (its residuals are its own).

        Example:
            >>> torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
            ...             "hipress": state.state_dict()}, f"ckpt-rank{rank}.pt")
        """
        return {"steps": self.steps, "engine": plain(self._engine.state_dict()),
                "replicas": plain(self._replica_engine.state_dict())}

    def load_state_dict(self, state: dict[str, Any], reset_residuals: bool = False) -> None:
        """Continue from ``state_dict()`` of the same rank and world size, now or at the
        first reduce-scatter."""
        self.steps = int(state.get("steps", 0))
        self._engine.load_state_dict(state.get("engine", {}), reset_residuals)
        self._replica_engine.load_state_dict(state.get("replicas", {}), reset_residuals)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent through the engines so far."""
        return sum(int(e.bytes_sent) for e in (self.sync, self.replica_sync)
                   if e is not None)

    @staticmethod
    def _lost(what: str, exc: BaseException) -> SyncError:
        """A failure of one of FSDP's own collectives as a ``SyncError``: on CPU (Gloo) it
        comes from a peer that died or left (a stalled one: after the process group's
        timeout)."""
        return SyncError(f"FSDP's {what} failed, a peer is gone: {exc}")

    def _begin(self) -> None:
        """At a backward's first use of an engine: end the engines' step when backward
        ends (after FSDP's own final callback, which reduces the last modules)."""
        if self._in_backward:
            return
        self._in_backward = True
        engines = [e for e in (self.sync, self.replica_sync) if e is not None]

        def end() -> None:
            self._in_backward = False
            for engine in engines:
                engine.end_step()
            self.steps += 1

        at_backward_end(end)

    def _reduce(self, sync: Engine, name: str, tensor: torch.Tensor) -> None:
        """Average ``tensor`` through ``sync`` in place, waiting for it (a ``SyncError``
        as itself)."""
        self._begin()
        future = sync.submit(name, tensor)
        sync.flush()
        try:
            future.wait()
        except Exception:
            error = sync.error
            if error is not None:
                raise error from None
            raise


def _allocate(size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A collective's buffer, from the caching allocator (what FSDP2's own default does)."""
    return torch.empty(*size, dtype=dtype, device=device)


class _Comm(ReduceScatter):
    """One FSDP module's reduce-scatter through the engine (``FSDPState``)."""

    def __init__(self, state: FSDPState, name: str) -> None:
        self.state = state
        self.name = name

    allocate = staticmethod(_allocate)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        state = self.state
        # The engine first, on every rank: its settings check runs before any collective,
        # so ranks that disagree (on min_compress too) fail with the field named.
        sync = state.synchronizer()
        warming = state.steps < state.warmup
        if warming:
            state._begin()  # the step still ends, and counts
        if not state.scatters or input_tensor.numel() < state.min_compress or warming:
            try:
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op,
                                                  group=group, async_op=async_op)
            except RuntimeError as exc:
                raise state._lost(f"reduce-scatter of {self.name}", exc) from exc
        world, rank = group.size(), group.rank()
        ours = dist.get_world_size(sync.group), dist.get_rank(sync.group)
        if (world, rank) != ours:
            raise ConfigError(f"FSDP reduce-scatters over {world} ranks (this one {rank}) "
                              f"but HiPress's group has {ours[0]} (this one {ours[1]}); "
                              "pass HSDP's mesh to compress_fsdp (mesh=...)")
        scale = _scale(op, world)
        state._reduce(sync, self.name, input_tensor)
        shard = input_tensor.numel() // world
        mine = input_tensor[rank * shard:(rank + 1) * shard]
        if scale != 1.0:
            mine.mul_(scale)
        output_tensor.copy_(mine.view_as(output_tensor))
        return None


class _Gather(AllGather):
    """One FSDP module's parameter all-gather: FSDP's own, or compressed
    (``FSDPState.all_gather``); either way a dead peer is a ``SyncError``."""

    def __init__(self, state: FSDPState, name: str) -> None:
        self.state = state
        self.name = name

    allocate = staticmethod(_allocate)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> Any:
        state = self.state
        state.synchronizer()  # the settings are agreed before the first collective
        try:
            if state.gather_codec is None or input_tensor.numel() < state.min_compress \
                    or not input_tensor.is_floating_point():
                return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                                   async_op=async_op)
            self._compressed(state.gather_codec, output_tensor, input_tensor, group)
            return None
        except RuntimeError as exc:
            raise state._lost(f"all-gather of {self.name}", exc) from exc

    def _compressed(self, c: Codec, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                    group: dist.ProcessGroup) -> None:
        """Encode this rank's shard, all-gather the payloads (each the same size: the
        codec's layout depends on the count only), decode every one into its place."""
        n, world = input_tensor.numel(), group.size()
        flat = input_tensor.detach().reshape(-1).float()
        size = c.max_payload_bytes(n)
        cuda = flat.is_cuda
        payload = c.encode(flat if cuda else flat.numpy())
        mine = payload if cuda else torch.from_numpy(payload)
        if mine.numel() != size:
            raise ConfigError(f"the all_gather codec {c.name!r} wrote {mine.numel()} bytes "
                              f"for {n} elements, not its fixed {size}")
        gathered = torch.empty(world * size, dtype=torch.uint8, device=flat.device)
        dist.all_gather_single(gathered, mine, group=group)
        self.state.gathered_bytes += size
        out = output_tensor.view(-1)
        into = out if out.dtype == torch.float32 else torch.empty(out.numel(), device=out.device)
        views = list(into.view(world, n))
        c.decode_batch(gathered if cuda else gathered.numpy(), [n] * world,
                       views if cuda else [v.numpy() for v in views])
        if into is not out:
            out.copy_(into)


def _gather_codec(all_gather: str | None) -> Codec | None:
    """The codec of ``all_gather=`` (checked: its payload size must follow from the
    element count alone, so that every rank's payload has the same size)."""
    if all_gather is None:
        return None
    if not isinstance(all_gather, str):
        raise ConfigError(f"all_gather must be None, 'int8', 'int4' or a codec's name, "
                          f"not {all_gather!r}")
    name, params = GATHER_CODECS.get(all_gather, (all_gather, {}))
    c = codec(name, **params)
    if any(section.ty.length is not None and section.ty.length.kind is LengthKind.SYM
           for section in c.program.layout):
        raise ConfigError(f"all_gather={all_gather!r}: {name}'s payload size depends on the "
                          "values; use 'int8', 'int4' or a fixed-size codec such as cgx")
    return c


def _replica_hook(state: FSDPState, name: str) -> Any:
    """HSDP: FSDP's all-reduce hook, which averages a node's reduced shard across the
    replicas (FSDP's own all-reduce is off: its modules are sharded over one node)."""

    def hook(reduce_output: torch.Tensor) -> None:
        state.synchronizer()
        sync = state.replica_sync
        assert sync is not None  # made with the engine when there are replicas
        if state.algorithm == "none" or reduce_output.numel() < state.min_compress:
            try:
                dist.all_reduce(reduce_output, op=dist.ReduceOp.AVG,
                                group=state.replicate_group)
            except RuntimeError as exc:
                raise state._lost(f"replica all-reduce of {name}", exc) from exc
            return
        state._reduce(sync, name, reduce_output)

    return hook


def _hsdp_groups(mesh: Any) -> tuple[Any, Any]:
    """This rank's shard group (its node) and replicate group from HSDP's 2-D mesh, as
    Gloo groups (made anew, by every rank in the same order, where the mesh's are not)."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != ["replicate", "shard"]:
        raise ConfigError("mesh= takes HSDP's 2-D DeviceMesh with dimensions named "
                          f"'replicate' and 'shard', not one of shape {tuple(mesh.shape)} "
                          f"named {names}")
    shard, replicate = mesh["shard"].get_group(), mesh["replicate"].get_group()
    if dist.get_backend(shard) == "gloo" and dist.get_backend(replicate) == "gloo":
        return shard, replicate
    grid = mesh.mesh if names[0] == "replicate" else mesh.mesh.t()
    me = dist.get_rank()
    mine = [None, None]
    for k, lines in enumerate(([row.tolist() for row in grid],
                               [col.tolist() for col in grid.t()])):
        for ranks in lines:
            group = dist.new_group(ranks, backend="gloo")
            if me in ranks:
                mine[k] = group
    return mine[0], mine[1]


def _own_parameters(module: Any) -> list[torch.nn.Parameter]:
    """The parameters ``module``'s own FSDP group shards: its parameters less those of the
    FSDP modules inside it (each of which reduces its own)."""
    inner = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    nested = {id(p) for m in inner for p in m.parameters()}  # type: ignore[attr-defined]
    return [p for p in module.parameters() if id(p) not in nested]


def _scale(op: Any, world: int) -> float:
    """What the engine's mean is multiplied by for FSDP's reduce op."""
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        return float(world)
    raise ConfigError(f"compress_fsdp reduces with AVG or SUM, not {op}; leave FSDP's "
                      "gradient divide factor at its default")


def compress_fsdp(model: torch.nn.Module, algorithm: str | None = None, *,
                  all_gather: str | None = None, mesh: Any = None,
                  reduce_scatter: bool | None = None, topology: str = "ps",
                  error_feedback: bool | None = None, min_compress: int = MIN_COMPRESS,
                  timeout: float | None = None, trace: bool = False, guard: bool = True,
                  **codec_params: Any) -> FSDPState:
    """Compress FSDP2's gradient reduce-scatter with a CompLL algorithm.

    Call it after ``fully_shard`` has wrapped the model (every FSDP module that owns
    parameters gets the compressed reduce-scatter; a root without parameters of its own
    has none). Every rank must call it with the same settings.

    Args:
        model: the model, wrapped by ``fully_shard``: over the whole job (1-D), or for
            HSDP over ``mesh["shard"]`` (one node).
        mesh: HSDP's 2-D ``(replicate, shard)`` DeviceMesh: each reduced shard is then
            all-reduced across ``mesh["replicate"]`` through HiPress, compressed.
        algorithm, all_gather, reduce_scatter, topology, error_feedback, min_compress,
            timeout, trace, guard, **codec_params: see ``FSDPState``.

    Returns:
        The ``FSDPState``: save ``state_dict()`` with each rank's checkpoint.

    Raises:
        ConfigError: no FSDP module owns parameters, a module is sharded over a 2-D
            mesh (FSDP's own HSDP: shard over ``mesh["shard"]`` and pass ``mesh``), or
            a bad setting.

    Example:
        >>> for block in model.blocks:
        ...     fully_shard(block)
        >>> fully_shard(model)
        >>> state = hp.compress_fsdp(model, algorithm="cgx", bits=4)
        >>> state = hp.compress_fsdp(model, algorithm="cgx", all_gather="int8")  # weights too
        >>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        >>> fully_shard(model, mesh=mesh["shard"])              # HSDP, HiPress's all-reduce
        >>> state = hp.compress_fsdp(model, algorithm="cgx", mesh=mesh)
    """
    state = FSDPState(algorithm, error_feedback, min_compress, timeout, trace, all_gather,
                      reduce_scatter, topology, guard, mesh, **codec_params)
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        owned = _own_parameters(module)
        if not owned:
            continue  # owns no parameters: nothing of its own to reduce
        if any(isinstance(p, DTensor) and p.device_mesh.ndim > 1 for p in owned):
            raise ConfigError(f"{name or 'the model'} is sharded over a 2-D mesh (FSDP's own "
                              "HSDP, whose replica all-reduce HiPress cannot reach): shard "
                              "over mesh['shard'] and pass compress_fsdp(..., mesh=mesh)")
        key = f"fsdp{len(state.modules)}"
        module.set_custom_reduce_scatter(_Comm(state, key))
        module.set_custom_all_gather(_Gather(state, key))
        if mesh is not None:
            module.set_all_reduce_hook(_replica_hook(state, key))
        state.modules.append(name)
    if not state.modules:
        raise ConfigError("compress_fsdp found no FSDP module that owns parameters; call "
                          "fully_shard on the model (and its blocks) first")
    return state
