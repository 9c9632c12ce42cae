"""Any gpuherd event log -> the normalized job table (``traces.COLUMNS``), and the numbers
people ask of it: JCT and queueing per VC, utilization over time.

Per job: submitted at its ``JobSubmitted``, started at its first ``JobStarted``, ended at its
``JobFinished``. Run time is the GPU-time it held divided by its GPUs, summed over attempts (an
attempt runs from its first ``JobStarted`` to the ``JobRequeued``/``JobFinished`` ending it; as in
the core fold, a report of any other attempt than the one in force is stale and changes nothing);
queueing is JCT - run time (all the time it was not running, so a preempted job's second wait
counts). Jobs still open at the end of the log have no end and count as ``running``/``pending``;
a running job's run time and GPU-seconds count up to the log's end (its newest event's time), as
``gpuherd usage`` counts them.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from services.analytics.predict import CALENDAR_TIME_FROM_S, UNKNOWN
from services.analytics.traces import COLUMNS, Trace


@dataclass(slots=True)
class _Job:
    """One job's row while the table is folded: what the table shows of its spec, not the spec (a
    simulation of a long trace keeps a row per job to its end, and a spec is most of a row)."""

    job: str
    submit: float
    gpus: int
    nodes: int | None
    user: str | None
    vc: str
    name: str | None
    elastic: bool
    start: float | None = None
    end: float | None = None
    run_s: float = 0.0
    attempt_start: float | None = None
    state: str = "pending"
    preemptions: int = 0
    attempts: int = 0
    predicted_s: float | None = None
    size: int = 0  # GPUs held now (set at each placement and rescale)
    size_since: float | None = None  # running at ``size`` since
    gpu_s: float = 0.0  # GPU-seconds held while running, at each size held
    rescales: int = 0
    paused_gpu_s: float = 0.0  # GPU-seconds held while a rescale stood the job still
    # The attempt in force: the placed one, the next after a requeue, none once the job ended. A
    # node's late report of an attempt already requeued (or of a job ended) must not restart it.
    attempt: int = 0

    @classmethod
    def submitted(cls, event: ev.JobSubmitted) -> _Job:
        spec = event.spec
        return cls(
            job=event.job, submit=event.at, gpus=spec.gpus, nodes=spec.nodes, user=_known(spec.user), vc=spec.vc,
            name=_known(spec.name), elastic=spec.elastic is not None,
        )  # fmt: skip


def _known(value: str) -> str | None:
    """A user or job name, or None where there is none: the simulator submits a trace's missing ones
    as ``UNKNOWN`` (intake needs both), which is no user (a report would count it as one)."""
    return value if value and value != UNKNOWN else None


def _on_calendar_time(jobs: pd.DataFrame) -> bool:
    """Whether a table's times are dates (a live cluster's log, a simulation of a dated trace) rather
    than offsets from a trace's start, by its earliest submission."""
    return bool(len(jobs)) and float(jobs["submit_time"].min()) > CALENDAR_TIME_FROM_S


def _close_attempt(job: _Job, at: float) -> None:
    if job.attempt_start is not None:
        job.run_s += max(0.0, at - job.attempt_start)
        job.attempt_start = None
    _charge(job, at)
    job.size_since = None


def _charge(job: _Job, at: float) -> None:
    """Count the GPU-seconds held at the current size up to ``at``."""
    if job.size_since is not None:
        job.gpu_s += job.size * max(0.0, at - job.size_since)
        job.size_since = at


_NO_ATTEMPT = -1  # an ended job's: no report matches it

# The event types ``JobTable.add`` reads (it only notes the time of the others), by exact type, as
# the core fold's handlers read them: the codec decodes exact types, and no event type subclasses another.
_READ = frozenset(
    {
        ev.JobSubmitted,
        ev.JobRejected,
        ev.JobPlaced,
        ev.JobStarted,
        ev.RescaleCompleted,
        ev.JobPreempted,
        ev.JobRequeued,
        ev.JobFinished,
        ev.JobDurationPredicted,
    }
)


