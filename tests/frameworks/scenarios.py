"""Rank scenarios for the TensorFlow and MXNet suites (run by tests/ranks.py's launcher).

Each trains the digits MLP for a few steps on every rank and reports losses, a digest of
the parameters, and for ``algorithm="none"`` the largest difference between the
averaged gradient and the mean of every rank's own gradient.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent / "examples")]

from _digits import batches, digest, load_digits_split  # noqa: E402
from ranks import main, stall  # noqa: E402

STEPS = 20
BATCH = 32
WIDTH = 64


def _die_if_asked(args: dict[str, Any], rank: int, step: int, out: Path) -> None:
    if args.get("kill_rank") == rank and step == args.get("kill_step"):
        sys.stdout.flush()
        if args.get("stall"):  # alive, silent past the survivors' timeout
            stall(out, rank, float(os.environ["HIPRESS_TIMEOUT"]) + 5)
            return
        os._exit(3)


def _failed(args: dict[str, Any], rank: int, out: Path, exc: Exception, since: float,
            hp: Any) -> dict[str, Any]:
    """What a scenario reports for a SyncError; with ``exit_code``, it also ends the
    process as a user's script would: shut HiPress down, then exit with that code."""
    report = {"sync_error": str(exc), "type": type(exc).__name__,
              "after": time.monotonic() - since}
    if args.get("exit_code") is None:
        return report
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    hp.shutdown()
    sys.exit(int(args["exit_code"]))


# -------------------------------------------------------------------------- TensorFlow


def tf_train(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Each of ``modes``: ``eager`` or ``graph`` (a tf.function step) with
    DistributedGradientTape, or ``keras`` (model.fit with DistributedOptimizer)."""
    import hipress.tensorflow as hp
    from hipress.errors import SyncError

    hp.init()
    results = {}
    for mode in args["modes"]:
        start = time.monotonic()
        try:
            # inside tf.function and model.fit, TensorFlow turns the SyncError into an
            # UnknownError: hp.sync_errors() turns it back
            with hp.sync_errors():
                results[mode] = _tf_mode(args, rank, mode, out)
        except SyncError as exc:
            return _failed(args, rank, out, exc, start, hp)
    return results


def _tf_mode(args: dict[str, Any], rank: int, mode: str, out: Path) -> dict[str, Any]:
    import keras
    import tensorflow as tf

    import hipress.tensorflow as hp
    from hipress.distributed import allgather_object

    world = hp.size()
    xtr, ytr, _, _ = load_digits_split()
    keras.utils.set_random_seed(rank)  # different initial weights: the broadcast must fix it
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(WIDTH, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    algo = args["algo"]
    idx = batches(len(xtr), BATCH, rank, world, 0)[:STEPS]
    losses: list[float] = []
    grad_error = None
    if mode == "keras":
        opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.05), algorithm=algo)
        model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
        sel = np.concatenate(idx)
        fault = keras.callbacks.LambdaCallback(
            on_train_batch_begin=lambda batch, logs: _die_if_asked(args, rank, batch, out))
        history = model.fit(xtr[sel], ytr[sel], batch_size=BATCH, epochs=2, shuffle=False,
                            verbose=0, callbacks=[hp.BroadcastGlobalVariablesCallback(0), fault])
        losses = history.history["loss"]
    else:
        hp.broadcast_variables(model.variables, 0)
        opt = keras.optimizers.SGD(0.05)

        def grads_of(x: Any, y: Any) -> tuple[Any, list[Any], list[Any]]:
            with tf.GradientTape(persistent=True) as tape:
                loss = loss_fn(y, model(x, training=True))
            local = tape.gradient(loss, model.trainable_variables)
            averaged = hp.DistributedGradientTape(tape, algorithm=algo).gradient(
                loss, model.trainable_variables)
            return loss, local, averaged

        step_fn = tf.function(grads_of) if mode == "graph" else grads_of
        for step, sel in enumerate(idx):
            _die_if_asked(args, rank, step, out)
            loss, local, averaged = step_fn(xtr[sel], ytr[sel])
            if algo == "none" and step == 0:
                mine = [g.numpy() for g in local]
                every = allgather_object(mine)
                mean = [sum(r[i] for r in every) / world for i in range(len(mine))]
                grad_error = max(float(np.abs(a.numpy() - m).max())
                                 for a, m in zip(averaged, mean, strict=True))
            opt.apply_gradients(zip(averaged, model.trainable_variables, strict=True))
            losses.append(float(loss))
    return {"losses": [float(v) for v in losses], "grad_error": grad_error,
            "digest": digest([v.numpy() for v in model.trainable_variables])}


def tf_amp(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Keras's LossScaleOptimizer over averaged gradients: ``tape`` (DistributedGradientTape,
    scale_loss, apply) and ``keras`` (model.fit under the mixed_float16 policy with
    hp.DistributedOptimizer). In step ``overflow`` rank 1's loss is inf. Returns the loss
    scale after each step and the weights' digest."""
    import keras

    import hipress.tensorflow as hp

    hp.init()
    report = {}
    for mode in args["modes"]:
        keras.config.set_dtype_policy("mixed_float16" if mode == "keras" else "float32")
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(WIDTH,
                                                                         activation="relu"),
                                  keras.layers.Dense(10, dtype="float32")])
        run = _tf_amp_tape if mode == "tape" else _tf_amp_fit
        scales = run(args, rank, model)
        report[mode] = {"scales": scales,
                        "digest": digest([v.numpy() for v in model.trainable_variables]),
                        "finite": all(bool(np.isfinite(v.numpy()).all())
                                      for v in model.trainable_variables)}
    keras.config.set_dtype_policy("float32")
    return report


