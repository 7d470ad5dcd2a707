"""fz3: ZeRO-3 training as pure functions over a sharded parameter pytree.

    model, params = fz3.shard(module, layers="blocks", pre=pre_fn, post=post_fn)
    loss, grads = fz3.value_and_grad(model)(params, batch)
"""

from . import hf, optim
from .comm.failures import CollectiveMismatchError, RankInterruptedError, RankLostError
from .comm.groups import destroy
from .observe.memory import MemoryPlan, memory_plan
from .observe.measure import Measured, measure_memory
from .observe.meter import Meter
from .observe.step_through import StepFrame, any_rank, step_through
from .observe.trace import chrome_trace, trace, trace_summary
from .optim.masks import decay_mask
from .schedule.ops import Category, Op, OpKind
from .observe.budget import plan
from .schedule.planner import Keep, Policy, deferred, keep
from .schedule.schedule import Schedule, ScheduleError, Unit, validate
from .schedule.structure import PartShape, Role
from .sharding.layout import FlatLayout, Slot
from .facade import export, shard
from .sharding.model import Params, ShardedModel
from .sharding.precision import Precision
from .sharding.refreeze import refreeze
from .sharding.unreachable import PartReadError
from .step.accumulate import Accumulate, accumulate
from .step.inductor import CompileError
from .step.state import Frame, Result
from .step.finite import NonFiniteError
from .step.record import Event, Recorder
from .step.value_and_grad import ValueAndGrad, apply, value_and_grad
from .train_step import TrainStep, train_step
from .storage.checkpoint import load, save
from .storage.errors import CheckpointDamagedError, CheckpointError, CheckpointMismatchError
from .storage.verify import CheckpointReport, verify_checkpoint
from .storage.export import ExportReport, read_export
from .storage.pretrained import Pretrained
from .storage.state_dict import full_state_dict, module_state_dict

__all__ = [
    "Accumulate", "Category", "CheckpointDamagedError", "CheckpointError",
    "CheckpointMismatchError", "CheckpointReport", "CollectiveMismatchError", "CompileError",
    "Event", "ExportReport", "FlatLayout", "Frame", "Keep", "Measured", "MemoryPlan", "Meter",
    "NonFiniteError", "Op", "OpKind", "Params", "PartReadError", "PartShape", "Policy",
    "Precision", "Pretrained", "RankInterruptedError", "RankLostError", "Recorder", "Result",
    "Role", "Schedule", "ScheduleError", "ShardedModel", "Slot", "StepFrame", "Unit",
    "TrainStep", "ValueAndGrad", "accumulate", "any_rank", "apply", "chrome_trace",
    "decay_mask", "deferred", "destroy", "export", "full_state_dict", "hf", "keep", "load",
    "measure_memory", "memory_plan", "module_state_dict", "optim", "plan", "read_export",
    "refreeze", "save", "shard", "step_through", "trace", "trace_summary", "train_step",
    "validate", "value_and_grad", "verify_checkpoint",
]