class JobTable:
    """The job table folded one event at a time, so a simulation can build it as it runs and keep
    no log (``job_table`` folds a whole log at once)."""

    def __init__(self) -> None:
        self.jobs: dict[str, _Job] = {}
        self.rejected = 0
        self.rejected_for: collections.Counter[str] = collections.Counter()  # intake's reason -> how many
        self.rows_read = 0
        self.log_end: float | None = None  # the newest event's time, of any event added

    def add_records(self, records: Iterable[Record]) -> None:
        """``add`` each record's event, in order (a simulation's sink: one call per run of records)."""
        add = self.add
        for record in records:
            add(record.event)

    def add(self, event: ev.Event) -> None:
        if self.log_end is None or event.at > self.log_end:
            self.log_end = event.at
        kind = type(event)  # (this runs for every event of a simulation)
        if kind not in _READ:
            return  # (most events of a simulation: task ends, ticks; none of the branches below reads them)
        if kind is ev.JobSubmitted:
            self.rows_read += 1
            if event.job not in self.jobs:  # type: ignore[attr-defined]
                self.jobs[event.job] = _Job.submitted(event)  # type: ignore[attr-defined,arg-type]
            return
        if kind is ev.JobRejected:
            self.rows_read += 1
            self.rejected += 1
            self.rejected_for[event.reason] += 1  # type: ignore[attr-defined]
            return
        job = self.jobs.get(event.job)  # type: ignore[attr-defined]
        if job is None:
            return
        # (An int compare per event carrying an attempt: this runs for every event of a simulation.)
        if kind is ev.JobPlaced:
            if job.end is None:  # (a job that ended is never placed again: the core fold ignores it)
                job.attempt = event.attempt
                job.size = sum(len(a.gpus) for a in event.allocations)
        elif kind is ev.JobStarted:
            if event.attempt == job.attempt and job.attempt_start is None and job.state != "running":
                job.attempt_start = event.at
                job.size_since = event.at
                job.attempts += 1
                job.state = "running"
                if job.start is None:
                    job.start = event.at
        elif kind is ev.RescaleCompleted:
            if event.attempt != job.attempt:
                return
            times = event.times
            _charge(job, event.at)
            job.size = event.world
            job.rescales += 1
            still = max(0.0, times.get("first_step", event.at) - times.get("quiesced", event.at))
            job.paused_gpu_s += still * max(event.world, event.world_before)
        elif kind is ev.JobPreempted:
            if event.attempt == job.attempt:
                job.preemptions += 1
        elif kind is ev.JobRequeued:
            if event.attempt == job.attempt:
                _close_attempt(job, event.at)
                job.state = "pending"
                job.attempt = event.attempt + 1
        elif kind is ev.JobFinished:
            if event.attempt == job.attempt:  # (the scheduler decides it for the attempt in force)
                _close_attempt(job, event.at)
                job.end = event.at
                job.state = event.outcome
                job.attempt = _NO_ATTEMPT
        elif kind is ev.JobDurationPredicted and job.start is None:
            job.predicted_s = event.seconds  # (the one in force when it first started)

    def trace(self, name: str = "log") -> Trace:
        """The table of every job added so far (plus columns ``jct``, ``run``, ``preemptions``,
        ``attempts``, ``predicted``: the duration predicted when it first started, or the latest if
        it never did; ``elastic``, ``gpu_seconds`` held, ``rescales`` and ``paused_gpu_s``).
        A job still running has run, and held its GPUs, up to ``log_end``. Rejected submissions
        count as not used."""
        # Built column by column: a dict per row costs more than the table itself (a long trace's
        # simulation peaked here).
        jobs = list(self.jobs.values())
        jct = [None if job.end is None else job.end - job.submit for job in jobs]
        # (Counted here, not folded in: a table asked for again later counts on to its new end.)
        log_end = self.log_end if self.log_end is not None else 0.0
        run_s = [
            job.run_s if job.attempt_start is None else job.run_s + max(0.0, log_end - job.attempt_start)
            for job in jobs
        ]
        gpu_s = [
            job.gpu_s if job.size_since is None else job.gpu_s + job.size * max(0.0, log_end - job.size_since)
            for job in jobs
        ]
        columns = {
            "job_id": [job.job for job in jobs],
            "submit_time": [job.submit for job in jobs],
            "start_time": [job.start for job in jobs],
            "end_time": [job.end for job in jobs],
            "duration": run_s,
            "queue": [None if t is None else t - run for t, run in zip(jct, run_s, strict=True)],
            "gpus": [job.gpus for job in jobs],
            "gpu_request": [float(job.gpus) for job in jobs],
            "cpus": [None] * len(jobs),
            "nodes": [job.nodes for job in jobs],
            "user": [job.user for job in jobs],
            "vc": [job.vc for job in jobs],
            "name": [job.name for job in jobs],
            "state": [job.state for job in jobs],
            "jct": jct,
            "preemptions": [job.preemptions for job in jobs],
            "attempts": [job.attempts for job in jobs],
            "predicted": [job.predicted_s for job in jobs],
            "elastic": [job.elastic for job in jobs],
            "gpu_seconds": gpu_s,
            "rescales": [job.rescales for job in jobs],
            "paused_gpu_s": [job.paused_gpu_s for job in jobs],
        }
        del jobs, jct, run_s, gpu_s
        df = pd.DataFrame(columns, columns=list(TABLE_COLUMNS))
        del columns
        df = df.astype(TABLE_COLUMNS).sort_values(["submit_time", "job_id"], kind="stable").reset_index(drop=True)
        reasons = {"rejected at intake": self.rejected} if self.rejected else {}
        return Trace(
            name=name,
            jobs=df,
            rows_read=self.rows_read,
            rejected=reasons,
            absolute_time=_on_calendar_time(df),
            log_end=self.log_end,
            intake_rejections=dict(self.rejected_for.most_common()),
        )


