"""The analytics job table (``services.analytics.jobs``) against stale reports, simulated logs
without users or calendar times, and the partial last bucket of utilization."""

from __future__ import annotations

import pandas as pd
import pytest

from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.fold.core import fold
from gpuherd.fold.state import ClusterState
from services.analytics.jobs import JobTable, job_table, mean_utilization, merge_tables, utilization
from services.analytics.traces import COLUMNS, Trace, submissions
from tests.helpers import node

GANG = (ev.Allocation(node="n1", gpus=(0,)), ev.Allocation(node="n2", gpus=(0,)))


def _two_node_job_requeued_then_a_late_start() -> list[ev.Event]:
    """A 2-node job (1 GPU per node) runs 0-100 and is requeued at 100; node n2's report that it
    started attempt 0 arrives at 101, after the requeue; attempt 1 runs 500-600."""
    spec = ev.JobSpec(name="train", user="ann", gpus=2, nodes=2, duration_s=200.0)
    return [
        node("n1", 1),
        node("n2", 1),
        ev.JobSubmitted(job="j", at=0.0, spec=spec, intake_source="t"),
        ev.JobPlaced(job="j", at=0.0, attempt=0, allocations=GANG),
        ev.JobStarted(job="j", at=0.0, attempt=0, node="n1"),
        ev.JobRequeued(job="j", at=100.0, attempt=0, reason="node lost"),
        ev.JobStarted(job="j", at=101.0, attempt=0, node="n2"),  # late: attempt 0 already ended
        ev.JobPlaced(job="j", at=500.0, attempt=1, allocations=GANG),
        ev.JobStarted(job="j", at=500.0, attempt=1, node="n1"),
        ev.JobStarted(job="j", at=500.0, attempt=1, node="n2"),
        ev.JobFinished(job="j", at=600.0, attempt=1, outcome="completed"),
    ]


def _row(log: list[ev.Event], job: str) -> pd.Series:
    return job_table(log).jobs.set_index("job_id").loc[job]


def test_a_report_of_an_attempt_already_requeued_does_not_count_as_running() -> None:
    # (The table took n2's late JobStarted for a new attempt: duration 599, queue 1, gpu_seconds
    # 1,198, where the job ran 2 x 100 s on 2 GPUs.)
    log = _two_node_job_requeued_then_a_late_start()
    row = _row(log, "j")
    assert (row["start_time"], row["end_time"], row["jct"]) == (0.0, 600.0, 600.0)
    assert (row["duration"], row["queue"], row["gpu_seconds"]) == (200.0, 400.0, 400.0)
    assert (row["attempts"], row["state"]) == (2, "completed")
    state = ClusterState(retain_finished=True)
    fold(enumerate(log, 1), state)
    assert state.jobs["j"].service_gpu_s == row["gpu_seconds"]  # what the core fold counts


def test_reports_of_an_ended_attempt_or_an_ended_job_change_nothing() -> None:
    log = _two_node_job_requeued_then_a_late_start()
    preempted = ev.JobPreempted(job="j", at=90.0, attempt=0, reason="srtf")
    stale = [
        ev.JobPreempted(job="j", at=102.0, attempt=0, reason="srtf"),
        ev.JobRequeued(job="j", at=103.0, attempt=0, reason="preempted"),
    ]
    after_the_end = [
        ev.JobStarted(job="j", at=601.0, attempt=1, node="n2"),
        ev.JobFinished(job="j", at=602.0, attempt=1, outcome="failed"),  # (the first word stands)
    ]
    row = _row([*log[:5], preempted, *log[5:7], *stale, *log[7:], *after_the_end], "j")
    assert (row["end_time"], row["duration"], row["gpu_seconds"]) == (600.0, 200.0, 400.0)
    assert (row["attempts"], row["preemptions"], row["state"]) == (2, 1, "completed")


def test_a_stale_rescale_report_does_not_change_the_size_held() -> None:
    spec = ev.JobSpec(name="e", user="ann", gpus=1, elastic=ev.Elastic(min=1, max=4))
    one = (ev.Allocation(node="n1", gpus=(0,)),)
    log: list[ev.Event] = [
        ev.JobSubmitted(job="e", at=0.0, spec=spec, intake_source="t"),
        ev.JobPlaced(job="e", at=0.0, attempt=0, allocations=one),
        ev.JobStarted(job="e", at=0.0, attempt=0, node="n1"),
        ev.JobRequeued(job="e", at=100.0, attempt=0, reason="preempted"),
        ev.JobPlaced(job="e", at=200.0, attempt=1, allocations=one),
        ev.JobStarted(job="e", at=200.0, attempt=1, node="n1"),
        # attempt 0's rescale to 4, reported after it was requeued: attempt 1 still holds 1 GPU
        ev.RescaleCompleted(job="e", at=250.0, attempt=0, generation=1, node="n1", world=4, world_before=1),
        ev.JobFinished(job="e", at=300.0, attempt=1, outcome="completed"),
    ]
    row = _row(log, "e")
    assert (row["duration"], row["gpu_seconds"], row["rescales"]) == (200.0, 200.0, 0)


