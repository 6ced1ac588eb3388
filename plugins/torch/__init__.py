"""HiPress for PyTorch: ``import hipress.torch as hp``.

    hp.init()
    ddp.register_comm_hook(hp.HookState(algorithm="onebit"), hp.comm_hook)
    # or, without DDP:
    opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  algorithm="dgc")
    hp.broadcast_parameters(model.state_dict(), root_rank=0)
    # or, sharded (FSDP2): compressed gradient reduce-scatter
    state = hp.compress_fsdp(model, algorithm="cgx", bits=4)

The same names exist in ``hipress.tensorflow`` and ``hipress.mxnet``.
"""

from hipress._plugin import require_framework

torch = require_framework("torch", "torch", "pip install 'torch==2.13.*'")

from compll.parallelism import follow  # noqa: E402

# The kernels take as many threads as torch's intra-op pool (torch.set_num_threads), read
# at every kernel call.
follow("torch.get_num_threads()", torch.get_num_threads)

from hipress.distributed import (  # noqa: E402
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from .diloco import DiLoCo  # noqa: E402
from .fsdp import FSDPState, compress_fsdp  # noqa: E402
from .functions import broadcast_optimizer_state, broadcast_parameters  # noqa: E402
from .hooks import HookState, comm_hook  # noqa: E402
from .optimizer import DistributedOptimizer  # noqa: E402
from .state import AllRanksState  # noqa: E402

__all__ = [
    "init", "is_initialized", "rank", "size", "local_rank", "local_size", "shutdown",
    "HookState", "comm_hook", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "compress_fsdp", "FSDPState", "DiLoCo", "AllRanksState",
]