def _amp_batches(args: dict[str, Any], rank: int) -> tuple[Any, Any, list[np.ndarray]]:
    xtr, ytr, _, _ = load_digits_split()
    return xtr, ytr, batches(len(xtr), BATCH, rank, 2, 0)[:args["steps"]]


def _tf_amp_tape(args: dict[str, Any], rank: int, model: Any) -> list[float]:
    import keras
    import tensorflow as tf

    import hipress.tensorflow as hp

    xtr, ytr, idx = _amp_batches(args, rank)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=1024.0)
    scales = []
    for step, sel in enumerate(idx):
        with tf.GradientTape() as tape:
            loss = ce(ytr[sel], model(xtr[sel], training=True))
            if step == args["overflow"] and rank == 1:
                loss = loss * float("inf")
            scaled = opt.scale_loss(loss)
        tape = hp.DistributedGradientTape(tape, algorithm=args["algo"])
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        scales.append(float(opt.dynamic_scale.numpy()))
    return scales


def _tf_amp_fit(args: dict[str, Any], rank: int, model: Any) -> list[float]:
    import keras
    import tensorflow as tf

    import hipress.tensorflow as hp

    xtr, ytr, idx = _amp_batches(args, rank)
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    boom = tf.Variable(1.0, trainable=False)
    scales: list[float] = []

    def loss_fn(y: Any, logits: Any) -> Any:
        return ce(y, logits) * boom

    def before(batch: int, logs: Any) -> None:
        boom.assign(float("inf") if batch == args["overflow"] and rank == 1 else 1.0)

    def after(batch: int, logs: Any) -> None:
        scales.append(float(model.optimizer.dynamic_scale.numpy()))

    opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.05), algorithm=args["algo"])
    model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
    sel = np.concatenate(idx)
    model.fit(xtr[sel], ytr[sel], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_begin=before,
                                                        on_train_batch_end=after)])
    return scales


def _batch(rank: int, step: int, n: int) -> np.ndarray:
    return np.random.default_rng([rank, step]).integers(0, n, BATCH)


