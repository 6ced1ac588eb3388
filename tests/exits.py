"""A rank of a short training script that ends as a user's script may end, and exits as a
Python program does (no ``os._exit``): the tests check its exit code.

    python tests/exits.py '{"framework": "torch", "mode": "hook", "ending": "destroy"}' OUT

Endings: ``destroy`` (``dist.destroy_process_group()`` only, as PyTorch's DDP tutorial
ends), ``shutdown`` (``hp.shutdown()``), ``both`` (shutdown, then destroy), ``reversed``
(destroy, then shutdown) and ``neither``. Launched by ``ranks.launch(script=...)``, which
passes a scenario name first: it is the framework here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "examples")]

STEPS = 5


def _batches(rank: int, n: int = 32) -> list[tuple[np.ndarray, np.ndarray]]:
    r = np.random.default_rng(rank)
    return [(r.standard_normal((n, 64)).astype(np.float32), r.integers(0, 10, n))
            for _ in range(STEPS)]


def _torch(args: dict[str, Any], rank: int) -> Any:
    import torch
    import torch.distributed as dist
    from torch import nn

    import hipress.torch as hp

    if args.get("init") == "hp":
        hp.init()
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    net: Any = model
    if args["mode"] == "hook":
        net = nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(hp.HookState(algorithm="onebit", min_compress=1024),
                               hp.comm_hook)
    else:
        opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      algorithm="onebit", min_compress=1024)
    for _ in range(STEPS):
        opt.zero_grad()
        net(torch.randn(32, 64)).sum().backward()
        opt.step()
    return hp


def _tensorflow(args: dict[str, Any], rank: int) -> Any:
    import tensorflow as tf

    import hipress.tensorflow as hp

    hp.init()
    tf.random.set_seed(0)
    w = tf.Variable(tf.random.normal((64, 512)))
    v = tf.Variable(tf.random.normal((512, 10)))
    opt = tf.keras.optimizers.SGD(0.1)
    for x, y in _batches(rank):
        with tf.GradientTape() as tape:
            logits = tf.matmul(tf.nn.relu(tf.matmul(x, w)), v)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        tape = hp.DistributedGradientTape(tape, algorithm="onebit", min_compress=1024)
        opt.apply_gradients(zip(tape.gradient(loss, [w, v]), [w, v], strict=True))
    return hp


def _mxnet(args: dict[str, Any], rank: int) -> Any:
    import mxnet as mx
    from mxnet import autograd, gluon

    import hipress.mxnet as hp

    hp.init()
    mx.random.seed(0)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(512, activation="relu"), gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    trainer = hp.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                    algorithm="onebit", min_compress=1024)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for x, y in _batches(rank):
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        trainer.step(len(x))
    return hp


def main() -> None:
    framework, args = sys.argv[1], json.loads(sys.argv[2])
    out, rank = Path(sys.argv[3]), int(os.environ["RANK"])
    # the report goes first: the ending follows the last step at once, as in a script
    (out / f"rank{rank}.json").write_text(json.dumps({"trained": True}))
    import torch.distributed as dist

    hp = {"torch": _torch, "tf": _tensorflow, "mx": _mxnet}[framework](args, rank)

    ending = args["ending"]
    if ending in ("shutdown", "both"):
        hp.shutdown()
    if ending in ("destroy", "both", "reversed"):
        dist.destroy_process_group()
    if ending == "reversed":
        hp.shutdown()


if __name__ == "__main__":
    main()
