"""The plans a worker follows (one per generation, written by the node agent into the task folder)
and the phases of one rescale as its new rank 0 saw them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuherd.jobenv import ElasticPlan


class PlanSource(Protocol):
    def latest(self) -> ElasticPlan | None:
        """The newest plan this worker can see (None before the first)."""


class PlanFile:
    """Plans as the node agent writes them into the task folder (a stat per call; read on change)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None
        self._plan: ElasticPlan | None = None

    def latest(self) -> ElasticPlan | None:
        try:
            info = self.path.stat()
        except FileNotFoundError:
            return self._plan
        if (info.st_ino, info.st_mtime_ns, info.st_size) != self._seen:  # the agent replaces the file: a new inode
            try:
                plan = ElasticPlan.from_json(self.path.read_text())
            except (OSError, ValueError, KeyError):
                return self._plan  # being replaced: the next call reads the whole new file
            self._seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            if self._plan is None or plan.generation >= self._plan.generation:
                self._plan = plan
        return self._plan


@dataclass
class RescalePhases:
    """Wall-clock times (``time.time()``, comparable with the log's event times) of one rescale as
    its new rank 0 saw them."""

    generation: int
    world: int
    decided_at: float  # the scheduler committed it (JobResized)
    noticed_at: float  # this worker first saw the plan
    quiesced_at: float = 0.0  # state committed in memory at the step boundary; training stops
    reformed_at: float = 0.0  # the new process group is up
    restored_at: float = 0.0  # the source's state is in place on every rank
    first_step_at: float = 0.0  # the first step at the new size is done
    world_before: int = 0
    samples_per_s_before: float | None = None  # throughput at the old size (for the elastic policy)

    def durations(self) -> dict[str, float]:
        return {
            "notice_s": self.noticed_at - self.decided_at,
            "wait_s": self.quiesced_at - self.noticed_at,  # new workers starting while the old ones train
            "reform_s": self.reformed_at - self.quiesced_at,
            "restore_s": self.restored_at - self.reformed_at,
            "first_step_s": self.first_step_at - self.restored_at,
            "pause_s": self.first_step_at - self.quiesced_at,  # no training at either size
            "total_s": self.first_step_at - self.decided_at,
        }
