"""fz3: ZeRO-3 training as pure functions over a sharded parameter pytree.

    model, params = fz3.shard(module, layers="blocks", pre=pre_fn, post=post_fn)
    loss, grads = fz3.value_and_grad(model)(params, batch)
"""

from . import optim
from .accumulate import Accumulate, accumulate
from .debug import NonFiniteError, StepFrame, any_rank, step_through
from .checkpoint import load, save
from .executor import Frame, Result
from .export import ExportReport, export, read_export
from .failures import RankLostError
from .layout import FlatLayout, Slot
from .masks import decay_mask
from .memory import MemoryPlan, memory_plan
from .model import Params, ShardedModel, shard
from .precision import Precision
from .record import Event, Recorder
from .schedule import OUTER, Op, Policy, Schedule, ScheduleError, deferred, plan, validate
from .state_dict import full_state_dict
from .step import ValueAndGrad, apply, value_and_grad
from .trace import chrome_trace, trace, trace_summary

__all__ = [
    "Accumulate", "accumulate", "OUTER", "Event", "NonFiniteError", "StepFrame", "any_rank", "step_through", "FlatLayout", "Frame", "Op", "Params", "Policy", "Precision", "Recorder", "Result",
    "Schedule", "ScheduleError", "ShardedModel", "Slot", "ValueAndGrad", "apply", "decay_mask",
    "full_state_dict", "optim", "plan", "shard", "validate", "deferred", "value_and_grad",
    "MemoryPlan", "memory_plan", "save", "load", "export", "read_export", "ExportReport", "RankLostError", "chrome_trace", "trace", "trace_summary",
]
