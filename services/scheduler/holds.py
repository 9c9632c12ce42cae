"""What holds a waiting job back before its quota and its placement are looked at (a phase of the
scheduling pass, ``schedule.py``): its dependencies, its array's ``max_running``, and its VC's
per-user limits. A held job takes no part in the pass: it is never the head, reserves nothing and
preempts nothing (Slurm's ``Dependency``, ``JobArrayTaskLimit`` and ``QOSMaxGRESPerUser`` reasons).

The counts start from the scheduler's state and grow with the pass's own placements, so a pass
never places more of an array, or of one user's jobs, than the limits allow.
"""

from __future__ import annotations

from typing import Literal

from gpuherd.fold import JobState
from services.scheduler.state import SchedulerState, dependency_wait, user_key

HoldKind = Literal["dependency", "array limit", "user limit"]


class Holds:
    """One pass's view of the limits: the state's counts plus the pass's placements so far."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.limited_vcs = {
            name
            for name, vc in state.vcs.items()
            if vc.max_gpus_per_user is not None or vc.max_running_per_user is not None
        }
        self.array_placed: dict[str, int] = {}  # by this pass
        self.user_gpus: dict[str, int] = {}
        self.user_active: dict[str, int] = {}

    def check(self, job: JobState) -> tuple[HoldKind, str] | None:
        """Why ``job`` may not start now whatever GPUs are free (None: nothing holds it back)."""
        spec = job.spec
        if spec.depends_on is None and spec.array_of is None and spec.vc not in self.limited_vcs:
            return None  # (most jobs)
        state = self.state
        if spec.depends_on is not None:
            never = state.doomed.get(job.job)
            if never is not None:
                return "dependency", f"{never}: it is cancelled"
            waiting, never = dependency_wait(state, spec.depends_on)
            if never is not None:
                return "dependency", f"{never}; it waits until cancelled (kill_on_invalid_dep is off)"
            if waiting is not None:
                return "dependency", f"waits for {waiting}"
        member = spec.array_of
        if member is not None and member.max_running is not None:
            book = state.arrays.get(member.array)
            running = (book.active if book is not None else 0) + self.array_placed.get(member.array, 0)
            if running >= member.max_running:
                return "array limit", (
                    f"{running} elements of array {member.array} are placed or running; it allows "
                    f"{member.max_running} at once"
                )
        if spec.vc in self.limited_vcs:
            return self._user_limit(job)
        return None

    def _user_limit(self, job: JobState) -> tuple[HoldKind, str] | None:
        spec, state = job.spec, self.state
        vc = state.vcs[spec.vc]
        key = user_key(spec.vc, spec.user)
        if vc.max_running_per_user is not None:
            running = state.user_active.get(key, 0) + self.user_active.get(key, 0)
            if running >= vc.max_running_per_user:
                return "user limit", (
                    f"user {spec.user} has {running} jobs placed or running in VC {vc.vc}, which allows "
                    f"{vc.max_running_per_user} per user"
                )
        if vc.max_gpus_per_user is not None:
            held = state.user_gpus.get(key, 0) + self.user_gpus.get(key, 0)
            if held + spec.gpus > vc.max_gpus_per_user:
                return "user limit", (
                    f"user {spec.user} holds {held} GPUs in VC {vc.vc}, which allows {vc.max_gpus_per_user} "
                    f"per user; this job needs {spec.gpus} more"
                )
        return None

    def placed(self, job: JobState) -> None:
        """The pass placed ``job``: it counts against its array's and its user's limits from now on."""
        spec = job.spec
        if spec.array_of is not None:
            self.array_placed[spec.array_of.array] = self.array_placed.get(spec.array_of.array, 0) + 1
        if spec.vc in self.limited_vcs:
            key = user_key(spec.vc, spec.user)
            self.user_active[key] = self.user_active.get(key, 0) + 1
            self.user_gpus[key] = self.user_gpus.get(key, 0) + spec.gpus
