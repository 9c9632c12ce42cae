"""A queue explained: each waiting job's position, why it waits and when it is expected to start.

The contract between a decider that explains its queue (the scheduler's spec offers an
``explainer``: its own fold, pass and forecast) and the readers that show it (the dashboard), which
never import each other: the application layer hands a reader the specs of the others. Without an
explainer the queue is shown in submission order with no reasons: ``SubmissionOrder``.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState


class Waiting(msgspec.Struct, frozen=True):
    """One waiting job as the policy sees it (``gpuherd why``'s answer)."""

    job: str
    position: int  # in the policy's order, 1 = next
    kind: str  # why it waits, one word (quota, capacity, gang, ...)
    why: str  # the scheduler's words
    # None: no forecast (its start depends on a job of unknown duration, or lies too far ahead)
    estimated_start: float | None = None


class QueueAnswer(msgspec.Struct, frozen=True):
    policy: str
    waiting: list[Waiting]
    fair_share: dict[str, float] = {}  # VC -> decayed GPU-seconds of past use
    # The log position the answer is for (the oldest of what it is made of); an explainer may answer
    # with an older one while the log moves fast, and a reader asks again later. None: not said (current).
    seq: int | None = None


class QueueExplainer(Protocol):
    """Folds the log as the scheduler does and explains its queue."""

    def fold(self, seq: int, event: ev.Event) -> None: ...

    def explain(self) -> QueueAnswer: ...


class SubmissionOrder:
    """No policy at hand: waiting jobs in submission order, their reason unknown."""

    def __init__(self, state: ClusterState) -> None:
        self._state = state  # the dashboard's own fold (it folds it; this only reads it)

    def fold(self, seq: int, event: ev.Event) -> None:
        return None

    def explain(self) -> QueueAnswer:
        rows = [
            Waiting(job=job, position=n, kind="unknown", why="no scheduler policy is loaded in this dashboard")
            for n, job in enumerate(self._state.queue, 1)
        ]
        return QueueAnswer(policy="submission order", waiting=rows, seq=self._state.seq)
