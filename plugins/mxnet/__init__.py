"""HiPress for MXNet 1.9 (Gluon): ``import hipress.mxnet as hp``.

    hp.init()
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                            kvstore=hp.KVStore(algorithm="onebit"))
    # or, averaging like Horovod's DistributedTrainer:
    trainer = hp.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                    algorithm="onebit")
    hp.broadcast_parameters(net.collect_params(), root_rank=0)

The same engine and names as ``hipress.torch``; MXNet 1.9.1 needs its own virtual
environment (``make venv-mx``: NumPy 1.23.5). Runs under ``hipress run`` or torchrun.
"""

from hipress._plugin import require_framework

mx = require_framework("mxnet", "mxnet", "pip install 'mxnet==1.9.1' 'numpy==1.23.5'")

import os  # noqa: E402

from compll.parallelism import follow  # noqa: E402


def _omp_threads() -> int | None:
    """The threads MXNet's CPU operators run on, where the process said (MXNet reads
    these two at start-up and has no getter); None: its default, the cores' share."""
    said = [int(v) for v in (os.environ.get("OMP_NUM_THREADS", "").strip(),
                             os.environ.get("MXNET_OMP_MAX_THREADS", "").strip())
            if v.isdigit() and int(v) > 0]
    return min(said) if said else None


# The kernels take as many threads as MXNet's operators do, read at every kernel call.
follow("MXNet's OMP_NUM_THREADS / MXNET_OMP_MAX_THREADS", _omp_threads)

from hipress.distributed import (  # noqa: E402
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from .functions import broadcast_parameters  # noqa: E402
from .kvstore import KVStore  # noqa: E402
from .trainer import DistributedTrainer  # noqa: E402

__all__ = [
    "init", "is_initialized", "rank", "size", "local_rank", "local_size", "shutdown",
    "KVStore", "DistributedTrainer", "broadcast_parameters",
]
