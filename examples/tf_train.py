"""Train an MLP on scikit-learn's digits with TensorFlow and HiPress.

    hipress run -np 2 examples/tf_train.py --algorithm onebit        # GradientTape loop
    hipress run -np 2 examples/tf_train.py --mode keras              # model.fit

Runs in the TensorFlow environment (make venv-tf; .venv-tf/bin/hipress run ...).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
from _digits import batches, digest, load_digits_split

import hipress.tensorflow as hp
from hipress.distributed import allgather_object


def make_model(width: int) -> tf.keras.Model:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(10)])


def main() -> None:
    import keras

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="tape", choices=["tape", "keras"])
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
    model = make_model(args.width)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    hp.broadcast_variables(model.variables, root_rank=0)
    losses: list[float] = []
    start = time.perf_counter()
    if args.mode == "keras":
        opt = hp.DistributedOptimizer(keras.optimizers.SGD(args.lr, momentum=0.9),
                                      algorithm=args.algorithm)
        model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
        steps = len(xtr) // (args.batch * world)
        for epoch in range(args.epochs):
            idx = np.concatenate(batches(len(xtr), args.batch, rank, world, epoch))
            history = model.fit(xtr[idx], ytr[idx], batch_size=args.batch, epochs=1,
                                shuffle=False, verbose=0,
                                steps_per_epoch=args.steps or steps,
                                callbacks=[hp.BroadcastGlobalVariablesCallback(0)]
                                if epoch == 0 else [])
            losses += history.history["loss"]
            if args.steps:
                break
    else:
        opt = keras.optimizers.SGD(args.lr, momentum=0.9)

        @tf.function
        def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hp.DistributedGradientTape(tape, algorithm=args.algorithm)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        step = 0
        for epoch in range(args.epochs):
            for idx in batches(len(xtr), args.batch, rank, world, epoch):
                losses.append(float(train_step(xtr[idx], ytr[idx])))
                step += 1
                if args.steps and step >= args.steps:
                    break
            if args.steps and step >= args.steps:
                break
    elapsed = time.perf_counter() - start
    accuracy = float((model.predict(xte, verbose=0).argmax(1) == yte).mean())
    digests = allgather_object(digest([v.numpy() for v in model.trainable_variables]))
    result = {"mode": args.mode, "algorithm": args.algorithm, "world": world,
              "seconds": elapsed, "losses": losses, "accuracy": accuracy,
              "replicas_identical": len(set(digests)) == 1}
    if rank == 0:
        print(f"tensorflow {args.mode} {args.algorithm}: {len(losses)} steps/epochs in "
              f"{elapsed:.1f} s, accuracy {accuracy:.3f}, replicas identical: "
              f"{result['replicas_identical']}")
        if args.metrics:
            args.metrics.write_text(json.dumps(result))
    hp.shutdown()


if __name__ == "__main__":
    main()
