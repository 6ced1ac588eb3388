"""Rank scenarios for sharded training (FSDP2 with ``hp.compress_fsdp``) and CaSync's
reduce-scatter; ``tests/test_fsdp.py`` launches them through ``ranks.launch``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ranks  # noqa: E402

#: the reduce-scatter test's flat buffer: 3 x 8 shards of an odd length, across chunks
SCATTER_N = 3 * 8 * 5003


def _model(width: int) -> Any:
    """A small residual network with LayerNorms: 4 FSDP modules (three blocks and the root
    with the embedding and head), 24 parameter tensors."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), \
                nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.embed = nn.Linear(16, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(3))
            self.head = nn.Linear(d, 1)

        def forward(self, x: Any) -> Any:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    torch.manual_seed(0)
    return Net(width)


def _batch(rank: int, step: int) -> tuple[Any, Any]:
    """Rank ``rank``'s batch of step ``step`` (the same in a resumed run): a linear task."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=gen)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(7))
    return x, x @ w


def _sharded(args: dict[str, Any]) -> tuple[Any, Any]:
    """The model under ``fully_shard`` and, unless ``algorithm`` is ``plain``, HiPress's
    compressed reduce-scatter."""
    from torch.distributed.fsdp import fully_shard

    import hipress.torch as hp

    model = _model(args.get("width", 130))
    mesh = where = None
    if args.get("hsdp"):  # 2 ranks a node: FSDP's own HSDP, or HiPress's replica all-reduce
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2),
                                mesh_dim_names=("replicate", "shard"))
        where = mesh if args["algorithm"] == "plain" else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=where)
    fully_shard(model, mesh=where)
    state = None
    if args["algorithm"] != "plain":
        state = hp.compress_fsdp(model, args["algorithm"], mesh=mesh,
                                 all_gather=args.get("all_gather"),
                                 min_compress=args.get("min_compress", 1000),
                                 timeout=args.get("timeout", 60), **args.get("params", {}))
    return model, state


def train(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``steps`` SGD steps from step ``start``; saves a checkpoint after step ``save_at``
    (``save``) or starts from one (``load``). Arrays: the local shards (``params``) and
    the full parameters (``full``)."""
    import torch

    model, state = _sharded(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.get("lr", 0.002))
    start = args.get("start", 0)
    if "load" in args:
        saved = torch.load(Path(args["load"]) / f"rank{rank}.pt", weights_only=True)
        with torch.no_grad():
            for p, local in zip(model.parameters(), saved["params"], strict=True):
                p.to_local().copy_(local)
        if state is not None:
            state.load_state_dict(saved["hipress"])
    losses = []
    for step in range(start, start + args["steps"]):
        x, y = _batch(rank, step)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if "save" in args and step + 1 == args.get("save_at"):
            folder = Path(args["save"])
            folder.mkdir(parents=True, exist_ok=True)
            torch.save({"params": [p.to_local().clone() for p in model.parameters()],
                        "hipress": state.state_dict() if state is not None else {}},
                       folder / f"rank{rank}.pt")
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    np.savez(out / f"rank{rank}.npz", params=local.numpy(), full=full.numpy())
    return {"losses": losses, "modules": state.modules if state is not None else [],
            "sent": state.bytes_sent if state is not None else 0,
            "gathered": state.gathered_bytes if state is not None else 0,
            "steps": state.steps if state is not None else 0}


def nonfinite(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Rank 1's loss is NaN at step 1: after that backward, whether each rank's gradient
    shards hold a non-finite value; then whether the next step's are finite again."""
    import torch

    model, _ = _sharded(args)
    found = []
    for step in range(3):
        x, y = _batch(rank, step)
        loss = ((model(x) - y) ** 2).mean()
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        loss.backward()
        found.append(not all(bool(torch.isfinite(p.grad.to_local()).all())
                             for p in model.parameters()))
        model.zero_grad()
    return {"nonfinite": found}


def fault(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Rank 1 dies at step 2; the survivors report the error their backward raised and
    how long it took."""
    import torch

    model, _ = _sharded(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.002)
    for step in range(4):
        if step == 2 and rank == 1:
            os._exit(3)
        x, y = _batch(rank, step)
        start = time.monotonic()
        try:
            ((model(x) - y) ** 2).mean().backward()
        except Exception as exc:  # noqa: BLE001 - the test reads its type and message
            import traceback
            return {"error": type(exc).__name__, "module": type(exc).__module__,
                    "message": str(exc)[:500], "seconds": time.monotonic() - start,
                    "where": traceback.format_exc()[-3000:]}
        opt.step()
        opt.zero_grad()
    return {"error": None}


def mismatch(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Ranks pass different settings (``changed`` on rank 1): the error of the first
    backward."""
    if rank == 1:
        args = {**args, **args["changed"]}
    model, _ = _sharded(args)
    x, y = _batch(rank, 0)
    try:
        ((model(x) - y) ** 2).mean().backward()
    except Exception as exc:  # noqa: BLE001
        return {"error": type(exc).__name__, "message": str(exc)[:500]}
    return {"error": None}


def scatter(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """CaSync's ``scatter`` topology on its own: ``steps`` reduce-scatters of a flat
    buffer of ``SCATTER_N`` elements (``device``, ``target``: as ``ranks.strategies``).
    Arrays: every step's result (``out{step}``)."""
    import torch

    from casync import StaticPlanner, engine
    from casync.plan import SCATTER

    ranks._stand_in(args)  # with ``device``: the CUDA path, on CPU tensors
    algo = args["algorithm"]
    sync = engine(algo, planner=StaticPlanner(algo, SCATTER, min_compress=0),
                        chunk_elems=args.get("chunk_elems", 16384), timeout=60,
                        error_feedback=args.get("error_feedback"),
                        target=args.get("target", "auto"))
    arrays = {}
    for step in range(args.get("steps", 2)):
        x = torch.from_numpy(ranks.data(rank, 0, SCATTER_N, step))
        sync.submit("flat", x)
        sync.synchronize()
        arrays[f"out{step}"] = x.numpy().copy()
    np.savez(out / f"rank{rank}.npz", **arrays)
    sent = sync.transport.messages_sent
    sync.close()
    return {"messages": sent}


SCENARIOS = {f.__name__: f for f in (train, nonfinite, fault, mismatch, scatter)}

if __name__ == "__main__":
    ranks.main(SCENARIOS)
