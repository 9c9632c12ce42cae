"""When will a waiting job start? The scheduler's own passes, run forward on a copy of its state.

From the folded state, forward in time: the pass places what it would place now; then the running
job expected to end first (declared duration, else the latest prediction; a job placed but not
started yet starts now) ends, and the pass runs again; until every job asked about has a start, or
nothing expected to end is left (a job of unknown duration holds its GPUs for ever, as far as a
forecast can tell). The passes are the live
ones (``schedule.plan``, the policy in force, its backfill), folded by the scheduler's own fold, so
a forecast changes exactly when a decision would. It assumes what the state does not say: no
new submissions (they may overtake under SJF, QSSF or priorities), jobs end when expected, and
preemptions are not played out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.placement import ViewCache
from services.scheduler.policy import Policy
from services.scheduler.ranks import RankIndex
from services.scheduler.schedule import plan
from services.scheduler.state import SchedulerState


def forecast_starts(
    state: SchedulerState, policy: Policy, jobs: Iterable[str] | None = None, *, max_passes: int = 5_000
) -> dict[str, float]:
    """Each waiting job's (of ``jobs``, default all) estimated start time; jobs without one are
    left out (their start depends on a job of unknown duration, or lies beyond ``max_passes``)."""
    decider = SchedulerDecider(policy)  # its fold, with its checks
    sim = decider.decode_state(decider.encode_state(state))  # a copy to run forward
    wanted = set(sim.queue if jobs is None else jobs) & set(sim.queue)
    starts: dict[str, float] = {}
    views, ranks = ViewCache(), RankIndex()
    seq, now = sim.seq, sim.now

    def fold(event: ev.Event) -> None:
        nonlocal seq
        seq += 1
        decider.evolve(sim, seq, event)

    # A placed job not started yet (its agent is starting it) has no expected end: as far as a forecast
    # can tell it starts now, and ends its duration later (not a job of unknown duration).
    for job_id in list(sim.unstarted):
        job = sim.jobs[job_id]
        for node in dict.fromkeys(a.node for a in job.allocations):
            fold(ev.JobStarted(at=now, job=job_id, attempt=job.attempt, node=node))

    for _ in range(max_passes):
        if not wanted - starts.keys():
            break
        result = plan(sim, policy, backfill=sim.scheduling.backfill, cache=views, ranks=ranks, explain=False)
        for placed in result.placed:
            if placed.job in wanted:
                starts[placed.job] = now
            fold(msgspec.structs.replace(placed, at=now))
            for alloc in placed.allocations:
                fold(ev.JobStarted(at=now, job=placed.job, attempt=placed.attempt, node=alloc.node))
        if not wanted - starts.keys():
            break
        ending = [(end, job) for end, job in sim.ends[:1] if math.isfinite(end)]
        if not ending:
            break  # nothing is expected to end: the rest cannot be told
        end = max(now, ending[0][0])
        while sim.ends and sim.ends[0][0] <= end:  # everything that ends by then
            first = sim.ends[0]
            job = sim.jobs[first[1]]
            fold(ev.JobFinished(at=end, job=job.job, attempt=job.attempt, outcome="completed"))
            if sim.ends and sim.ends[0] == first:  # (the fold did not end it: stop rather than spin)
                return starts
        now = end
    return starts