def tf_checkpoint(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """Train ``steps`` steps from ``start`` with a DistributedGradientTape (``tape``) or
    Keras's fit with DistributedOptimizer (``keras``), loading the checkpoint in ``load``
    first and saving one to ``save`` after step ``save_at`` (weights and HiPress's state;
    under Keras, between two calls of fit)."""
    import pickle

    import keras
    import tensorflow as tf

    import hipress.tensorflow as hp

    hp.init()
    xtr, ytr, _, _ = load_digits_split()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    algo, mode = args["algo"], args["mode"]
    opt = keras.optimizers.SGD(0.05)
    holder: Any
    if mode == "keras":
        opt = hp.DistributedOptimizer(opt, algorithm=algo)
        model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
        holder = opt
    else:
        holder = hp.DistributedGradientTape(tf.GradientTape(), algorithm=algo)
    if args.get("load"):
        saved = pickle.loads((Path(args["load"]) / f"rank{rank}.pkl").read_bytes())
        model.set_weights(saved["weights"])
        holder.load_state_dict(saved["hipress"])
    def train(steps: range) -> None:
        if not steps:
            return
        if mode == "keras":
            sel = np.concatenate([_batch(rank, s, len(xtr)) for s in steps])
            model.fit(xtr[sel], ytr[sel], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            return
        for step in steps:
            sel = _batch(rank, step, len(xtr))
            with tf.GradientTape() as tape:
                loss = loss_fn(ytr[sel], model(xtr[sel], training=True))
            grads = hp.DistributedGradientTape(tape, algorithm=algo).gradient(
                loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    start, end = args["start"], args["start"] + args["steps"]
    cut = args["save_at"] if args.get("save") else end
    train(range(start, cut))
    if args.get("save"):
        folder = Path(args["save"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.pkl").write_bytes(pickle.dumps(
            {"weights": model.get_weights(), "hipress": holder.state_dict()}))
    train(range(cut, end))
    np.savez(out / f"rank{rank}.npz",
             params=np.concatenate([w.reshape(-1) for w in model.get_weights()]))
    return {}


# ------------------------------------------------------------------------------ MXNet


def mx_train(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``mode``: ``kvstore`` (gluon.Trainer with hp.KVStore, sums) or ``trainer``
    (hp.DistributedTrainer, averages)."""
    import mxnet as mx
    from mxnet import autograd, gluon

    import hipress.mxnet as hp
    from hipress.distributed import allgather_object
    from hipress.errors import SyncError

    hp.init()
    world = hp.size()
    xtr, ytr, _, _ = load_digits_split()
    mx.random.seed(rank)  # different initial weights: the broadcast must fix it
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(WIDTH, activation="relu", in_units=64),
            gluon.nn.Dense(10, in_units=WIDTH))
    net.initialize(mx.init.Xavier())
    params = net.collect_params()
    hp.broadcast_parameters(params, 0)
    algo = args["algo"]
    if args["mode"] == "kvstore":
        trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.05},
                                kvstore=hp.KVStore(algorithm=algo))
        scale = BATCH * world
    else:
        trainer = hp.DistributedTrainer(params, "sgd", {"learning_rate": 0.05},
                                        algorithm=algo)
        scale = BATCH
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses, grad_error = [], None
    start = time.monotonic()
    try:
        for step, sel in enumerate(batches(len(xtr), BATCH, rank, world, 0)[:STEPS]):
            _die_if_asked(args, rank, step, out)
            x, y = mx.nd.array(xtr[sel]), mx.nd.array(ytr[sel])
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            if algo == "none" and step in (0, 1):
                mine = [p.grad().asnumpy() for p in params.values()]
                trainer.allreduce_grads()
                every = allgather_object(mine)
                # a KVStore sums over ranks; DistributedTrainer averages
                want = [sum(r[i] for r in every) / (1 if args["mode"] == "kvstore" else world)
                        for i in range(len(mine))]
                err = max(float(np.abs(p.grad().asnumpy() - w).max() / max(np.abs(w).max(), 1))
                          for p, w in zip(params.values(), want, strict=True))
                grad_error = err if grad_error is None else max(grad_error, err)
                trainer.update(scale)
            else:
                trainer.step(scale)
            losses.append(float(loss.mean().asscalar()))
            start = time.monotonic()
    except SyncError as exc:
        return _failed(args, rank, out, exc, start, hp)
    return {"losses": losses, "grad_error": grad_error,
            "digest": digest([p.data().asnumpy() for p in params.values()])}


def mx_amp(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """MXNet's AMP (bfloat16 on the CPU) with its dynamic loss scaler, through hp.KVStore
    and hp.DistributedTrainer: in step ``overflow`` rank 1's loss is inf. The scaler
    checks the gradients after the trainer's allreduce. Returns the loss scale after each
    step and the parameters' digest."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.contrib import amp

    import hipress.mxnet as hp

    hp.init()
    amp.init(target_dtype="bfloat16")
    xtr, ytr, _, _ = load_digits_split()
    report = {}
    for mode in args["modes"]:
        mx.random.seed(0)
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(WIDTH, activation="relu", in_units=64),
                gluon.nn.Dense(10, in_units=WIDTH))
        net.initialize(mx.init.Xavier())
        params = net.collect_params()
        if mode == "kvstore":
            trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.05},
                                    kvstore=hp.KVStore(algorithm=args["algo"]))
        else:
            trainer = hp.DistributedTrainer(params, "sgd", {"learning_rate": 0.05},
                                            algorithm=args["algo"])
        amp.init_trainer(trainer)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        scales = []
        for step, sel in enumerate(batches(len(xtr), BATCH, rank, 2, 0)[:args["steps"]]):
            x, y = mx.nd.array(xtr[sel]), mx.nd.array(ytr[sel])
            with autograd.record():
                loss = loss_fn(net(x), y).mean()
                if step == args["overflow"] and rank == 1:
                    loss = loss * float("inf")
                with amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
            trainer.step(1)
            scales.append(float(trainer._amp_loss_scaler._next_loss_scale))
        data = [p.data().asnumpy().astype(np.float32) for p in params.values()]
        report[mode] = {"scales": scales, "digest": digest(data),
                        "finite": all(bool(np.isfinite(d).all()) for d in data)}
    return report


def mx_checkpoint(args: dict[str, Any], rank: int, out: Path) -> dict[str, Any]:
    """``tf_checkpoint`` for MXNet: a Gluon Trainer with hp.KVStore (``kvstore``) or
    hp.DistributedTrainer (``trainer``)."""
    import pickle

    import mxnet as mx
    from mxnet import autograd, gluon

    import hipress.mxnet as hp

    hp.init()
    world = hp.size()
    xtr, ytr, _, _ = load_digits_split()
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(1024, activation="relu", in_units=64),
            gluon.nn.Dense(1024, activation="relu", in_units=1024),
            gluon.nn.Dense(10, in_units=1024))
    net.initialize(mx.init.Xavier())
    params = net.collect_params()
    algo = args["algo"]
    holder: Any
    if args["mode"] == "kvstore":
        holder = hp.KVStore(algorithm=algo)
        trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.05}, kvstore=holder)
        scale = BATCH * world
    else:
        trainer = holder = hp.DistributedTrainer(params, "sgd", {"learning_rate": 0.05},
                                                 algorithm=algo)
        scale = BATCH
    if args.get("load"):
        saved = pickle.loads((Path(args["load"]) / f"rank{rank}.pkl").read_bytes())
        for p, value in zip(params.values(), saved["weights"], strict=True):
            p.set_data(mx.nd.array(value))
        holder.load_state_dict(saved["hipress"])
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(args["start"], args["start"] + args["steps"]):
        sel = _batch(rank, step, len(xtr))
        x, y = mx.nd.array(xtr[sel]), mx.nd.array(ytr[sel])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(scale)
        if args.get("save") and step + 1 == args["save_at"]:
            folder = Path(args["save"])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{rank}.pkl").write_bytes(pickle.dumps(
                {"weights": [p.data().asnumpy() for p in params.values()],
                 "hipress": holder.state_dict()}))
    weights = [p.data().asnumpy() for p in params.values()]
    np.savez(out / f"rank{rank}.npz", params=np.concatenate([w.reshape(-1) for w in weights]))
    return {}


if __name__ == "__main__":
    main({"tf_train": tf_train, "mx_train": mx_train, "tf_checkpoint": tf_checkpoint,
          "mx_checkpoint": mx_checkpoint, "tf_amp": tf_amp, "mx_amp": mx_amp})