def _relative_time_trace(jobs: int) -> Trace:
    """A trace like ITP's: times from its own start, no user, no job name."""
    df = pd.DataFrame(
        {
            "job_id": [f"t{i}" for i in range(jobs)],
            "submit_time": [60.0 * i for i in range(jobs)],
            "duration": [600.0] * jobs,
            "gpus": [1] * jobs,
            "gpu_request": [1.0] * jobs,
            "vc": ["a"] * jobs,
        }
    )
    return Trace(name="itp-toy", jobs=df.reindex(columns=list(COLUMNS)).astype(COLUMNS), rows_read=jobs)


SMALL = ClusterSpec(vcs={"a": VcSpec(nodes=1)}, gpus_per_node=4)


def test_a_simulation_of_a_trace_without_users_or_names_invents_none() -> None:
    # (The simulator submits a missing user or name as "-": a report counted one user, "-",
    # holding all of the GPU time.)
    table = simulate(submissions(_relative_time_trace(6)), SMALL, "fifo").table
    assert len(table.jobs) == 6 and (table.jobs["state"] == "completed").all()
    assert table.jobs["user"].isna().all() and table.jobs["name"].isna().all()


def test_a_simulation_of_a_relative_time_trace_is_not_on_calendar_time() -> None:
    # (Every table said it was on calendar time: a report drew the weekdays of January 1970 and
    # ``gpuherd export`` wrote 1970 timestamps.)
    table = simulate(submissions(_relative_time_trace(6)), SMALL, "fifo").table
    assert len(table.jobs) == 6 and not table.absolute_time


def test_a_log_on_calendar_time_is_absolute_and_keeps_its_users() -> None:
    t0 = 1.7e9
    spec = ev.JobSpec(name="", user="ann", gpus=1)
    table = job_table([ev.JobSubmitted(job="j", at=t0, spec=spec, intake_source="t")])
    assert table.absolute_time
    assert table.jobs.loc[0, "user"] == "ann" and pd.isna(table.jobs.loc[0, "name"])


def test_the_partial_last_bucket_counts_the_time_it_covers() -> None:
    # (An 8-GPU job of 3601 s on 8 GPUs read as 50% busy: buckets [1.0, 0.000278], the last
    # second divided by a whole hour.)
    jobs = pd.DataFrame(
        {
            "start_time": [0.0],
            "end_time": [3601.0],
            "duration": [3601.0],
            "gpus": [8],
            "vc": ["a"],
            "gpu_seconds": [8 * 3601.0],
        }
    )
    busy = utilization(jobs, {"a": 8}, bucket_s=3600.0)
    assert list(busy["time"]) == [0.0, 3600.0]
    assert list(busy["all"]) == pytest.approx([1.0, 1.0])
    assert list(busy["a"]) == pytest.approx([1.0, 1.0])
    half = utilization(jobs.assign(end_time=[5400.0], duration=[5400.0], gpu_seconds=[8 * 5400.0]), 16)
    assert list(half["all"]) == pytest.approx([0.5, 0.5])  # (the last bucket: 1,800 s of 3,600)


def test_the_mean_utilization_of_a_run_weighs_each_bucket_by_the_time_it_covers() -> None:
    """``gpuherd sim``'s utilization column was the plain mean of the buckets: a last bucket of 360 s
    counted as much as a whole hour. 8 GPUs busy for an hour, then 4 for 360 s: 95.5% busy, not 75%."""
    jobs = pd.DataFrame(
        {
            "start_time": [0.0, 0.0],
            "end_time": [3600.0, 3960.0],
            "duration": [3600.0, 3960.0],
            "gpus": [4, 4],
            "vc": ["a", "a"],
            "gpu_seconds": [4 * 3600.0, 4 * 3960.0],
        }
    )
    busy = utilization(jobs, {"a": 8}, bucket_s=3600.0)
    assert list(busy["all"]) == pytest.approx([1.0, 0.5])
    assert list(busy["covered_s"]) == pytest.approx([3600.0, 360.0])
    assert mean_utilization(busy) == pytest.approx((3600 * 1.0 + 360 * 0.5) / 3960)
    assert mean_utilization(busy, "a") == pytest.approx((3600 * 1.0 + 360 * 0.5) / 3960)
    assert mean_utilization(utilization(jobs.iloc[:0], {"a": 8})) is None, "no job ran"


def test_the_table_keeps_intake_s_reasons_for_what_it_rejected_and_a_merge_adds_them_up() -> None:
    """``gpuherd sim`` says why intake rejected jobs: the table folded as a simulation runs keeps
    each reason's count (a simulation keeps no log to read them from), and so does the table of a
    partitioned run, merged from its VCs'."""

    def rejected(seq: int, reason: str) -> ev.JobRejected:
        return ev.JobRejected(at=float(seq), intake_source="t", intake_seq=seq, reason=reason)

    first = JobTable()
    for event in [rejected(1, "too big"), rejected(2, "no such VC"), rejected(3, "too big")]:
        first.add(event)
    second = JobTable()
    second.add(rejected(4, "no such VC"))
    second.add(rejected(5, "no such VC"))
    assert first.trace().intake_rejections == {"too big": 2, "no such VC": 1}
    merged = merge_tables([first.trace(), second.trace()], name="both")
    assert merged.intake_rejections == {"no such VC": 3, "too big": 2}
    assert list(merged.intake_rejections) == ["no such VC", "too big"], "most first"
    assert merged.rejected == {"rejected at intake": 5}
