"""The waiting jobs in the policy's order, kept between a decider's passes.

A pass reads the queue in the policy's order, and most passes read only its first jobs: the
head, and at most ``BACKFILL_DEPTH`` behind it. Sorting every waiting job at every pass took a
quarter of an SRTF simulation of philly (a deep queue, a pass at every event). Under a policy
whose ranks are static (``Policy.static_rank``: a waiting job's rank changes only with an event
that names it, such as a new prediction, or with the policy's configuration) the order is kept
instead: each VC's waiting jobs sorted by rank, updated from the jobs the fold lists as changed
since the pass before (``SchedulerState.queue_changes``), and merged lazily by a pass
(``KeptOrder``). FIFO too is kept so, although the fold's queue is in its order: per VC, a pass
leaves out the VCs whose quota has no room, and sets aside those whose quota holds back every job
still to come, where a pass reading the queue read their jobs one by one.

A policy whose ranks also change with time, at a moment it can tell (``Policy.timed_rank``: LAS,
whose waiting job moves to the first queue once it starves), is kept the same way: each job's
moment waits in a heap, and a pass ranks again the jobs whose moment has come. A moment is
taken a few ulps early (the policy's own test of the time decides; a job not due yet waits on
in the heap), so rounding never leaves a job at its old rank.

A job that left the state in the event that took it out of the queue (a waiting job cancelled)
leaves no change behind: such an entry is dropped when a pass meets it, and the index is
rebuilt when entries for jobs gone outnumber the waiting ones.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Collection, Iterator, Sequence

from gpuherd.fold import JobState
from services.scheduler.policy import Policy
from services.scheduler.state import SchedulerState, SchedulingConfig

Entry = tuple[tuple, str]  # (the policy's rank, the job)


class RankIndex:
    """One decider's order of its waiting jobs, for one state and policy at a time: another jobs
    dict (another state, a decoded snapshot), another policy or configuration, or a sequence that
    went back rebuilds it."""

    def __init__(self) -> None:
        self._of: dict[str, JobState] | None = None
        self._policy: Policy | None = None
        self._config: SchedulingConfig | None = None
        self._seq = 0
        self._by_vc: dict[str, list[Entry]] = {}  # each sorted
        self._rank_of: dict[str, tuple[str, tuple]] = {}  # job -> (its VC, its rank in the index)
        self._gone: set[str] = set()  # jobs a pass met that wait no more
        # (``timed_rank``) when each job's rank may change: a heap, and each job's moment in force
        self._moments: list[tuple[float, str]] = []
        self._moment_of: dict[str, float] = {}

    def refresh(self, state: SchedulerState, policy: Policy) -> bool:
        """Bring the index up to ``state``; False if ``policy``'s ranks are neither static nor timed
        (a pass sorts)."""
        if not (policy.static_rank or policy.timed_rank):
            return False
        bound = 2 * len(state.queue) + 1024
        if (
            state.jobs is not self._of
            or policy is not self._policy
            or state.scheduling is not self._config
            or state.seq < self._seq
            or len(self._rank_of) > bound
            or len(self._moments) > bound
        ):
            self._rebuild(state, policy)
        else:
            changed = state.queue_changed_since(self._seq)
            due = self._due(state.now) if self._moments else []
            if changed or self._gone or due:
                policy.prepare(state)
                jobs = state.jobs
                for job_id in self._gone.union(changed, due):
                    self._remove(job_id)
                    job = jobs.get(job_id)
                    if job is not None and job.status == "pending":
                        self._insert(job, policy, state)
                self._gone.clear()
        self._seq = state.seq
        return True

    def _due(self, now: float) -> list[str]:
        """The jobs whose moment has come (or lies within a few ulps of ``now``)."""
        moments, moment_of = self._moments, self._moment_of
        due = []
        while moments and moments[0][0] - 4 * math.ulp(moments[0][0]) <= now:
            at, job_id = heapq.heappop(moments)
            if moment_of.get(job_id) == at:  # (else an earlier moment of a job ranked again since)
                del moment_of[job_id]
                due.append(job_id)
        return due

    def first(self, state: SchedulerState, vc: str, able: Callable[[JobState], bool]) -> JobState | None:
        """The VC's first waiting job that is ``able``."""
        reading = KeptOrder(state, [(vc, self._by_vc.get(vc, []))], lambda: True, gone=self._gone)
        return next((job for job in reading if able(job)), None)

    def order(
        self,
        state: SchedulerState,
        without: Collection[str] = frozenset(),
        keep: Sequence[JobState] = (),
        resume: Callable[[], bool] = lambda: True,
    ) -> KeptOrder:
        """The waiting jobs in order, lazily: those of VCs in ``without`` left out, but for ``keep``
        (see ``KeptOrder`` for ``resume``)."""
        lists: list[tuple[str | None, list[Entry]]] = [
            (vc, entries) for vc, entries in self._by_vc.items() if vc not in without
        ]
        if keep:
            lists.append((None, sorted((self._rank_of[job.job][1], job.job) for job in keep)))
        return KeptOrder(state, lists, resume, gone=self._gone)

    def _rebuild(self, state: SchedulerState, policy: Policy) -> None:
        self._of, self._policy, self._config = state.jobs, policy, state.scheduling
        policy.prepare(state)
        jobs = state.jobs
        self._by_vc, self._rank_of, self._gone = {}, {}, set()
        self._moments, self._moment_of = [], {}
        for vc, queued in state.queued_by_vc.items():
            entries = sorted((policy.rank(jobs[j], state), j) for j in queued)
            self._by_vc[vc] = entries
            for rank, j in entries:
                self._rank_of[j] = (vc, rank)
                self._expect(j, policy.rank_holds_until(jobs[j], state))

    def _insert(self, job: JobState, policy: Policy, state: SchedulerState) -> None:
        vc, rank = job.spec.vc, policy.rank(job, state)
        bisect.insort(self._by_vc.setdefault(vc, []), (rank, job.job))
        self._rank_of[job.job] = (vc, rank)
        self._expect(job.job, policy.rank_holds_until(job, state))

    def _expect(self, job_id: str, at: float) -> None:
        """Rank the job again at ``at`` (a static rank holds for good: nothing to wait for)."""
        if at < math.inf:
            heapq.heappush(self._moments, (at, job_id))
            self._moment_of[job_id] = at

    def _remove(self, job_id: str) -> None:
        self._moment_of.pop(job_id, None)
        where = self._rank_of.pop(job_id, None)
        if where is None:
            return
        vc, rank = where
        entries = self._by_vc[vc]
        at = bisect.bisect_left(entries, (rank, job_id))
        if at < len(entries) and entries[at][1] == job_id:
            del entries[at]
        else:  # a rank that does not compare (NaN): found by name
            entries.remove(next(e for e in entries if e[1] == job_id))
        if not entries:
            del self._by_vc[vc]