TABLE_COLUMNS = {
    **COLUMNS,
    "jct": "float64",
    "preemptions": "int64",
    "attempts": "int64",
    "predicted": "float64",
    "elastic": "bool",
    "gpu_seconds": "float64",  # GPU-seconds held while running (an elastic job's at each size)
    "rescales": "int64",
    "paused_gpu_s": "float64",  # GPU-seconds held while rescales stood the job still
}


def job_table(records: Iterable[Record] | Iterable[ev.Event], *, name: str = "log") -> Trace:
    """Fold a log's job events into the normalized table (see ``JobTable``)."""
    table = JobTable()
    for item in records:
        table.add(item.event if isinstance(item, Record) else item)
    return table.trace(name)


def merge_tables(tables: Sequence[Trace], *, name: str) -> Trace:
    """One table of several runs' (a partitioned simulation's VCs), in submission order."""
    df = pd.concat([t.jobs for t in tables], ignore_index=True) if tables else JobTable().trace().jobs
    df = df.sort_values(["submit_time", "job_id"], kind="stable").reset_index(drop=True)
    rejected = sum(t.rejected.get("rejected at intake", 0) for t in tables)
    reasons = {"rejected at intake": rejected} if rejected else {}
    ends = [t.log_end for t in tables if t.log_end is not None]
    rejected_for = sum((collections.Counter(t.intake_rejections) for t in tables), collections.Counter())
    return Trace(
        name=name,
        jobs=df,
        rows_read=sum(t.rows_read for t in tables),
        rejected=reasons,
        absolute_time=_on_calendar_time(df),
        log_end=max(ends) if ends else None,
        intake_rejections=dict(rejected_for.most_common()),
    )


