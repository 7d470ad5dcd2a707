"""What fz3 tells the person running the job, once per job or once per rank.

Every message goes through ``logging``, on the ``fz3`` logger's children (``logging.getLogger
(__name__)`` in each module), never ``print`` nor ``warnings.warn`` (a suite that turns warnings
into errors, as fz3's and many users' do, would fail on a message). fz3 adds no handler and
never calls ``basicConfig``: with no logging configured, Python's last-resort handler prints
WARNING and above to stderr; INFO shows once the program configures logging and sets the
``fz3`` logger to INFO.

What changes what runs (a layer run through autograd, layers traced again, a fallback, the
planner's choice) is a WARNING. A message every rank would say alike (it follows from the model
and the schedule, which ``fz3.shard`` and ``value_and_grad`` checked are the same on every rank)
is said by global rank 0 alone: ``once``. A message that follows from a rank's own batch may
differ between ranks: ``per_rank`` prefixes it ``[rank r]``.
"""

from __future__ import annotations

import logging

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def once(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """``logger.log(level, msg, *args)`` on global rank 0 only (every rank would say the same)."""
    if _rank() == 0:
        logger.log(level, msg, *args)


def per_rank(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """``logger.log(level, "[rank r] " + msg, *args)`` on this rank (ranks may differ)."""
    logger.log(level, "[rank %d] " + msg, _rank(), *args)
