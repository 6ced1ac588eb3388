"""Train an MLP on scikit-learn's digits with MXNet Gluon and HiPress.

    hipress run -np 2 examples/mxnet_train.py --algorithm onebit     # hp.KVStore
    hipress run -np 2 examples/mxnet_train.py --mode trainer         # hp.DistributedTrainer

Runs in the MXNet environment (make venv-mx; .venv-mx/bin/hipress run ...).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mxnet as mx
from _digits import batches, digest, load_digits_split
from mxnet import autograd, gluon

import hipress.mxnet as hp
from hipress.distributed import allgather_object


def make_model(width: int) -> gluon.nn.HybridSequential:
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(width, activation="relu", in_units=64),
            gluon.nn.Dense(width, activation="relu", in_units=width),
            gluon.nn.Dense(10, in_units=width))
    net.initialize(mx.init.Xavier())
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="kvstore", choices=["kvstore", "trainer"])
    parser.add_argument("--algorithm", default=os.environ.get("HIPRESS_ALGORITHM", "onebit"))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--metrics", type=Path, help="rank 0 writes its results here (JSON)")
    args = parser.parse_args()

    hp.init()
    rank, world = hp.rank(), hp.size()
    xtr, ytr, xte, yte = load_digits_split()
    net = make_model(args.width)
    params = net.collect_params()
    hp.broadcast_parameters(params, root_rank=0)
    opt_params = {"learning_rate": args.lr, "momentum": 0.9}
    if args.mode == "kvstore":
        trainer = gluon.Trainer(params, "sgd", opt_params,
                                kvstore=hp.KVStore(algorithm=args.algorithm))
        scale = args.batch * world  # a KVStore sums over ranks
    else:
        trainer = hp.DistributedTrainer(params, "sgd", opt_params, algorithm=args.algorithm)
        scale = args.batch
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses: list[float] = []
    start = time.perf_counter()
    step = 0
    for epoch in range(args.epochs):
        for idx in batches(len(xtr), args.batch, rank, world, epoch):
            x, y = mx.nd.array(xtr[idx]), mx.nd.array(ytr[idx])
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(scale)
            losses.append(float(loss.mean().asscalar()))
            step += 1
            if args.steps and step >= args.steps:
                break
        if args.steps and step >= args.steps:
            break
    elapsed = time.perf_counter() - start
    accuracy = float((net(mx.nd.array(xte)).argmax(axis=1).asnumpy() == yte).mean())
    digests = allgather_object(digest([p.data().asnumpy() for p in params.values()]))
    result = {"mode": args.mode, "algorithm": args.algorithm, "world": world,
              "seconds": elapsed, "losses": losses, "accuracy": accuracy,
              "replicas_identical": len(set(digests)) == 1}
    if rank == 0:
        print(f"mxnet {args.mode} {args.algorithm}: {step} steps in {elapsed:.1f} s, "
              f"accuracy {accuracy:.3f}, replicas identical: {result['replicas_identical']}")
        if args.metrics:
            args.metrics.write_text(json.dumps(result))
    hp.shutdown()


if __name__ == "__main__":
    main()
