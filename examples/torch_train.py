"""Train a model on scikit-learn's digits with data parallelism and HiPress.

    hipress run -np 4 examples/torch_train.py --algorithm onebit --epochs 3
    hipress run -np 4 examples/torch_train.py --sync ddp            # plain DDP
    hipress run -np 4 examples/torch_train.py --model resnet        # 107 gradient tensors

--model picks the network: ``mlp`` (a wide MLP, six gradient tensors), ``resnet`` (a
small residual CNN, 17 blocks of two convolutions with batch norm: 107 gradient tensors,
what a real model hands the engine), both on scikit-learn's digits, or ``transformer`` (a
GPT-style byte-level language model, 76 tensors, 10.7M parameters, trained with AdamW on
the Python standard library's own source: examples/_lm.py, examples/_text.py). Every task
holds out data it never trains on; --eval-every N scores the model there every N steps
(the clock stops meanwhile), and --target-loss stops training once that held-out loss is
reached.

--sync picks how gradients are averaged:
  hook       DDP with hipress.torch's comm hook (CaSync, --algorithm)     [default]
  optimizer  hipress.torch.DistributedOptimizer, no DDP (--algorithm)
  ddp        plain DDP allreduce
  powersgd   DDP with torch's PowerSGD hook (--powersgd-rank, 4)
  fp16       DDP with torch's fp16 compression hook
  local      no averaging: every rank trains alone (the compute a step costs, for
             --breakdown's reference)
  diloco     hipress.torch.DiLoCo: every rank a replica that trains alone and averages
             pseudo-gradients every --sync-every steps (--algorithm none: float32;
             --fragments and --delay: Streaming DiLoCo); held-out scores are the global
             model's
--breakdown records where each step's time goes (forward, backward, optimizer; with the
hook also its calls, the wait at backward's end, codec and wire time, the overlap with
backward: hipress.breakdown) and, after training, the engine's own sync time for the same
gradients; the metrics then hold every rank's medians.
--bandwidth 1gbit paces this rank's uplink in software (emulation); plain DDP then runs
its allreduce through the same paced transport so the comparison is fair. torch's own
hooks cannot be paced: use real shaped links for them (hipress bench train --network shaped).

--checkpoint DIR saves every rank's model, optimizer and HiPress state (error-feedback
residuals, step, plan) every --checkpoint-every steps, and a job that starts with
checkpoints in DIR resumes from the newest step every rank has: with torchrun's elastic
agent, a job whose rank died restarts and continues where it left off.

    hipress run -np 2 --max-restarts 1 examples/torch_train.py --checkpoint ckpt \
        --fail-at 30        # rank 1 dies at step 30 once; the job resumes and finishes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import _checkpoints as checkpoints
import numpy as np
import torch
import torch.distributed as dist
from _digits import load_digits_split
from _lm import GPT
from _text import VOCAB, ByteText
from torch import nn

import hipress
import hipress.torch as hp
from hipress.breakdown import COLUMNS, summarize
from hipress.distributed import allgather_object


class _Block(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input: six gradient tensors."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        nn.init.zeros_(self.bn2.weight)  # each block starts as the identity: deep nets train

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    """A residual CNN for 8x8 digits: a stride-4 stem to 2x2 maps, ``blocks`` residual
    blocks of ``channels`` (9 * channels^2 weights per convolution), pooling, a classifier.
    Few FLOPs per parameter, so on slow links its step is bound by synchronization."""

    def __init__(self, channels: int = 128, blocks: int = 17) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, channels, 4, stride=4, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(*(_Block(channels) for _ in range(blocks)))
        self.fc = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x.view(-1, 1, 8, 8))))
        return self.fc(self.blocks(x).mean((2, 3)))


def make_model(width: int, kind: str = "mlp", layers: int = 6) -> nn.Module:
    """``mlp``: 64 -> width -> width -> 10; ``resnet``: ``ResNet(channels=width)``;
    ``transformer``: ``GPT(dim=width, layers=layers)``."""
    torch.manual_seed(0)
    if kind == "resnet":
        return ResNet(width)
    if kind == "transformer":
        return GPT(vocab=VOCAB, dim=width, layers=layers)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


class Task:
    """A model's data: ``batch(step, rank)`` gives that rank's inputs and targets;
    ``loss`` scores a model's output, ``evaluate`` a model on the held-out data."""

    def __init__(self, kind: str, batch: int, world: int) -> None:
        self.kind, self.size, self.world = kind, batch, world
        if kind == "transformer":
            self.tokens = ByteText()
            self.steps_per_epoch = 4096 // (batch * world)
            test = torch.from_numpy(self.tokens.held_out(64))
            self.test = (test[:, :-1], test[:, 1:])
        else:
            xtr, ytr, xte, yte = load_digits_split()
            self.train = (xtr, ytr)
            self.steps_per_epoch = len(xtr) // (batch * world)
            self.test = (torch.from_numpy(xte), torch.from_numpy(yte))

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "transformer":
            seq = torch.from_numpy(self.tokens.batch(rank, step, self.size))
            return seq[:, :-1], seq[:, 1:]
        xtr, ytr = self.train
        epoch, i = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng(1000 + epoch).permutation(len(xtr))[rank::self.world]
        idx = order[i * self.size:(i + 1) * self.size]
        return torch.from_numpy(xtr[idx]), torch.from_numpy(ytr[idx])

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def evaluate(self, model: nn.Module, device: torch.device) -> tuple[float, float]:
        """The loss and accuracy on the held-out data (batch norm's running statistics)."""
        x, y = self.test
        net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) \
            else model
        was = net.training
        net.eval()
        with torch.no_grad():
            out = net(x.to(device)).float().cpu()
        net.train(was)
        accuracy = float((out.argmax(-1) == y).float().mean())
        return float(self.loss(out, y)), accuracy


