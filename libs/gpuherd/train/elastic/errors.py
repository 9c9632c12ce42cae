"""What goes wrong in elastic training, and how to tell a broken group from a bug in the step."""

from __future__ import annotations

import torch.distributed as dist

from gpuherd.errors import GpuherdError


class ElasticError(GpuherdError):
    """A rescale could not be carried out, and no plan to recover with came in time."""


class GlobalBatchError(GpuherdError, ValueError):
    """The global batch cannot be kept constant at this world size and micro-batch."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the process group broke (a peer died or hung), not a bug in the step."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out")
    )


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
