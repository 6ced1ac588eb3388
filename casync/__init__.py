"""CaSync: compression-aware gradient synchronization over ``torch.distributed``.

    import casync
    sync = casync.engine("onebit", "ring")      # an Engine (casync.engine)
    for name, p in model.named_parameters():
        sync.submit(name, p.grad)
    sync.synchronize()              # p.grad holds the average over ranks

The cost model, profiler, planner and simulator live in ``casync.model``.
"""

from .executor import Executor, Graph, Task
from .feedback import ErrorFeedback
from .graphs import BUILDERS, Context
from .interface import Engine, engine
from .model.costmodel import CostModel, Linear
from .model.planner import CostPlanner
from .plan import TOPOLOGIES, Plan, Planner, StaticPlanner
from .synchronizer import Synchronizer, default_timeout
from .transport import Handle, Transport

__all__ = [
    "Engine", "engine", "Synchronizer", "default_timeout", "Plan", "Planner",
    "StaticPlanner", "CostPlanner",
    "CostModel", "Linear", "TOPOLOGIES",
    "ErrorFeedback", "Executor", "Graph", "Task", "BUILDERS", "Context", "Handle",
    "Transport",
]
