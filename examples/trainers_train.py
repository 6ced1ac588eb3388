"""Train the byte-level GPT inside a trainer, with HiPress added by its one line.

    torchrun --nproc-per-node 2 examples/trainers_train.py --framework lightning --hipress
    torchrun --nproc-per-node 2 examples/trainers_train.py --framework trainer   # plain DDP

--framework picks who runs the loop: ``loop`` (a plain DDP loop), ``lightning``
(``L.Trainer(strategy="ddp")``; HiPress: ``callbacks=[HiPress()]``), ``accelerate``
(``Accelerator``; HiPress: ``hipress.torch.accelerate.compress(accelerator, model)``) or
``trainer`` (``transformers.Trainer``; HiPress: ``hipress.torch.transformers.compress``).
The model and data are the same in each (examples/_lm.py's GPT on the standard library's
source, AdamW); every rank reads its batch of each step from the step's number, so each
framework sees the same tokens. The script calls ``torch.set_num_threads(--threads)`` as
a user sharing cores does, after the framework's own set-up (Lightning and Accelerate
give each process all of its host's cores unless ``OMP_NUM_THREADS`` is set, which is
right on hosts of its own and oversubscribes ranks that share a machine), and times the
steps after --warmup (the one-time set-up: DDP's buckets, HiPress's engine and kernels)
into --metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lm import GPT  # noqa: E402
from _text import VOCAB, ByteText  # noqa: E402

FRAMEWORKS = ("loop", "lightning", "accelerate", "trainer")


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


class Clock:
    """Wall time at the end of every step."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.perf_counter())


def run_loop(model: torch.nn.Module, text: ByteText, args: argparse.Namespace,
             clock: Clock) -> Any:
    import torch.distributed as dist

    import hipress.torch as hp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    if args.hipress:
        state = hp.HookState()
        net.register_comm_hook(state, hp.comm_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        seq = torch.from_numpy(text.batch(rank, step, args.batch))
        _loss(net(seq[:, :-1]), seq[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        clock.tick()
    return state


def run_accelerate(model: torch.nn.Module, text: ByteText, args: argparse.Namespace,
                   clock: Clock) -> Any:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(args.threads)  # after Accelerate's own choice (see main)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    net, opt = accelerator.prepare(model, opt)
    state = None
    if args.hipress:
        import hipress.torch.accelerate

        state = hipress.torch.accelerate.compress(accelerator, net)
    rank = accelerator.process_index
    for step in range(args.steps):
        seq = torch.from_numpy(text.batch(rank, step, args.batch))
        accelerator.backward(_loss(net(seq[:, :-1]), seq[:, 1:]))
        opt.step()
        opt.zero_grad()
        clock.tick()
    return state


def run_lightning(model: torch.nn.Module, text: ByteText, args: argparse.Namespace,
                  clock: Clock) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            seq = torch.from_numpy(text.batch(self.global_rank, self.global_step, args.batch))
            return _loss(self.model(seq[:, :-1]), seq[:, 1:])

        def on_fit_start(self) -> None:
            torch.set_num_threads(args.threads)  # after Lightning's own choice (see main)

        def on_train_batch_end(self, *_: Any) -> None:
            clock.tick()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:  # the batches come from the step's number
            return torch.utils.data.DataLoader(range(1 << 20), batch_size=1)

    callbacks = []
    hook = None
    if args.hipress:
        from hipress.torch.lightning import HiPress

        hook = HiPress()
        callbacks.append(hook)
    # the launcher's layout: ranks per node, and nodes (one rank per host: as many nodes)
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=world // per_node,
                         strategy="ddp", max_steps=args.steps, callbacks=callbacks,
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module())
    return hook.state if hook is not None else None


def run_trainer(model: torch.nn.Module, text: ByteText, args: argparse.Namespace,
                clock: Clock) -> Any:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, seq: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": _loss(self.model(seq[:, :-1]), seq[:, 1:])}

    class Text(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1 << 20

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"seq": torch.from_numpy(text.batch(0, i, 1)[0])}

    class Tick(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            torch.set_num_threads(args.threads)  # after Accelerate's own choice (see main)

        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.tick()

    out = Path(args.metrics).parent / "trainer" if args.metrics else Path("trainer-out")
    training = TrainingArguments(
        output_dir=str(out), use_cpu=True, ddp_backend="gloo",
        per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=1e-3,
        lr_scheduler_type="constant", save_strategy="no", report_to="none",
        logging_steps=1 << 20, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=LM(), args=training, train_dataset=Text(), callbacks=[Tick()])
    callback = None
    if args.hipress:
        import hipress.torch.transformers

        callback = hipress.torch.transformers.compress(trainer)
    trainer.train()
    return callback.state if callback is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=FRAMEWORKS, default="loop")
    parser.add_argument("--hipress", action="store_true", help="add HiPress's one line")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the rate")
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--metrics", type=Path)
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, dim=args.width, layers=args.layers)
    # read before training: Lightning's teardown removes WORLD_SIZE from the environment
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    clock = Clock()
    run = {"loop": run_loop, "accelerate": run_accelerate, "lightning": run_lightning,
           "trainer": run_trainer}[args.framework]
    state = run(model, ByteText(), args, clock)
    timed = clock.ends[args.warmup - 1:]
    rate = (len(timed) - 1) * args.batch * world / (timed[-1] - timed[0])
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.framework}{' + HiPress' if args.hipress else ''}: {rate:.1f} samples/s "
              f"after {args.warmup} steps, {len(clock.ends)} steps", flush=True)
        if args.metrics:
            args.metrics.write_text(json.dumps({
                "framework": args.framework, "hipress": args.hipress, "params": params,
                "steps": len(clock.ends), "samples_per_s": rate,
                "bytes_sent": state.bytes_sent if state is not None else 0}))


if __name__ == "__main__":
    main()
