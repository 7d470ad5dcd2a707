"""The collectives fz3 issues, called on the process group itself, and their names across the
torch versions fz3 supports.

torch's ``dist.all_gather_single`` (and the others) check their arguments in Python, look for
a torch-function override and a coalescing context, build an options object and log a
failure, then call the process group's method: 5-12 us of host time a call here
(``benchmarks/collective_issue.py``), per unit and direction, on a step whose collectives
the executor already names and checks. fz3 calls the method on the group (a subclass's
override runs) with options built once: the same C++ call, through the same dispatcher
(``c10d::_allgather_base_``: dispatch modes see it; a torch-function mode does not). What it
skips does not apply to fz3's calls: its groups always hold this rank, its tensors are real
(not complex, not overridden), and it never coalesces. torch >= 2.13 names the methods
``*_single``; older torch (2.11 on the GPU machine) ``_allgather_base`` and
``_reduce_scatter_base``; before 2.8 the options had no ``asyncOp`` (every call was
asynchronous).
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                         ReduceScatterOptions)

_PG = dist.ProcessGroup
# The names of the process group's own methods, called on the group (a subclass's override
# runs), ``getattr(group, NAME)(*tensors, options)``: C++ entries, no Python frame between
# fz3's ``_issue`` and the call. Each returns its ``Work``.
# ``ALL_GATHER``: (out (world*n,), shard (n,), GATHER): out <- the shards, concatenated
ALL_GATHER = "all_gather_single" if hasattr(_PG, "all_gather_single") else "_allgather_base"
# ``REDUCE_SCATTER``: (out (n,), full (world*n,), SUM_SCATTER): this rank's chunk of the sum
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(_PG, "reduce_scatter_single") else \
    "_reduce_scatter_base"
# ``ALL_REDUCE``: ([t], SUM): t <- the sum of t over ranks, in place
ALL_REDUCE = "allreduce"
# ``ALL_TO_ALL``: (out, in, out sizes, in sizes, TO_ALL): ``in``'s i-th run of ``in sizes[i]``
# elements goes to rank i; ``out`` holds rank j's run for this rank at its j-th run (gloo has it
# on the CPU, with uneven sizes; torch < 2.13 names it ``alltoall_base``)
ALL_TO_ALL = "all_to_all_single" if hasattr(_PG, "all_to_all_single") else "alltoall_base"


def _options(kind: type, **fields):
    opts = kind()
    if hasattr(opts, "asyncOp"):  # torch >= 2.8 asks; before, every call was asynchronous
        opts.asyncOp = True
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


# read by the C++ call, never written: one of each serves every call
GATHER = _options(AllgatherOptions)
SUM_SCATTER = _options(ReduceScatterOptions, reduceOp=dist.ReduceOp.SUM)
SUM = _options(AllreduceOptions, reduceOp=dist.ReduceOp.SUM)
TO_ALL = _options(AllToAllOptions)


def default_store() -> dist.Store:
    """The rendezvous store every rank shares; it outlives the process groups built on it.
    torch has no public accessor for it (``init_process_group`` does not return it), so this
    reads torch's private one: the one place fz3 does."""
    return dist.distributed_c10d._get_default_store()