# -- summaries ---------------------------------------------------------------------------------------


def _stats(group: pd.DataFrame) -> dict[str, float]:
    done = group[group["jct"].notna()]
    jct = done["jct"].to_numpy()
    queue = done["queue"].to_numpy()

    def pct(values: np.ndarray, q: float) -> float:
        return float(np.percentile(values, q)) if len(values) else float("nan")

    return {
        "jobs": len(group),
        "finished": len(done),
        "avg_jct_s": float(jct.mean()) if len(jct) else float("nan"),
        "median_jct_s": pct(jct, 50),
        "p95_jct_s": pct(jct, 95),
        "avg_queue_s": float(queue.mean()) if len(queue) else float("nan"),
        "median_queue_s": pct(queue, 50),
        "p95_queue_s": pct(queue, 95),
        "preemptions": int(group["preemptions"].sum()) if "preemptions" in group else 0,
    }


def summarize(jobs: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Overall (key ``all``) and per-VC JCT and queueing: mean, median, p95."""
    out = {"all": _stats(jobs)}
    for vc, group in jobs.groupby("vc", sort=True):
        out[str(vc)] = _stats(group)
    return out


def gpu_time(jobs: pd.DataFrame) -> pd.Series:
    """Each job's GPU-seconds: what it held (``gpu_seconds`` of a table folded from a log: an
    elastic job at each size it ran at), or its GPUs x run time where the table does not say (a
    trace's, or a job whose placement the log lacks)."""
    asked = jobs["gpus"] * jobs["duration"]
    if "gpu_seconds" not in jobs:
        return asked
    return jobs["gpu_seconds"].where(jobs["gpu_seconds"] > 0, asked)


NO_VC = "default"  # the VC of a job a trace gives none (as ``traces.submissions`` submits it)

# A utilization frame holds at most this many buckets (columns of 8 bytes each, one per VC): a
# run's span over a tiny bucket, or a run of 1e15 s over an hour, asked numpy for terabytes.
MAX_BUCKETS = 1_000_000


class BucketsError(GpuherdError):
    """A utilization asked over more buckets than ``MAX_BUCKETS``: the bucket is too short for the run."""


def check_buckets(span_s: float, bucket_s: float) -> None:
    """A BucketsError unless ``span_s`` seconds split into ``bucket_s`` buckets are ``MAX_BUCKETS`` at most."""
    if not math.isfinite(span_s) or span_s / bucket_s > MAX_BUCKETS:
        raise BucketsError(
            f"a utilization over {span_s:,.0f} s in buckets of {bucket_s:g} s would hold more than "
            f"{MAX_BUCKETS:,} buckets; give a bucket of at least {math.ceil(span_s / MAX_BUCKETS):,} s"
        )


def utilization(
    jobs: pd.DataFrame,
    capacity: dict[str, int] | int,
    *,
    bucket_s: float = 3600.0,
    log_end: float | None = None,
) -> pd.DataFrame:
    """GPUs busy per time bucket, overall and per VC, as a share of capacity (capacity per VC,
    or one number for the whole cluster). Busy time is start..end of each job at its GPUs; a table
    folded from a log (``gpu_seconds``: what the job held, at each size, over its attempts) spreads
    those over start..end instead, so an elastic job counts what it held and a preempted one not
    its waits. A job that started and has not ended ends at ``log_end`` (the table's, when folded
    from a log) or else after its run time. Each bucket is a share of the time it covers: the last
    one ends with the data, not a whole bucket later. Columns: time, covered_s (the seconds of the
    run the bucket covers), <vc>... and ``all``."""
    done = jobs[jobs["start_time"].notna()]
    if done.empty:
        return pd.DataFrame(columns=["time", "covered_s", "all"])
    t0 = float(done["start_time"].min())
    end = done["end_time"].fillna(done["start_time"] + done["duration"] if log_end is None else log_end)
    t1 = float(end.max())
    check_buckets(t1 - t0, bucket_s)
    edges = np.arange(t0, t1 + bucket_s, bucket_s)
    # The seconds of [t0, t1] each bucket covers: dividing the last, partial one by a whole bucket
    # read a job busy to its end as mostly idle there. (A bucket that float rounding put wholly
    # past t1 holds nothing; any width keeps it at 0.)
    seconds = np.minimum(edges[1:], t1) - edges[:-1]
    covered = np.where(seconds > 0, seconds, bucket_s)
    out = pd.DataFrame({"time": edges[:-1], "covered_s": np.maximum(seconds, 0.0)})
    total = np.zeros(len(edges) - 1)
    gpus = done["gpus"].astype("float64")
    if "gpu_seconds" in done:  # a simulated or logged table: the GPU-seconds held, spread over start..end
        span = end - done["start_time"]
        held = done["gpu_seconds"] / span.where(span > 0)
        gpus = held.where(held.notna() & (done["gpu_seconds"] > 0), gpus)
    # A job without a VC is submitted to "default" (``traces.submissions``): its GPUs count there, and
    # in ``all`` (grouped by its NaN VC, it was left out of both).
    for vc, group in done.groupby(done["vc"].fillna(NO_VC), sort=True):
        busy = _busy_gpu_seconds(
            group["start_time"].to_numpy(), end[group.index].to_numpy(), gpus[group.index].to_numpy(), edges
        )
        total += busy
        if isinstance(capacity, dict) and capacity.get(str(vc)):
            out[str(vc)] = busy / (capacity[str(vc)] * covered)
    cluster = sum(capacity.values()) if isinstance(capacity, dict) else capacity
    out["all"] = total / (max(cluster, 1) * covered)
    return out


def mean_utilization(util: pd.DataFrame, column: str = "all") -> float | None:
    """The share of capacity busy over the whole run, of a ``utilization`` frame: each bucket
    weighted by the time it covers (a short last bucket counts for what it covers, not a whole
    bucket); None where no job ran."""
    if not len(util) or not util["covered_s"].sum() > 0:
        return None
    return float(np.average(util[column], weights=util["covered_s"]))


def _busy_gpu_seconds(starts: np.ndarray, ends: np.ndarray, gpus: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """GPU-seconds of [start, end) intervals falling in each bucket between ``edges``."""
    busy = np.zeros(len(edges) - 1)
    lo = edges[:-1]
    hi = edges[1:]
    first = np.clip(np.searchsorted(edges, starts, side="right") - 1, 0, len(lo) - 1)
    last = np.clip(np.searchsorted(edges, ends, side="left") - 1, 0, len(lo) - 1)
    for s, e, g, a, b in zip(starts, ends, gpus, first, last, strict=True):
        span = slice(a, b + 1)
        busy[span] += g * np.clip(np.minimum(hi[span], e) - np.maximum(lo[span], s), 0, None)
    return busy


def json_safe(value: Any) -> Any:
    """``value`` (a summary, or figures holding summaries) with NaN and infinities as None: JSON has
    no NaN, and a summary of no finished job has them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def summary_rows(summary: dict[str, dict[str, float]], keys: Sequence[str] = ("all",)) -> list[list[str]]:
    rows = []
    for key in keys:
        s = summary.get(key)
        if s is None:
            continue
        rows.append(
            [
                key,
                f"{s['jobs']:,}",
                f"{s['avg_jct_s']:,.0f}",
                f"{s['median_jct_s']:,.0f}",
                f"{s['p95_jct_s']:,.0f}",
                f"{s['avg_queue_s']:,.0f}",
                f"{s['median_queue_s']:,.0f}",
                f"{s['p95_queue_s']:,.0f}",
            ]
        )
    return rows


SUMMARY_HEADER = ["", "jobs", "avg JCT s", "median JCT s", "p95 JCT s", "avg queue s", "median queue s", "p95 queue s"]
