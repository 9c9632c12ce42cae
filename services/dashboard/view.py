"""The dashboard's read model: the log folded into what its pages show.

It folds the core state every reader keeps (nodes, GPUs, jobs, VCs; finished jobs retained, since
the pages show history) plus what only the pages need: each job's timeline (compact entries, the
event itself stays in the log), its rescales and memory leases, placements and decision latencies
of the recent past, and a sampled history of busy GPUs by VC and queue length. Telemetry (GPU
samples, training progress) is kept as short rings per GPU and per job.

Nothing here does I/O or reads a clock: times are the events' own (``state.now``), so the same log
gives the same view. Every method that answers a page returns plain data (what ``/api/`` encodes).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.explain import QueueAnswer, QueueExplainer, SubmissionOrder
from gpuherd.fold import TERMINAL, ClusterState, JobState, apply
from gpuherd.fold.accounting import Accounting
from gpuherd.fold.state import NodeState
from gpuherd.log import Record
from gpuherd.log.relay import PAGED_REPORTS
from gpuherd.metrics import gpu_state

GPU_STATES = ("free", "busy", "unhealthy", "drained", "powered_off", "lost")
HISTORY_BUCKET_S = 60.0  # one history sample per minute of log time
HISTORY_POINTS = 24 * 60  # a day of samples
RECENT_S = 60.0  # "per minute" figures look this far back
LATENCY_SAMPLES = 2_000
CAUSES_KEPT = 20_000  # recent event ids -> time, to measure decision latency
SAMPLES_PER_GPU = 120
PROGRESS_POINTS = 300
PROGRESS_JOBS = 500  # jobs whose progress is kept (the most recently reporting)
# Ended jobs the view remembers, with their timelines: the oldest ended are forgotten first, so the
# dashboard's memory (and each job list it serves) stays bounded however long the cluster runs. Its
# counts of ended jobs and its usage page still cover them all; the log keeps every job.
ENDED_KEPT = 20_000
USAGE_USERS_PLOTTED = 8  # the heaviest users get a line on the usage page (the table lists them all)

# The events a job's timeline shows, and what each says in a word.
_TIMELINE: dict[type[ev.Event], str] = {
    ev.JobSubmitted: "submitted",
    ev.JobRejected: "rejected",
    ev.JobDurationPredicted: "predicted",
    ev.JobPlaced: "placed",
    ev.JobStarted: "started",
    ev.JobPreempted: "preempted",
    ev.JobRequeued: "requeued",
    ev.JobResized: "resized",
    ev.RescaleCompleted: "rescaled",
    ev.RescaleFailed: "rescale failed",
    ev.WorkerLost: "worker lost",
    ev.TaskEnded: "task ended",
    ev.JobCancelRequested: "cancel requested",
    ev.JobTimeLimitReached: "time limit reached",
    ev.JobFinished: "finished",
    ev.MemoryLeaseGranted: "memory lease granted",
    ev.MemoryLeaseRevoked: "memory lease revoked",
    ev.MemoryLeaseReleased: "memory lease released",
    ev.MemoryLeaseDenied: "memory lease denied",
}


def _detail(event: ev.Event) -> str:
    """A line on what the event says beyond its type."""
    match event:
        case ev.JobPlaced():
            nodes = ", ".join(sorted({a.node for a in event.allocations}))
            return f"attempt {event.attempt} on {nodes}" + (f": {event.reason}" if event.reason else "")
        case ev.JobStarted():
            return f"attempt {event.attempt} on {event.node}"
        case ev.JobFinished():
            return f"{event.outcome}" + (f": {event.reason}" if event.reason else "")
        case ev.TaskEnded():
            return f"{event.node}: {event.outcome}" + (f" ({event.reason})" if event.reason else "")
        case ev.JobRequeued() | ev.JobPreempted() | ev.JobRejected() | ev.JobCancelRequested():
            return str(getattr(event, "reason", ""))
        case ev.JobDurationPredicted():
            return f"{event.seconds:,.0f} s ({event.model}: {event.basis})"
        case ev.JobResized():
            return f"generation {event.generation}: {event.kind}"
        case ev.RescaleCompleted():
            return f"{event.world_before} -> {event.world} workers"
        case ev.RescaleFailed() | ev.WorkerLost():
            return str(getattr(event, "reason", ""))
        case ev.JobTimeLimitReached():
            return f"attempt {event.attempt}: {event.limit_s:g} s of run time"
        case _:
            return ""


class TimelineEntry(msgspec.Struct, array_like=True, gc=False):
    seq: int
    at: float
    what: str
    id: str
    source: str
    cause: str
    based_on: int
    detail: str


class GpuSample(msgspec.Struct, array_like=True, gc=False):
    at: float
    utilization: float | None
    memory_used_mb: float | None
    power_w: float | None
    temperature_c: float | None


class DashboardView:
    def __init__(self, queue: QueueExplainer | None = None, *, ended_kept: int = ENDED_KEPT) -> None:
        if ended_kept < 0:
            raise ValueError(f"ended jobs kept must be 0 or more, not {ended_kept}")
        self.state = ClusterState(retain_finished=True)
        self.ended_kept = ended_kept
        self._ended: OrderedDict[str, None] = OrderedDict()  # ended jobs remembered, oldest end first
        self.forgotten = 0  # ended jobs no longer remembered
        self.queue: QueueExplainer = queue if queue is not None else SubmissionOrder(self.state)
        self.timelines: dict[str, list[TimelineEntry]] = {}
        self.rescales: dict[str, list[dict[str, Any]]] = {}
        self.leases: dict[str, dict[str, dict[str, Any]]] = {}  # job -> lease id -> what became of it
        self.placements: dict[str, list[tuple[int, list[str]]]] = {}  # job -> (attempt, nodes) it was placed on
        self.placed_at: deque[float] = deque()  # JobPlaced times in the last RECENT_S
        self.latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # decision - its cause, seconds
        self._cause_at: OrderedDict[str, float] = OrderedDict()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._bucket: float | None = None
        self.gpu_samples: dict[tuple[str, int], deque[GpuSample]] = {}
        self.progress: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self.version = 0  # goes up at every change a page may show
        self.last_audit: dict[str, Any] | None = None
        self._queue_answer: QueueAnswer | None = None  # the explainer's last answer
        # The version pages were at when they were given an answer older than the log (None: the answer
        # is current): pages ask again only at the next change, so a quiet log must make one.
        self._stale_answer_version: int | None = None
        # GPU-hours, ends and queueing per VC and user and hour of log time (the usage page).
        self.usage = Accounting(by=("vc", "user"), per="hour")
        # Workflows: id -> (name, its steps in order: step -> its jobs), from their submissions.
        self.workflows: dict[str, tuple[str, dict[str, list[str]]]] = {}
        # How the jobs forgotten of a workflow still remembered ended, by step: a failed step forgotten
        # still makes its workflow failed.
        self._forgotten_ends: dict[str, dict[str, Counter[str]]] = {}

    # -- folding ---------------------------------------------------------------------------------

    def fold(self, seq: int, event: ev.Event, stored_at: float | None = None) -> None:
        """Fold one record; ``stored_at`` (when the log stored it) times decisions against their
        causes (a log without it, a simulation's, times them by the events' own clock)."""
        state = self.state
        self._sample_history(event.at)
        apply(state, seq, event)
        self.queue.fold(seq, event)
        self.usage.fold(seq, event)
        if isinstance(event, ev.JobSubmitted) and event.spec.workflow_of is not None and event.job in state.jobs:
            member = event.spec.workflow_of
            steps = self.workflows.setdefault(member.workflow, (member.name, {}))[1]
            jobs = steps.setdefault(member.step, [])
            if event.job not in jobs:
                jobs.append(event.job)
        self.version += 1
        stamp = event.at if stored_at is None else stored_at
        if event.id and event.id not in self._cause_at:  # (a report stored twice: its first copy's time)
            self._cause_at[event.id] = stamp
            if len(self._cause_at) > CAUSES_KEPT:
                self._cause_at.popitem(last=False)
        what = _TIMELINE.get(type(event))
        job = getattr(event, "job", None)
        if job is not None and job not in state.jobs:
            return  # (a forgotten job's late event, or a submission refused: no page shows it)
        if what is not None and job is not None:
            timeline = self.timelines.setdefault(job, [])
            detail = _detail(event)
            if type(event) in PAGED_REPORTS and any(e.id == event.id and e.detail == detail for e in timeline):
                return  # a second copy of a report a relay paged (``gpuherd.log.relay``): shown once
            cause = getattr(event, "cause", "")
            entry = TimelineEntry(
                seq, event.at, what, event.id, event.source, cause, getattr(event, "based_on", 0), detail
            )
            timeline.append(entry)
        if isinstance(event, ev.JobPlaced):
            self._placed(event, stamp)
        elif isinstance(event, ev.RescaleCompleted):
            row = {"at": event.at, "generation": event.generation, "node": event.node}
            row |= {"world_before": event.world_before, "world": event.world, "times": event.times}
            self.rescales.setdefault(event.job, []).append(row | event.durations())
        elif isinstance(event, ev.RescaleFailed):
            row = {"at": event.at, "generation": event.generation, "failed": event.reason}
            self.rescales.setdefault(event.job, []).append(row)
        elif isinstance(
            event, ev.MemoryLeaseGranted | ev.MemoryLeaseRevoked | ev.MemoryLeaseReleased | ev.MemoryLeaseReclaimed
        ):
            self._lease(event)
        elif type(event) is ev.JobFinished and event.job not in self._ended:
            if state.jobs[event.job].status not in TERMINAL:
                return  # (an end of an attempt already requeued: the fold left the job waiting)
            self._ended[event.job] = None
            while len(self._ended) > self.ended_kept:
                self._forget(self._ended.popitem(last=False)[0])

    def _forget(self, job_id: str) -> None:
        """An ended job leaves the view, with all that only its pages showed."""
        job = self.state.jobs.pop(job_id, None)
        self.timelines.pop(job_id, None)
        self.rescales.pop(job_id, None)
        self.leases.pop(job_id, None)
        self.placements.pop(job_id, None)
        self.progress.pop(job_id, None)
        if job is not None and (member := job.spec.workflow_of) is not None and member.workflow in self.workflows:
            steps = self.workflows[member.workflow][1]
            jobs = steps.get(member.step, [])
            if job_id in jobs:
                jobs.remove(job_id)
                ends = self._forgotten_ends.setdefault(member.workflow, {})
                ends.setdefault(member.step, Counter())[job.status] += 1
            if not jobs:
                steps.pop(member.step, None)
            if not steps:
                del self.workflows[member.workflow]
                self._forgotten_ends.pop(member.workflow, None)
        self.forgotten += 1

    def fold_all(self, records: Iterable[Record]) -> None:
        for record in records:
            self.fold(record.seq, record.event, record.stored_at)

    def _placed(self, event: ev.JobPlaced, stamp: float) -> None:
        nodes = list(dict.fromkeys(a.node for a in event.allocations))
        self.placements.setdefault(event.job, []).append((event.attempt, nodes))
        self.placed_at.append(event.at)
        self._forget_old(event.at)
        cause_at = self._cause_at.get(event.cause)
        if cause_at is not None:
            self.latencies.append(max(0.0, stamp - cause_at))

    def _forget_old(self, now: float) -> None:
        while self.placed_at and self.placed_at[0] < now - RECENT_S:
            self.placed_at.popleft()

    def _lease(self, event: ev.Event) -> None:
        lease_id = getattr(event, "lease", "")
        job = getattr(event, "job", "")
        leases = self.leases.setdefault(job, {})
        if isinstance(event, ev.MemoryLeaseGranted):
            leases[lease_id] = {"lease": lease_id, "granted_at": event.at, "state": "granted"}
            kept = ("shares", "gpu", "node", "expires_at")
            leases[lease_id] |= {k: v for k, v in msgspec.to_builtins(event).items() if k in kept}
        elif lease_id in leases:
            leases[lease_id]["state"] = type(event).__name__.removeprefix("MemoryLease").lower()
            leases[lease_id]["ended_at"] = event.at

    def _sample_history(self, at: float) -> None:
        """One sample per HISTORY_BUCKET_S of log time: busy GPUs by VC and queue length at its start."""
        bucket = at // HISTORY_BUCKET_S * HISTORY_BUCKET_S
        if self._bucket is not None and bucket <= self._bucket:
            return
        if self._bucket is not None:
            self.history.append({"at": bucket, "queue": len(self.state.queue), "busy": self._busy_by_vc()})
        self._bucket = bucket

    def _busy_by_vc(self) -> dict[str, int]:
        busy: Counter[str] = Counter()
        for job in self.state.active_jobs():
            busy[job.spec.vc] += job.held or len(job.allocations)
        return dict(busy)

    def telemetry(self, subject: str, data: dict[str, Any]) -> None:
        """A telemetry sample: ``<node>.gpus`` (GPU samples) or ``<node>.job.<id>`` (progress)."""
        parts = subject.split(".")
        if len(parts) >= 2 and parts[1] == "gpus":
            node, at = str(data.get("node", parts[0])), float(data.get("at", 0.0))
            for gpu in data.get("gpus", []):
                ring = self.gpu_samples.setdefault((node, int(gpu.get("index", 0))), deque(maxlen=SAMPLES_PER_GPU))
                ring.append(
                    GpuSample(
                        at,
                        gpu.get("utilization_pct"),
                        gpu.get("memory_used_mb"),
                        gpu.get("power_w"),
                        gpu.get("temperature_c"),
                    )
                )
            self.version += 1
        elif len(parts) >= 3 and parts[1] == "job":
            job = str(data.get("job", parts[2]))
            if not self._first_rank_reports(job, data.get("rank")):
                return
            ring = self.progress.pop(job, None) or deque(maxlen=PROGRESS_POINTS)
            ring.append({"at": data.get("at"), "step": data.get("step"), **(data.get("values") or {})})
            self.progress[job] = ring  # most recent last
            while len(self.progress) > PROGRESS_JOBS:
                self.progress.popitem(last=False)
            self.version += 1

    def _first_rank_reports(self, job_id: str, rank: Any) -> bool:
        """Whether a progress report is the job's first rank's, the one its charts follow (every rank
        may report: mixed, the charts zig-zag between ranks and disagree with the final metrics). The
        agents' rule: rank 0, but any rank of an elastic job (its rank 0 is whoever holds it after a
        rescale, whatever its launch rank; it alone reports). A report without a rank: an older agent's."""
        if rank is None or rank == 0:
            return True
        job = self.state.jobs.get(job_id)
        return job is not None and job.spec.elastic is not None

    # -- answers ---------------------------------------------------------------------------------

    def queue_answer(self) -> QueueAnswer:
        """The scheduler's explanation of the queue, asked again only while the last one is not for
        the log's position (the log moved on, or the explainer reused an older answer)."""
        answer = self._queue_answer
        if answer is None or not self._current(answer):
            answer = self._queue_answer = self.queue.explain()
            self._stale_answer_version = None if self._current(answer) else self.version
        return answer

    def _current(self, answer: QueueAnswer) -> bool:
        return answer.seq is None or answer.seq == self.state.seq

    def settle_queue(self) -> bool:
        """Pages were given an answer older than the log and nothing changed since (a quiet log: the
        scheduler is idle or down): ask the explainer again and, once it answers for the log as it
        is, count a change so that open pages fetch it. True if it did. Cheap while nothing is stale
        (an open page's stream calls it every tenth of a second)."""
        if self._stale_answer_version is None:
            return False
        if self._stale_answer_version != self.version:  # the log moved: pages ask again anyway
            self._stale_answer_version = None
            return False
        self.queue_answer()
        if self._stale_answer_version is not None:
            return False
        self.version += 1
        return True

    def overview(self) -> dict[str, Any]:
        state = self.state
        gpus = dict.fromkeys(GPU_STATES, 0)
        for node in state.nodes.values():
            for slot in node.gpus:
                gpus[gpu_state(node, slot)] += 1
        jobs = Counter(j.status for j in state.active_jobs())
        self._forget_old(state.now)
        ordered = sorted(self.latencies)
        return {
            "seq": state.seq,
            "now": state.now,
            "gpus": gpus,
            "jobs": {"running": jobs["running"], "placed": jobs["placed"], "waiting": len(state.queue)}
            | {"ended": dict(state.ended), "forgotten": self.forgotten},
            "placements_per_min": len(self.placed_at) * 60.0 / RECENT_S,
            "decision_latency_s": {"p50": _quantile(ordered, 0.5), "p99": _quantile(ordered, 0.99), "n": len(ordered)},
            "audit": self.last_audit,
            "racks": self.heatmap(),
        }

    def heatmap(self) -> list[dict[str, Any]]:
        """Every GPU, by rack, node and NVLink island: its state and job."""
        racks: dict[str, list[dict[str, Any]]] = {}
        for node in sorted(self.state.nodes.values(), key=lambda n: (n.rack, n.node)):
            islands = node.islands or [[g.info.index for g in node.gpus]]
            slots = {g.info.index: g for g in node.gpus}
            groups = [
                [[i, gpu_state(node, slots[i]), slots[i].job] for i in island if i in slots] for island in islands
            ]
            racks.setdefault(node.rack, []).append({"node": node.node, "status": node.status, "islands": groups})
        return [{"rack": rack, "nodes": nodes} for rack, nodes in racks.items()]

    def queue_view(self) -> dict[str, Any]:
        answer = self.queue_answer()
        state = self.state
        rows = []
        for w in answer.waiting:
            job = state.jobs.get(w.job)
            if job is None or job.status != "pending":  # (placed since an answer older than the log)
                continue
            row = msgspec.to_builtins(w)
            spec = job.spec
            row |= {"name": spec.name, "user": spec.user, "vc": spec.vc, "gpus": job.gpus}
            row["waiting_s"] = max(0.0, state.now - job.waiting_since)
            rows.append(row)
        return {"policy": answer.policy, "now": state.now, "waiting": rows}

    def job_row(self, job: JobState, estimates: dict[str, float | None] | None = None) -> dict[str, Any]:
        """A job as ``gpuherd jobs --json`` gives it (with its estimated start while it waits)."""
        row = msgspec.to_builtins(job)
        if job.status == "pending":
            row["estimated_start"] = (self._estimates() if estimates is None else estimates).get(job.job)
        return row

    def _estimates(self) -> dict[str, float | None]:
        return {w.job: w.estimated_start for w in self.queue_answer().waiting}

    def jobs(
        self,
        *,
        status: str | None = None,
        user: str | None = None,
        vc: str | None = None,
        name: str | None = None,
        sort: str = "-order",
        limit: int = 200,
        offset: int = 0,
    ) -> tuple[int, list[dict[str, Any]]]:
        """Jobs matching the filters (``name``: a part of it), sorted; the count of all matches and a page."""
        found: list[JobState] = [
            j
            for j in self.state.jobs.values()
            if (status is None or j.status == status)
            and (user is None or j.spec.user == user)
            and (vc is None or j.spec.vc == vc)
            and (name is None or name.lower() in j.spec.name.lower())
        ]
        key = sort.removeprefix("-")
        if key not in _SORTS:
            raise ValueError(f"cannot sort jobs by {key!r}; by one of {', '.join(_SORTS)}")
        found.sort(key=_SORTS[key], reverse=sort.startswith("-"))
        page = found[offset : offset + limit]
        estimates = self._estimates() if any(j.status == "pending" for j in page) else {}
        return len(found), [self.job_row(j, estimates) for j in page]

    def job(self, job_id: str) -> dict[str, Any] | None:
        job = self.state.jobs.get(job_id)
        if job is None:
            return None
        row = self.job_row(job)
        waiting = None
        if job.status == "pending":
            waiting = next((w for w in self.queue_answer().waiting if w.job == job_id), None)
        if waiting is not None:
            row["why"] = waiting.why
            row["position"] = waiting.position
        else:
            row["why"] = _where_it_is(job) or job.status
        row["timeline"] = [msgspec.structs.asdict(e) for e in self.timelines.get(job_id, [])]
        row["rescales"] = self.rescales.get(job_id, [])
        row["leases"] = list(self.leases.get(job_id, {}).values())
        row["progress"] = list(self.progress.get(job_id, ()))
        return row

    def nodes(self) -> list[dict[str, Any]]:
        out = []
        for node in sorted(self.state.nodes.values(), key=lambda n: n.node):
            row = msgspec.to_builtins(node)
            for gpu, slot in zip(row["gpus"], node.gpus, strict=True):
                gpu["state"] = gpu_state(node, slot)
                samples = self.gpu_samples.get((node.node, slot.info.index))
                gpu["samples"] = [msgspec.structs.astuple(s) for s in samples] if samples else []
            out.append(row)
        return out

    def node(self, name: str) -> NodeState | None:
        return self.state.nodes.get(name)

    def vcs(self) -> list[dict[str, Any]]:
        state = self.state
        fair = self.queue_answer().fair_share
        in_use: Counter[str] = Counter()
        for job in state.active_jobs():
            in_use[job.spec.vc] += job.held or len(job.allocations)
        waiting = Counter(state.jobs[j].spec.vc for j in state.queue)
        waiting_gpus: Counter[str] = Counter()
        for j in state.queue:
            waiting_gpus[state.jobs[j].spec.vc] += state.jobs[j].gpus
        names = sorted(set(state.vcs) | set(in_use) | set(waiting))
        return [
            {
                "vc": vc,
                "gpu_quota": state.vcs[vc].gpu_quota if vc in state.vcs else None,
                "can_borrow": state.vcs[vc].can_borrow if vc in state.vcs else True,
                "weight": state.vcs[vc].weight if vc in state.vcs else 1.0,
                "in_use": in_use[vc],
                "borrowed": state.vcs[vc].borrowing(in_use[vc]) if vc in state.vcs else 0,
                "waiting_jobs": waiting[vc],
                "waiting_gpus": waiting_gpus[vc],
                "fair_share_gpu_s": fair.get(vc, 0.0),
            }
            for vc in names
        ]

    def history_view(self) -> dict[str, Any]:
        """The samples so far, and the state now as the last point."""
        points = [*self.history, {"at": self.state.now, "queue": len(self.state.queue), "busy": self._busy_by_vc()}]
        vcs = sorted({vc for p in points for vc in p["busy"]})
        return {
            "bucket_s": HISTORY_BUCKET_S,
            "at": [p["at"] for p in points],
            "queue": [p["queue"] for p in points],
            "busy": {vc: [p["busy"].get(vc, 0) for p in points] for vc in vcs},
        }

    # -- usage and workflows --------------------------------------------------------------------

    def usage_view(self) -> dict[str, Any]:
        """GPU-hours per hour of log time by VC and by user (the plots), and each VC's and user's
        totals: GPU-hours, jobs by how they ended, average queueing (``gpuherd usage``'s figures)."""
        report = self.usage.report()
        hours = sorted({row["period_start"] for row in report["rows"]})
        at = {start: i for i, start in enumerate(hours)}
        by_vc: dict[str, list[float]] = {}
        by_user: dict[str, list[float]] = {}
        totals: dict[tuple[str, str], dict[str, Any]] = {}
        for row in report["rows"]:
            i = at[row["period_start"]]
            by_vc.setdefault(row["vc"], [0.0] * len(hours))[i] += row["gpu_hours"]
            by_user.setdefault(row["user"], [0.0] * len(hours))[i] += row["gpu_hours"]
            total = totals.setdefault(
                (row["vc"], row["user"]), {"gpu_hours": 0.0, "jobs": {}, "started": 0, "queued_s": 0.0}
            )
            total["gpu_hours"] += row["gpu_hours"]
            for outcome, n in row["jobs"].items():
                total["jobs"][outcome] = total["jobs"].get(outcome, 0) + n
            total["started"] += row["started"]
            total["queued_s"] += (row["avg_queue_s"] or 0.0) * row["started"]
        top_users = sorted(by_user, key=lambda u: -sum(by_user[u]))[:USAGE_USERS_PLOTTED]
        rows = [
            {
                "vc": vc,
                "user": user,
                "gpu_hours": t["gpu_hours"],
                "jobs": t["jobs"],
                "avg_queue_s": t["queued_s"] / t["started"] if t["started"] else None,
            }
            for (vc, user), t in sorted(totals.items(), key=lambda item: -item[1]["gpu_hours"])
        ]
        return {
            "per": "hour",
            "at": hours,
            "by_vc": by_vc,
            "by_user": {user: by_user[user] for user in top_users},
            "users": len(by_user),
            "rows": rows,
            "total": report["total"],
            "running": report["running"],
            "log_end": report["log_end"],
        }

    def workflow_list(self) -> list[dict[str, Any]]:
        """Every workflow, newest first: its steps and how many of its jobs are in each state."""
        out = []
        for workflow, (name, steps) in reversed(self.workflows.items()):
            jobs = [self.state.jobs[j] for ids in steps.values() for j in ids if j in self.state.jobs]
            if not jobs:
                continue
            states = Counter(j.status for j in jobs)
            for ends in self._forgotten_ends.get(workflow, {}).values():
                states += ends
            out.append(
                {
                    "workflow": workflow,
                    "name": name,
                    "user": jobs[0].spec.user,
                    "submitted": min(j.submitted_at for j in jobs),
                    "steps": len(steps),
                    "jobs": sum(states.values()),
                    "states": dict(states),
                    "status": _overall(states),
                }
            )
        return out

    def workflow(self, workflow: str) -> dict[str, Any] | None:
        """A workflow as a graph: each step with its jobs and their states, and what it depends on
        (``{kind, step}``: a step of the workflow, or ``{kind, job}`` outside it)."""
        found = self.workflows.get(workflow)
        if found is None:
            return None
        name, steps = found
        step_of = {job: step for step, jobs in steps.items() for job in jobs}
        step_of |= {f"{workflow}-{step}": step for step in steps}  # (an array step's id is its array's)
        out = []
        for step, ids in steps.items():
            jobs = [self.state.jobs[j] for j in ids if j in self.state.jobs]
            if not jobs:
                continue
            depends: list[dict[str, str]] = []
            deps = jobs[0].spec.depends_on
            for kind, names in deps.kinds() if deps is not None else ():
                for dep in names:
                    depends.append(
                        {"kind": kind, "step": step_of[dep]} if dep in step_of else {"kind": kind, "job": dep}
                    )
            states = Counter(j.status for j in jobs) + self._forgotten_ends.get(workflow, {}).get(step, Counter())
            out.append(
                {
                    "step": step,
                    "status": _overall(states),
                    "states": dict(states),
                    "jobs": [{"job": j.job, "status": j.status} for j in jobs],
                    "depends": depends,
                    "gpus": jobs[0].spec.gpus,
                    "time_limit_s": jobs[0].spec.time_limit_s,
                }
            )
        return {"workflow": workflow, "name": name, "steps": out}


def _where_it_is(job: JobState) -> str:
    """Why a job is where it is now ("" if nothing says): an ended job's end, a placed or running
    one's placement, a waiting one's return to the queue. (``job.reason`` keeps the last requeue's
    reason once the job is placed again: a running job's page gave an attempt that had ended.)"""
    if job.status in TERMINAL or job.status == "pending":
        return job.reason
    return job.placement_reason


def _overall(states: Counter[str]) -> str:
    """One word for a group of jobs: the worst end once all ended, else how far it got."""
    if all(s in TERMINAL for s in states):
        for bad in ("failed", "timeout", "cancelled"):
            if states.get(bad):
                return bad
        return "completed"
    for state in ("running", "placed"):
        if states.get(state):
            return state
    return "pending"


_SORTS: dict[str, Any] = {
    "order": lambda j: j.order,
    "submitted": lambda j: j.submitted_at,
    "gpus": lambda j: j.gpus,
    "status": lambda j: j.status,
    "user": lambda j: j.spec.user,
    "name": lambda j: j.spec.name,
    "vc": lambda j: j.spec.vc,
}


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
