"""Queue policies: which waiting job the scheduler tries next.

A policy orders the queue and says whether a job that does not fit blocks
the ones behind it. Later policies (SJF, SRTF, Tiresias, QSSF, fair share)
plug in here; placement and state stay the same.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator

from gpuherd.state import ClusterState, JobState


class Policy(abc.ABC):
    name: str
    blocking: bool = True  # a head job that does not fit holds back the jobs behind it

    @abc.abstractmethod
    def order(self, state: ClusterState) -> Iterator[JobState]: ...


class Fifo(Policy):
    """First come, first served, strictly: no job overtakes the head of the queue."""

    name = "fifo"
    blocking = True

    def order(self, state: ClusterState) -> Iterator[JobState]:
        for job_id in state.queue:
            yield state.jobs[job_id]


POLICIES: dict[str, type[Policy]] = {"fifo": Fifo}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}") from None