def _chosen(args: argparse.Namespace) -> dict[str, object]:
    """What the command line chose of HiPress's codec: nothing (HiPress's default), or an
    algorithm and its parameters."""
    if not args.algorithm:
        return {}
    params = {}
    for item in args.param:
        name, _, value = item.partition("=")
        params[name] = float(value) if "." in value or "e" in value else int(value)
    return {"algorithm": args.algorithm, **params}


def wrap(model: nn.Module, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer,
                                                             object]:
    """The model and optimizer for --sync, plus whatever reports bytes sent."""
    # fused: one pass over each parameter (torch's single-tensor SGD makes three), the
    # same optimizer for every --sync
    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True) \
        if args.optimizer == "adamw" else \
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, fused=True)
    if args.sync == "local":
        return model, opt, None
    if args.sync == "diloco":
        outer = None  # hp.DiLoCo's default unless the command line names one
        if args.outer_lr is not None or args.outer_momentum is not None:
            momentum = hp.diloco.OUTER_MOMENTUM if args.outer_momentum is None \
                else args.outer_momentum
            outer = torch.optim.SGD(model.parameters(), momentum=momentum,
                                    lr=hp.diloco.OUTER_LR if args.outer_lr is None
                                    else args.outer_lr, nesterov=momentum > 0)
        return model, opt, hp.DiLoCo(model, opt, args.sync_every, outer_optimizer=outer,
                                     fragments=args.fragments,
                                     fragment_sync_delay=args.delay, **_chosen(args))
    if args.sync == "optimizer":
        chosen = _chosen(args)
        opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      **chosen, plan=args.plan, topology=args.topology,
                                      guard=args.guard)
        return model, opt, opt._sync  # type: ignore[attr-defined]
    # PowerSGD's hook chains collectives inside Gloo's two worker threads; with several
    # buckets they can all block each other (a hang), so it gets one bucket.
    cap = 4096 if args.sync == "powersgd" else 25
    # gradients as views of DDP's buckets: no copy of every gradient out of its bucket
    # after the hook (12 ms a step of the 12M-parameter CNN on one core), for every --sync
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap,
                                              gradient_as_bucket_view=True)
    if args.sync == "hook" or (args.sync == "ddp" and args.bandwidth):
        chosen = _chosen(args) if args.sync == "hook" else {"algorithm": "none"}
        state = hp.HookState(**chosen, plan=args.plan, topology=args.topology,
                             trace=args.breakdown, guard=args.guard)
        ddp.register_comm_hook(state, hp.comm_hook)
        return ddp, opt, state
    if args.sync == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        ddp.register_comm_hook(ps.PowerSGDState(process_group=None,
                                                matrix_approximation_rank=args.powersgd_rank,
                                                start_powerSGD_iter=2), ps.powerSGD_hook)
    elif args.sync == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp, opt, None


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each field's median over the steps."""
    return {key: float(np.median([r[key] for r in rows if key in r]))
            for key in COLUMNS if any(key in r for r in rows)}


