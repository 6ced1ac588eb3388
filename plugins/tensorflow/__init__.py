"""HiPress for TensorFlow 2 / Keras 3: ``import hipress.tensorflow as hp``.

    hp.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hp.DistributedGradientTape(tape, algorithm="onebit")
    grads = tape.gradient(loss, model.trainable_variables)   # averaged over ranks

    # or with Keras: model.compile(optimizer=hp.DistributedOptimizer(opt), ...)
    model.fit(..., callbacks=[hp.BroadcastGlobalVariablesCallback(0)])

The same engine and names as ``hipress.torch``; TensorFlow needs its own virtual
environment (``make venv-tf``: NumPy >= 1.26). Runs under ``hipress run`` or torchrun.
"""

from hipress._plugin import require_framework

tf = require_framework("tensorflow", "tensorflow", "pip install 'hipress[tf]'")

from compll.parallelism import follow  # noqa: E402

# The kernels take as many threads as TensorFlow's ops do (0, TF's default: the cores'
# share), read at every kernel call.
follow("tf.config.threading.get_intra_op_parallelism_threads()",
       tf.config.threading.get_intra_op_parallelism_threads)

from hipress.distributed import (  # noqa: E402
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from .functions import broadcast_variables  # noqa: E402
from .gradients import DistributedGradientTape, sync_errors  # noqa: E402
from .keras import BroadcastGlobalVariablesCallback, DistributedOptimizer  # noqa: E402

__all__ = [
    "init", "is_initialized", "rank", "size", "local_rank", "local_size", "shutdown",
    "DistributedGradientTape", "DistributedOptimizer", "broadcast_variables",
    "BroadcastGlobalVariablesCallback", "sync_errors",
]
