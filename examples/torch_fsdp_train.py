"""Sharded training with FSDP2: the GPT-style language model (examples/_lm.py, 76
tensors) under ``fully_shard`` per transformer block, its gradient reduce-scatter
compressed by HiPress.

    hipress run -np 2 examples/torch_fsdp_train.py                        # cgx, 4 bits
    hipress run -np 2 examples/torch_fsdp_train.py --all-gather int8     # weights too
    hipress run -np 2 examples/torch_fsdp_train.py --sync fsdp           # FSDP2's own
    hipress run -np 2 examples/torch_fsdp_train.py --checkpoint ckpt     # save, resume
    hipress run -np 4 examples/torch_fsdp_train.py --hsdp 2              # 2 replicas of 2

--sync: ``hipress`` (``hp.compress_fsdp``), ``fsdp`` (FSDP2's own collectives, float32)
or ``fsdp-bf16`` (FSDP2 reducing gradients in bfloat16: ``MixedPrecisionPolicy(
reduce_dtype=torch.bfloat16)``). Every rank saves its own checkpoint (its shards, its
optimizer state, HiPress's residuals) and a restarted job resumes from the newest step
every rank saved. ``--hsdp R``: HSDP, R replicas each sharded over world / R ranks (a
node); FSDP2's own all-reduces across replicas with ``--sync fsdp``, HiPress's compressed
one with ``--sync hipress``. Prints samples/s after the warm-up steps and the loss;
``--metrics`` writes them as JSON (``hipress bench fsdp`` reads it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _checkpoints as checkpoints  # noqa: E402
from _lm import GPT, MarkovTokens  # noqa: E402

import hipress.torch as hp  # noqa: E402
from hipress.distributed import allgather_object  # noqa: E402


def shard(model: GPT, args: argparse.Namespace) -> Any:
    """``fully_shard`` each block, then the root (embeddings, final norm); with
    ``--sync hipress``, the compressed collectives; returns HiPress's state or None."""
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if args.sync == "fsdp-bf16" \
        else MixedPrecisionPolicy()
    mesh = where = None
    if args.hsdp:
        world = hp.size()
        if world % args.hsdp:
            raise SystemExit(f"--hsdp {args.hsdp} does not divide {world} ranks")
        mesh = init_device_mesh("cpu", (args.hsdp, world // args.hsdp),
                                mesh_dim_names=("replicate", "shard"))
        # FSDP2's own HSDP takes the 2-D mesh; HiPress's shards over a node and all-reduces
        where = mesh["shard"] if args.sync == "hipress" else mesh
    for block in model.blocks:
        fully_shard(block, mesh=where, mp_policy=policy)
    fully_shard(model, mesh=where, mp_policy=policy)
    if args.sync != "hipress":
        return None
    params = {"bits": args.bits} if args.algorithm in ("cgx", "zeropp", "qsgd") else {}
    return hp.compress_fsdp(model, args.algorithm, all_gather=args.all_gather, mesh=mesh,
                            min_compress=args.min_compress, **params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync", default="hipress", choices=["hipress", "fsdp", "fsdp-bf16"])
    parser.add_argument("--algorithm", default="cgx")
    parser.add_argument("--bits", type=int, default=4, help="cgx, zeropp, qsgd")
    parser.add_argument("--all-gather", default=None,
                        help="compress the parameter all-gather: int8, int4 or a codec")
    parser.add_argument("--min-compress", type=int, default=65536)
    parser.add_argument("--hsdp", type=int, default=0, metavar="R",
                        help="HSDP with R replicas (0: plain FSDP over every rank)")
    parser.add_argument("--dim", type=int, default=384, help="width (a multiple of 6)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of samples/s")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--checkpoint", type=Path, help="save here; resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--metrics", type=Path, help="write the run's figures as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for this rank (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    hp.init()
    rank, world = hp.rank(), hp.size()
    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(dim=args.dim, layers=args.layers)
    state = shard(model, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = MarkovTokens()
    start = checkpoints.resume(args.checkpoint, rank, model, opt, state) if args.checkpoint else 0
    losses, times = [], []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        seq = torch.from_numpy(data.batch(rank, step, args.batch))
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           seq[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if args.checkpoint and (step + 1) % args.checkpoint_every == 0:
            checkpoints.save_training(args.checkpoint, rank, step + 1, model, opt, state)
    timed = times[args.warmup:] or times
    rate = world * args.batch / float(np.mean(timed)) if timed else 0.0
    # every rank's full model must be the same: compare digests
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    digests = allgather_object(float(full.double().sum()))
    if rank == 0:
        print(f"{args.sync}{' ' + args.algorithm if state else ''}: {rate:.1f} samples/s, "
              f"loss {losses[0] if losses else float('nan'):.3f} -> "
              f"{losses[-1] if losses else float('nan'):.3f}, "
              f"replicas {'identical' if len(set(digests)) == 1 else 'DIFFER'}")
        if args.metrics:
            args.metrics.write_text(json.dumps({
                "samples_per_s": rate, "losses": losses, "step_s": times,
                "identical": len(set(digests)) == 1, "world": world,
                "sent_per_step": (state.bytes_sent + state.gathered_bytes) / max(len(times), 1)
                if state is not None else None}))
    dist.barrier()
    hp.shutdown()


if __name__ == "__main__":
    main()
