"""Rank scenarios inside the trainers people use (Accelerate, Lightning, Trainer), launched
as torchrun does (``ranks.launch``), or, for ``lightning_fsdp``, as one ``python`` process
that Lightning's own launcher turns into the ranks: each trains a small MLP on random
digits-like data for ``steps`` steps from ``start`` with HiPress's one-line integration,
saves the framework's own checkpoint after step ``save_at``, or loads one first;
``die_at`` kills rank 1 after that step. Arrays: the final parameters; JSON: bytes sent
and any error."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

FEATURES, CLASSES, WIDTH = 64, 10, 512


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                         nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def _batch(rank: int, step: int) -> tuple[Any, Any]:
    """This rank's batch of ``step``: the same whatever was resumed."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, FEATURES, generator=g)
    return x, (x[:, :CLASSES].argmax(1) + step) % CLASSES


def _report(model: Any, out: Path, rank: int, **fields: Any) -> dict[str, Any]:
    import torch

    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                      .reshape(-1) for p in model.parameters()])
    np.savez(out / f"rank{rank}.npz", params=flat.numpy())
    return {"params": int(flat.numel()), **fields}


def accelerate(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    import torch
    from accelerate import Accelerator

    import hipress
    import hipress.torch.accelerate

    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    net, opt = accelerator.prepare(model, opt)
    state = hipress.torch.accelerate.compress(accelerator, net, **args.get("options", {}))
    if args.get("load"):
        accelerator.load_state(args["load"])
    error = None
    try:
        for step in range(args["start"], args["start"] + args["steps"]):
            x, y = _batch(rank, step)
            accelerator.backward(torch.nn.functional.cross_entropy(net(x), y))
            opt.step()
            opt.zero_grad()
            if rank == 1 and step + 1 == args.get("die_at"):
                os._exit(3)
            if args.get("save") and step + 1 == args["save_at"]:
                accelerator.save_state(args["save"])
    except hipress.SyncError as exc:
        error = type(exc).__name__
    return _report(model, out, rank, sent=state.bytes_sent, error=error)


def _fit(module: Any, callback: Any, args: dict[str, Any], strategy: Any) -> Any:
    """Lightning's ``fit`` on 2 CPU ranks with ``callback``, saving a checkpoint after
    step ``save_at`` or resuming from the one saved at step ``start``; the trainer."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks: list[Any] = [callback]
    if args.get("save"):
        callbacks.append(ModelCheckpoint(dirpath=args["save"], every_n_train_steps=
                                         args["save_at"], save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                         max_steps=args["start"] + args["steps"], callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(args.get("save")))
    ckpt = None
    if args.get("load"):
        ckpt = str(next(Path(args["load"]).glob(f"*step={args['start']}.ckpt")))
    trainer.fit(module, ckpt_path=ckpt)
    return trainer


def lightning(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch

    import hipress
    from hipress.torch.lightning import HiPress

    die_at = args.get("die_at")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch: Any, index: int) -> Any:
            if rank == 1 and self.global_step == die_at:
                os._exit(3)
            x, y = _batch(rank, self.global_step)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> Any:  # the batches come from _batch
            return torch.utils.data.DataLoader(range(10_000), batch_size=1)

    module = Module()
    callback = HiPress(**args.get("options", {}))
    error = None
    try:
        _fit(module, callback, args, "ddp")
    except hipress.SyncError as exc:
        error = type(exc).__name__
    state = callback.state
    return _report(module.net, out, rank, sent=state.bytes_sent if state else 0, error=error)


def lightning_fsdp(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """FSDP2 through ``ModelParallelStrategy`` (``configure_model`` shards each layer),
    started as a user starts it: this one process, Lightning spawning the other rank."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from hipress.torch.lightning import HiPress

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, index: int) -> Any:
            x, y = _batch(self.global_rank, self.global_step)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(range(10_000), batch_size=1)

    module = Module()
    callback = HiPress(**args.get("options", {}))
    trainer = _fit(module, callback, args, ModelParallelStrategy(data_parallel_size=2,
                                                                 tensor_parallel_size=1))
    state = callback.state
    return _report(module.net, out, trainer.global_rank, global_rank=trainer.global_rank,
                   sent=state.bytes_sent if state else 0, error=None,
                   kind=type(state).__name__)


def trainer(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hipress
    import hipress.torch.transformers

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x: Any, labels: Any) -> dict[str, Any]:
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4096

        def __getitem__(self, i: int) -> dict[str, Any]:
            x, y = _batch(i, 0)
            return {"x": x[0], "labels": y[0]}

    class Die(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if rank == 1 and state.global_step == die_at:
                os._exit(3)

    die_at = args.get("die_at")
    model = Model()
    training = TrainingArguments(
        output_dir=args.get("save") or args.get("load") or str(out / "trainer"),
        use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=32,
        max_steps=args["start"] + args["steps"], save_strategy="steps",
        save_steps=args.get("save_at") or 10_000, learning_rate=1e-3, seed=0,
        report_to="none", logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=Data(), callbacks=[Die()])
    callback = hipress.torch.transformers.compress(trainer, **args.get("options", {}))
    error = None
    try:
        resume = str(Path(args["load"]) / f"checkpoint-{args['start']}") \
            if args.get("load") else None
        trainer.train(resume_from_checkpoint=resume)
    except hipress.SyncError as exc:
        error = type(exc).__name__
    state = callback.state
    return _report(model.net, out, rank, sent=state.bytes_sent if state else 0, error=error)


SCENARIOS = {f.__name__: f for f in (accelerate, lightning, lightning_fsdp, trainer)}

if __name__ == "__main__":
    scenario, raw, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    rank = int(os.environ.get("RANK", 0))  # Lightning's launcher: the scenario says
    result = SCENARIOS[scenario](json.loads(raw), rank, folder)
    rank = result.pop("global_rank", rank)
    (folder / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: a dead peer must not turn into a hang
