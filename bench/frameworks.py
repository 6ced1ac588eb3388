"""How much it costs a gradient to leave a framework and come back (no network).

For a model's gradient profile (default ResNet-50 at a tenth: 161 tensors, 2.6M floats)
this times, in one process and one run, the crossing HiPress's framework plugins make
every step, against ``numpy.copyto`` of the same bytes (one memory copy, the reference):

TensorFlow (run in .venv-tf)
  * ``numpy_function``: the graph-mode route — one ``tf.numpy_function`` over the whole
    list inside ``tf.function``, copying each gradient into an owned buffer and back;
  * ``eager``: ``Tensor.numpy()`` per gradient and ``tf.convert_to_tensor`` back;
  * ``identity``: the same list through ``tf.identity`` in ``tf.function`` (TensorFlow's
    own floor for touching the tensors).
MXNet (run in .venv-mx)
  * ``dlpack``: the plugins' route — a writable DLPack view of each gradient (no copy);
  * ``asnumpy``: ``NDArray.asnumpy()`` and ``arr[:] = ...`` back (two copies).

    .venv-tf/bin/python bench/frameworks.py          # or .venv-mx/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from casync.model.models import profile  # noqa: E402

RESULTS = HERE / "results"


def _time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tensorflow(arrays: list[np.ndarray], reps: int) -> dict[str, float]:
    import tensorflow as tf

    tensors = [tf.constant(a) for a in arrays]

    def own(*xs: np.ndarray) -> list[np.ndarray]:
        return [np.array(x, dtype=np.float32, copy=True) for x in xs]

    @tf.function
    def through_numpy(xs: list[Any]) -> list[Any]:
        return tf.numpy_function(own, xs, [tf.float32] * len(xs), stateful=True)

    @tf.function
    def identity(xs: list[Any]) -> list[Any]:
        return [tf.identity(x) for x in xs]

    def eager() -> None:
        [tf.convert_to_tensor(t.numpy()) for t in tensors]

    return {"numpy_function": _time(lambda: through_numpy(tensors), reps),
            "eager": _time(eager, reps),
            "identity": _time(lambda: identity(tensors), reps)}


def _mxnet(arrays: list[np.ndarray], reps: int) -> dict[str, float]:
    import mxnet as mx

    from hipress.mxnet.arrays import host_view

    nds = [mx.nd.array(a) for a in arrays]

    def dlpack() -> None:
        for nd in nds:
            host_view(nd)

    def asnumpy() -> None:
        for nd in nds:
            nd[:] = nd.asnumpy()
        mx.nd.waitall()

    return {"dlpack": _time(dlpack, reps), "asnumpy": _time(asnumpy, reps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/frameworks.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="resnet50")
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(max(1, int(n * args.scale))).astype(np.float32)
              for _, n in profile(args.profile)]
    flat = np.concatenate(arrays)
    dst = np.empty_like(flat)
    copy = _time(lambda: np.copyto(dst, flat), args.reps)
    try:
        import tensorflow  # noqa: F401

        framework, times = "tensorflow", _tensorflow(arrays, args.reps)
    except ImportError:
        import mxnet  # noqa: F401

        framework, times = "mxnet", _mxnet(arrays, args.reps)
    print(f"{framework}: {len(arrays)} gradients, {flat.size:,} floats; numpy.copyto "
          f"{copy * 1e3:.2f} ms")
    for name, t in times.items():
        print(f"  {name:<15} {t * 1e3:8.2f} ms  {t / copy:6.1f}x copy")
    out = args.out or RESULTS / f"frameworks-{framework}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"framework": framework, "tensors": len(arrays),
                               "elements": int(flat.size), "copy_s": copy,
                               "seconds": times}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