def _engine_alone(model: nn.Module, args: argparse.Namespace, steps: int = 12) -> float:
    """Median ms of the engine alone synchronizing gradients of the model's shapes in one
    batch (``submit_many`` + ``synchronize``) with this run's settings: the time no
    integration adds to."""
    from hipress.distributed import EngineOptions

    chosen = _chosen(args)
    sync = EngineOptions(**chosen, plan=args.plan, topology=args.topology,
                         guard=args.guard).engine()
    grads = [(name, torch.randn(p.shape)) for name, p in model.named_parameters()]
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        sync.submit_many(grads)
        sync.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    sync.close()
    return float(np.median(times[2:]))


def bytes_sent(reporter: object) -> int:
    """What ``reporter`` (a ``HookState``, an optimizer wrapper's or DiLoCo's engine)
    has sent."""
    return 0 if reporter is None else int(reporter.bytes_sent)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync", default="hook",
                        choices=["hook", "optimizer", "ddp", "powersgd", "fp16", "local",
                                 "diloco"])
    parser.add_argument("--sync-every", type=int, default=20,
                        help="--sync diloco: H, inner steps between outer synchronizations")
    parser.add_argument("--fragments", type=int, default=1,
                        help="--sync diloco: Streaming DiLoCo's fragments")
    parser.add_argument("--delay", type=int, default=0,
                        help="--sync diloco: inner steps a fragment's averaging overlaps")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="--sync diloco: the outer SGD's learning rate (default: "
                             "hp.DiLoCo's)")
    parser.add_argument("--outer-momentum", type=float, default=None,
                        help="--sync diloco: its Nesterov momentum (0: plain SGD)")
    parser.add_argument("--powersgd-rank", type=int, default=4,
                        help="--sync powersgd: the rank of its approximation")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"],
                        help="default: adamw for the transformer, sgd (momentum) otherwise")
    parser.add_argument("--breakdown", action="store_true",
                        help="record where each step's time goes (see above)")
    parser.add_argument("--algorithm", default=os.environ.get("HIPRESS_ALGORITHM"),
                        help="default: HiPress's own (hipress.torch.HookState())")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a parameter of --algorithm, e.g. --param bits=2 (repeatable)")
    parser.add_argument("--plan", default="static", choices=["static", "auto"],
                        help="HiPress's per-tensor plan: a size threshold, or the cost model")
    parser.add_argument("--no-guard", dest="guard", action="store_false",
                        help="compress what the plan says from the first step (no warm-up, "
                             "embeddings compressed too: casync.guard)")
    parser.add_argument("--topology", default="ps", choices=["ps", "ring", "allgather"],
                        help="CaSync strategy for compressed tensors")
    parser.add_argument("--model", default="mlp", choices=["mlp", "resnet", "transformer"])
    parser.add_argument("--width", type=int, default=None,
                        help="hidden width (params ~ w^2); resnet: channels; transformer: "
                             "model dimension (default 2048 for the mlp, 128 for the resnet, "
                             "384 for the transformer)")
    parser.add_argument("--layers", type=int, default=6, help="the transformer's blocks")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps left out of the steady samples/s (one-time set-up)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="score the model on held-out data every this many steps "
                             "(and at the end); the clock stops meanwhile")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="stop once the held-out loss (the mean of the last --smooth "
                             "scores) is at most this, but not before --min-steps")
    parser.add_argument("--smooth", type=int, default=1,
                        help="held-out scores averaged for --target-loss")
    parser.add_argument("--min-steps", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for this rank (default: OMP_NUM_THREADS, "
                             "else this node's cores / its ranks)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=None,
                        help="default: 0.05 for sgd, 0.001 for adamw")
    parser.add_argument("--bandwidth", default=os.environ.get("HIPRESS_BANDWIDTH"),
                        help="emulate this uplink rate per rank, e.g. 1gbit")
    parser.add_argument("--metrics", type=Path,
                        help="rank 0 writes its measurements here (JSON)")
    parser.add_argument("--checkpoint", type=Path,
                        help="save to and resume from this folder (one file per rank)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between saves")
    parser.add_argument("--fail-at", type=int, default=0,
                        help="the last rank dies after this step, on the first attempt only "
                             "(to try --max-restarts)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda (cuda: the rank's local GPU, modulo the GPUs there)")
    args = parser.parse_args()
    if args.bandwidth:
        os.environ["HIPRESS_BANDWIDTH"] = args.bandwidth
        if args.sync in ("powersgd", "fp16"):
            parser.error(f"--sync {args.sync} talks to torch.distributed directly and cannot be "
                         "paced; use real shaped links instead of --bandwidth")
    threads = args.threads or os.environ.get("OMP_NUM_THREADS") or (os.cpu_count() or 1) // int(
        os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, int(threads)))

    if args.width is None:
        args.width = {"resnet": 128, "transformer": 384}.get(args.model, 2048)
    if args.model == "transformer" and args.width % 6:
        parser.error(f"--width {args.width}: the transformer's 6 heads need a multiple of 6")
    if args.optimizer is None:
        args.optimizer = "adamw" if args.model == "transformer" else "sgd"
    if args.lr is None:
        args.lr = 1e-3 if args.optimizer == "adamw" else 0.05

    # NCCL refuses two ranks on one GPU: ranks that share one talk Gloo, and CaSync
    # stages their compressed messages through host memory (cuda_transport "auto").
    shared = args.device.startswith("cuda") and torch.cuda.is_available() and int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
    hp.init(backend="gloo" if shared else None)
    rank, world = hp.rank(), hp.size()
    data = Task(args.model, args.batch, world)
    device = torch.device(args.device)
    if device.type == "cuda":  # several ranks may share one GPU (the staged transport)
        local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    model, opt, reporter = wrap(make_model(args.width, args.model, args.layers).to(device),
                                args)
    hp.broadcast_parameters(model.state_dict(), root_rank=0)
    hook = reporter if isinstance(reporter, hp.HookState) else None
    diloco = reporter if isinstance(reporter, hp.DiLoCo) else None
    # the global model: each replica's own drifts between synchronizations
    weights = diloco.global_weights if diloco is not None else contextlib.nullcontext
    if hook is not None:  # the engine, and the kernels it compiles on a first run, now:
        hook.synchronizer()  # not inside the first timed step
    first = checkpoints.resume(args.checkpoint, rank, model, opt, hook) if args.checkpoint else 0
    if first and rank == 0:
        print(f"resumed from step {first} ({args.checkpoint})", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    params = sum(p.numel() for p in model.parameters())
    total = args.steps if args.steps else data.steps_per_epoch * args.epochs
    losses: list[tuple[float, float]] = []
    steps_ms: list[dict[str, float]] = []

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    label = f"{args.sync} {args.algorithm or 'default'}" \
        if args.sync in ("hook", "optimizer", "diloco") else args.sync
    progress = Progress(TextColumn(f"[bold]{label}"),
                        BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
                        disable=rank != 0 or args.quiet)
    evals: list[tuple[float, int, float, float]] = []  # (seconds, step, loss, accuracy)
    paused = 0.0  # seconds spent scoring on held-out data, left out of the clock

    def clock() -> float:
        return time.perf_counter() - start - paused

    def evaluate() -> bool:
        """Score on held-out data; whether the target loss is reached. Rank 0's score
        counts on every rank (batch norm's running statistics are each rank's own until
        DDP's next forward broadcasts rank 0's), so every rank stops at the same step.
        The clock stops meanwhile."""
        nonlocal paused
        begin = time.perf_counter()
        seconds = clock()
        with weights():
            score = torch.tensor(data.evaluate(model, device), dtype=torch.float64)
        dist.broadcast(score, 0)  # every rank resumes together, with rank 0's score
        loss, accuracy = (float(v) for v in score)
        evals.append((seconds, step, loss, accuracy))
        paused += time.perf_counter() - begin
        recent = [e[2] for e in evals[-args.smooth:]]
        return args.target_loss is not None and step >= args.min_steps \
            and sum(recent) / len(recent) <= args.target_loss

    dist.barrier()
    start = time.perf_counter()
    sent0 = bytes_sent(reporter)
    step = first
    with progress, diloco if diloco is not None else contextlib.nullcontext():
        task = progress.add_task("train", total=total, completed=step, loss=float("nan"))
        while step < total:
            xb, yb = (t.to(device) for t in data.batch(step, rank))
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = data.loss(model(xb), yb)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            if args.breakdown:
                steps_ms.append(summarize(t0, t1, t2, time.perf_counter(),
                                          hook.take_trace() if hook is not None else None))
            step += 1
            losses.append((clock(), loss.item()))
            progress.update(task, advance=1, loss=losses[-1][1])
            if args.eval_every and step % args.eval_every == 0 and step < total \
                    and evaluate():
                break
            if args.checkpoint and step % args.checkpoint_every == 0:
                # a DistributedOptimizer's state_dict() holds HiPress's state; a hook's is apart
                checkpoints.save_training(args.checkpoint, rank, step, model, opt, hook)
            if step == args.fail_at and rank == world - 1 and attempt == 0:
                print(f"rank {rank} fails after step {step} (--fail-at)", flush=True)
                sys.stdout.flush()
                os._exit(1)
    if not evals or evals[-1][1] != step:
        evaluate()
    dist.barrier()
    elapsed = clock()
    run = step - first  # steps this attempt ran
    # Steady throughput leaves out the first steps, which pay one-time costs (DDP's bucket
    # rebuild, kernel loads, CaSync's plans), as Horovod's benchmarks do.
    warm = min(args.warmup, run - 1) if run > 1 else 0
    steady_s = elapsed - (losses[warm - 1][0] if warm > 0 else 0.0)
    accuracy = evals[-1][3]
    # Replicas must agree: compare a checksum of the parameters across ranks.
    with weights():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    sums = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, torch.tensor([float(flat.double().sum()),
                                        float(flat.double().abs().sum())], dtype=torch.float64))
    identical = all(torch.equal(s, sums[0]) for s in sums)
    result = {"sync": args.sync, "algorithm": args.algorithm, "world": world,
              "model": args.model, "tensors": len(list(model.parameters())),
              "params": int(params), "steps": step, "resumed_from": first,
              "seconds": elapsed, "samples_per_s": run * args.batch * world / elapsed,
              "warmup_steps": warm,
              "steady_samples_per_s": (run - warm) * args.batch * world / steady_s,
              "bytes_per_step": (bytes_sent(reporter) - sent0) / max(run, 1),
              "accuracy": accuracy, "final_loss": losses[-1][1] if losses else None,
              "heldout_loss": evals[-1][2], "evals": evals,
              "threads": {"torch": torch.get_num_threads(), "kernels": str(hipress.threads())},
              "replicas_identical": identical, "bandwidth": args.bandwidth, "losses": losses,
              "device": str(device)}
    if diloco is not None:
        result["diloco"] = {"syncs": diloco.syncs, "outer_s": diloco.outer_seconds,
                            "waited_s": diloco.waited_seconds, "hidden": diloco.hidden,
                            "sync_every": args.sync_every, "fragments": args.fragments,
                            "delay": args.delay}
    if args.breakdown:
        result["breakdown"] = allgather_object(_medians(steps_ms[warm:]))
        if reporter is not None and args.sync in ("hook", "optimizer"):
            result["engine_alone_ms"] = allgather_object(_engine_alone(model, args))
    if rank == 0:
        print(f"{label}: {run} steps in {elapsed:.1f} s, "
              f"{result['samples_per_s']:.0f} samples/s ({result['steady_samples_per_s']:.0f} "
              f"after {warm} warm-up steps), held-out loss {evals[-1][2]:.3f}, "
              f"accuracy {accuracy:.3f}, "
              f"replicas identical: {identical}")
        if args.metrics:
            args.metrics.parent.mkdir(parents=True, exist_ok=True)
            args.metrics.write_text(json.dumps(result))
    hp.shutdown()


if __name__ == "__main__":
    main()