class KeptOrder:
    """One pass's reading of a ``RankIndex``: each VC's sorted jobs (and the kept firsts of VCs left
    out, vc None), merged lazily. A pass may set a VC aside as it reads (``set_aside``: none of the
    VC's jobs still to come can start, so reading them one by one, as a pass behind a VC's quota head
    did, only costs): its jobs are passed over, until ``resume()`` says they count again (the pass
    found its head, and every job read from then on counts toward how deep it looks). Then the VCs
    set aside are read again from the last job read on, as if never set aside: the jobs passed over
    before that point are the only ones the pass did not see."""

    def __init__(
        self,
        state: SchedulerState,
        lists: list[tuple[str | None, list[Entry]]],
        resume: Callable[[], bool],
        *,
        gone: set[str],
    ) -> None:
        self._state, self._resume = state, resume
        self._gone = gone  # the index's: jobs met that wait no more (it drops them at its next refresh)
        self._lists = [entries for _, entries in lists]
        self._source_of = {vc: n for n, (vc, _) in enumerate(lists) if vc is not None}
        self._aside: set[int] = set()
        self._parked: dict[int, int] = {}  # a source set aside -> the position of its first entry not read
        self._last: Entry | None = None

    def set_aside(self, vc: str) -> None:
        source = self._source_of.get(vc)
        if source is not None:
            self._aside.add(source)

    def __iter__(self) -> Iterator[JobState]:
        return self._read()

    def _read(self) -> Iterator[JobState]:
        lists, aside, parked = self._lists, self._aside, self._parked
        heap = [(entries[0], n, 0) for n, entries in enumerate(lists) if entries]
        heapq.heapify(heap)
        jobs, gone = self._state.jobs, self._gone
        heappop, heapreplace = heapq.heappop, heapq.heapreplace
        while heap or parked:
            if parked and self._resume():
                self._take_back(heap)
                if not heap:
                    return
            elif not heap:
                return
            entry, source, at = heap[0]
            if aside and source in aside:
                heappop(heap)
                parked[source] = at
                continue
            entries = lists[source]
            if at + 1 < len(entries):
                heapreplace(heap, (entries[at + 1], source, at + 1))
            else:
                heappop(heap)
            job = jobs.get(entry[1])
            if job is None or job.status != "pending":
                gone.add(entry[1])  # (it left in the event that ended its wait: see the module)
                continue
            self._last = entry
            yield job

    def _take_back(self, heap: list[tuple[Entry, int, int]]) -> None:
        last = self._last
        for source, at in self._parked.items():
            entries = self._lists[source]
            if last is not None:
                at = bisect.bisect_right(entries, last, at)  # (those before were passed over)
            if at < len(entries):
                heapq.heappush(heap, (entries[at], source, at))
        self._parked.clear()
        self._aside.clear()
