"""Rank scenarios for low-communication training (``hp.DiLoCo``);
``tests/test_diloco.py`` launches them through ``ranks.launch``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ranks  # noqa: E402


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)  # the replicas start apart: DiLoCo makes them equal
    torch.manual_seed(int(os.environ["RANK"]) + 1)
    return nn.Sequential(nn.Linear(64, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(),
                         nn.Linear(384, 10))


def _batch(rank: int, step: int, x: Any, y: Any) -> tuple[Any, Any]:
    import torch

    idx = torch.from_numpy(np.random.default_rng([rank, step]).integers(0, len(x), 32))
    return x[idx], y[idx]


def _flat(model: Any) -> np.ndarray:
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def train(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``steps`` inner steps from ``start`` under ``hp.DiLoCo(**args["diloco"])`` (or plain
    DDP with ``ddp``); a checkpoint after step ``save_at`` (``save``) or resumed from
    ``load``. Arrays: the parameters at the end (``params``) and after every step
    (``step{n}``); with ``record``, each sync's true mean pseudo-gradient inputs
    (``true{k}``, this rank's) and the averages it applied (``avg{k}``)."""
    import torch
    from torch import nn

    import hipress.torch as hp

    hp.init()
    x, y = ranks._digits()
    model = _model()
    if args.get("ddp"):
        hp.broadcast_parameters(model.state_dict(), root_rank=0)
        net: Any = nn.parallel.DistributedDataParallel(model)
    else:
        net = model
    make = torch.optim.AdamW if args.get("inner") == "adamw" else torch.optim.SGD
    inner = make(model.parameters(), lr=args.get("lr", 0.05))
    options = dict(args.get("diloco", {}))
    if options.pop("outer_sgd", False):  # plain SGD, lr 1: DiLoCo's reduction to DDP
        options["outer_optimizer"] = torch.optim.SGD(model.parameters(), lr=1.0)
    diloco = None if args.get("ddp") else hp.DiLoCo(model, inner, timeout=args.get(
        "timeout", 60), **options)
    arrays: dict[str, np.ndarray] = {}
    if diloco is not None and args.get("record"):
        _record(diloco, arrays)
    start = args.get("start", 0)
    if "load" in args:
        saved = torch.load(Path(args["load"]) / f"rank{rank}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        if diloco is not None:
            diloco.load_state_dict(saved["diloco"])
    error = None
    losses = []
    with diloco if diloco is not None else _nothing():
        for step in range(start, start + args["steps"]):
            if step == args.get("die_at") and rank == 1:
                os._exit(3)  # this replica is gone mid-run
            xb, yb = _batch(rank, step, x, y)
            inner.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            losses.append(float(loss))
            begin = time.monotonic()
            try:
                inner.step()
            except Exception as exc:  # noqa: BLE001 - reported, with its type
                error = {"type": type(exc).__name__, "message": str(exc),
                         "after": time.monotonic() - begin}
                break
            arrays[f"step{step + 1}"] = _flat(model)
            if diloco is not None:  # each fragment's parameters, apart
                for f, part in enumerate(diloco.fragments):
                    arrays[f"frag{f}_step{step + 1}"] = torch.cat(
                        [p.detach().reshape(-1) for p in part]).numpy().copy()
            if "save" in args and step + 1 == args["save_at"]:
                folder = Path(args["save"])
                folder.mkdir(parents=True, exist_ok=True)
                torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
                            "diloco": diloco.state_dict() if diloco is not None else None},
                           folder / f"rank{rank}.pt")
    arrays["params"] = _flat(model)
    np.savez(out / f"rank{rank}.npz", **arrays)
    return {"error": error, "syncs": diloco.syncs if diloco is not None else 0,
            "sent": diloco.bytes_sent if diloco is not None else 0, "losses": losses}


def _record(diloco: Any, arrays: dict[str, np.ndarray]) -> None:
    """Keep each sync's pseudo-gradients as this rank computed them, and the averages
    the outer step applied."""
    import torch

    send, apply = diloco._send, diloco._apply
    count = {"sent": 0, "applied": 0}

    def recording_send(fragment: int) -> None:
        with torch.no_grad():
            true = [(diloco.globals[diloco._index[id(p)]] - p.detach()).float().reshape(-1)
                    for p in diloco._owned(fragment)]
        arrays[f"true{count['sent']}"] = torch.cat(true).numpy().copy()
        count["sent"] += 1
        send(fragment)

    def recording_apply(pending: Any) -> None:
        diloco._land(pending)
        arrays[f"avg{count['applied']}"] = torch.cat(pending.deltas).numpy().copy()
        count["applied"] += 1
        apply(pending)

    diloco._send, diloco._apply = recording_send, recording_apply


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def mismatch(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Rank 1 constructs DiLoCo with ``args["theirs"]`` instead of ``args["ours"]``."""
    import torch

    import hipress.torch as hp
    from hipress.errors import HiPressError

    hp.init()
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    options = args["theirs"] if rank == 1 else args["ours"]
    try:
        hp.DiLoCo(model, inner, timeout=20, **options)
    except HiPressError as exc:
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None}


def replicas(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """4 ranks, 2 replicas of 2 on a ("replicate", "shard") mesh: each replica DDP or FSDP2
    over its own 2 ranks (the fast link), DiLoCo across the replicas. Arrays: every rank's
    full parameters after each step."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hipress.torch as hp

    hp.init()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x, y = ranks._digits()
    model = _model()
    replica_group = None
    if args["kind"] == "ddp":
        replica_group = mesh.get_group("shard")
        net: Any = nn.parallel.DistributedDataParallel(model, process_group=replica_group)
    else:
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh["shard"])
        net = fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco = hp.DiLoCo(model, inner, sync_every=args["sync_every"],
                       group=mesh.get_group("replicate"), replica_group=replica_group,
                       timeout=60)
    arrays = {}
    with diloco:
        for step in range(args["steps"]):
            xb, yb = _batch(rank, step, x, y)
            inner.zero_grad()
            nn.functional.cross_entropy(net(xb), yb).backward()
            inner.step()
            full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in
                    model.parameters()]
            arrays[f"step{step + 1}"] = torch.cat(
                [p.detach().reshape(-1) for p in full]).numpy().copy()
    np.savez(out / f"rank{rank}.npz", **arrays)
    return {"syncs": diloco.syncs, "sent": diloco.bytes_sent}


SCENARIOS = {f.__name__: f for f in (train, mismatch, replicas)}

if __name__ == "__main__":
    ranks.main(SCENARIOS)
