"""Analytics: trace loaders, the duration model, CES, and trace simulation with the live deciders."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from apps.registry import make_decider
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.engine import Simulation, SimulationError, Timer
from apps.sim.run import as_submissions, make_deciders, simulate
from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import InProcessLog
from gpuherd.log.files import read_log_file, write_log_file
from gpuherd.runtime.audit import audit
from services.analytics.ces import CesParams, DemandHistory, evaluate_sequence, forecast_peak, plan_power
from services.analytics.jobs import TABLE_COLUMNS, job_table, summarize, utilization
from services.analytics.predict import DurationModel, Features, evaluate
from services.analytics.report import write_report
from services.analytics.service import reporter
from services.analytics.traces import (
    FRACTIONAL_GPUS,
    TraceError,
    load_alibaba_openb,
    load_helios,
    load_itp,
    load_philly_csv,
    load_philly_json,
    load_trace,
    submissions,
    to_helios_csv,
    vc_peak_demand,
)
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import make_policy
from services.scheduler.schedule import plan

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"

HELIOS_CSV = """job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue
1,u1,vcA,8,48,1,COMPLETED,2020-04-01 00:00:00,2020-04-01 00:00:10,2020-04-01 01:00:10,3600,10
2,u2,vcA,1,6,1,FAILED,2020-04-01 00:05:00,2020-04-01 00:05:00,2020-04-01 00:06:40,100,0
3,u1,vcB,0,4,1,COMPLETED,2020-04-01 00:06:00,2020-04-01 00:06:00,2020-04-01 00:07:00,60,0
4,u3,vcB,2,12,1,CANCELLED,2020-04-01 00:07:00,2020-04-01 00:08:00,2020-04-01 00:07:30,-30,60
5,u3,vcB,2,12,1,TIMEOUT,not-a-time,2020-04-01 00:08:00,2020-04-01 00:09:00,60,0
"""

PHILLY_JSON = [
    {
        "status": "Pass",
        "vc": "6214e9",
        "jobid": "application_1506638472019_10238",
        "user": "ab12",
        "submitted_time": "2017-10-03 02:18:55",
        "attempts": [
            {
                "start_time": "2017-10-03 02:19:00",
                "end_time": "2017-10-03 03:19:00",
                "detail": [{"ip": "m1", "gpus": ["gpu0", "gpu1"]}, {"ip": "m2", "gpus": ["gpu0", "gpu1"]}],
            }
        ],
    },
    {
        "status": "Killed",
        "vc": "11cb48",
        "jobid": "application_1506638472019_10239",
        "user": "cd34",
        "submitted_time": "2017-10-03 02:20:00",
        "attempts": [],
    },
]


# -- loaders ----------------------------------------------------------------------------------------


def test_helios_csv_loads_and_counts_unusable_rows(tmp_path: Path) -> None:
    path = tmp_path / "cluster_log.csv"
    path.write_text(HELIOS_CSV)
    trace = load_helios(path)
    assert list(trace.jobs["job_id"]) == ["1", "2"]
    assert trace.rejected == {"zero GPUs": 1, "negative duration": 1, "bad or missing submit time": 1}
    first = trace.jobs.iloc[0]
    assert (first["gpus"], first["user"], first["vc"], first["state"], first["queue"]) == (
        8,
        "u1",
        "vcA",
        "completed",
        10,
    )
    assert first["submit_time"] == pd.Timestamp("2020-04-01", tz="UTC").timestamp()
    assert trace.jobs.iloc[1]["state"] == "failed"
    assert trace.describe().startswith("cluster_log: 2 of 5 rows used; not used: ")
    assert load_trace(path).name == trace.name  # recognized by its columns


def test_philly_json_takes_runs_from_attempts(tmp_path: Path) -> None:
    path = tmp_path / "cluster_job_log"
    path.with_suffix(".json").write_text(json.dumps(PHILLY_JSON))
    trace = load_philly_json(path.with_suffix(".json"))
    assert len(trace.jobs) == 1
    assert trace.rejected == {"bad or missing duration": 1}  # never ran: no attempts
    job = trace.jobs.iloc[0]
    assert (job["gpus"], job["nodes"], job["duration"], job["queue"], job["state"]) == (4, 2, 3600, 5, "completed")


def test_helios_export_round_trips(tmp_path: Path) -> None:
    source = tmp_path / "in.csv"
    source.write_text(HELIOS_CSV)
    trace = load_helios(source)
    out = tmp_path / "out.csv"
    assert to_helios_csv(trace.jobs, out) == 2
    again = load_helios(out)
    cols = ["job_id", "user", "vc", "gpus", "duration", "queue", "state", "submit_time", "start_time"]
    pd.testing.assert_frame_equal(again.jobs[cols], trace.jobs[cols])
    assert out.read_text().splitlines()[0].split(",") == [
        "job_id", "user", "vc", "gpu_num", "cpu_num", "node_num", "state",
        "submit_time", "start_time", "end_time", "duration", "queue",
    ]  # fmt: skip


def test_alibaba_pods_keep_fractional_requests(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    path.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
        "p0,1000,10,1,460,,LS,Running,0,100,10\n"
        "p1,1000,10,2,1000,,BE,Succeeded,5,50,5\n"
        "p2,1000,10,0,0,,LS,Running,5,50,5\n"
        "p3,1000,10,1,1000,,LS,Pending,5,50,\n"
    )
    trace = load_alibaba_openb(path)
    assert list(trace.jobs["gpu_request"]) == [0.46, 2.0]
    assert list(trace.jobs["gpus"]) == [1, 2]
    assert list(trace.jobs["state"]) == ["running", "completed"]
    assert trace.rejected == {"never scheduled (no run time)": 1, "zero GPUs": 1}
    assert trace.rows_read == 4


def test_unknown_files_get_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="match no known job trace"):
        load_trace(path)
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "missing.csv")


def test_a_malformed_row_gets_a_clear_error_not_a_parser_traceback(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-03 02:18:55,100,1,100,vc1\n"
        "2017-10-03 02:18:56,100,1,100,vc1,extra\n"
    )
    with pytest.raises(TraceError, match="line 3"):
        load_trace(path)


def test_rows_with_an_infinite_gpu_count_are_counted_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-03 02:18:55,100,1,100,vc1\n"
        "2017-10-03 02:18:56,100,inf,100,vc1\n"
    )
    trace = load_philly_csv(path)
    assert list(trace.jobs["gpus"]) == [1]
    assert sum(trace.rejected.values()) == 1


def test_a_fractional_gpu_count_is_rounded_up_to_whole_gpus_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "cluster09.csv"
    path.write_text("job_id,submission_time,duration,num_gpu\na,0,100,0.5\nb,10,100,1.5\nc,20,100,2\n")
    trace = load_itp(path)  # (0.5 was truncated to a job of no GPUs, 1.5 to 1: silently)
    assert list(trace.jobs["gpus"]) == [1, 2, 2]
    assert list(trace.jobs["gpu_request"]) == [0.5, 1.5, 2.0]  # (what the trace asked for, unchanged)
    assert [job.spec.gpus for job in submissions(trace)] == [1, 2, 2]
    assert trace.changed == {FRACTIONAL_GPUS: 2} and not trace.rejected
    assert (
        trace.describe() == "itp-cluster09: 3 of 3 rows used; changed: 2 fractional GPU count, rounded up to whole GPUs"
    )


def test_jobs_without_a_vc_count_towards_the_default_vc_they_are_submitted_to(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-03 02:18:55,100,1,100,\n"
        "2017-10-03 02:18:56,100,2,200,\n"
        "2017-10-03 02:18:57,100,4,400,vc1\n"
    )
    trace = load_philly_csv(path)
    assert {job.spec.vc for job in submissions(trace)} == {"default", "vc1"}
    assert vc_peak_demand(trace) == {"default": 3, "vc1": 4}


@pytest.mark.skipif(not TRACES.is_dir(), reason="shared traces not present")
def test_shared_traces_load() -> None:
    philly = load_philly_csv(TRACES / "philly" / "philly.csv")
    assert len(philly.jobs) == 82_247 and not philly.rejected
    assert (philly.jobs["gpus"] == 1).mean() == pytest.approx(0.93, abs=0.01)  # the README's fact
    itp = load_trace(TRACES / "itp" / "cluster01.csv")
    assert itp.rows_read == len(itp.jobs) + sum(itp.rejected.values())
    pods = load_trace(TRACES / "alibaba-openb" / "openb_pod_list_default.csv")
    assert pods.rows_read == 8152 and sum(pods.rejected.values()) == 8152 - len(pods.jobs)


# -- duration model -------------------------------------------------------------------------------------


def test_duration_model_backs_off_to_what_it_has_seen() -> None:
    model = DurationModel(min_samples=2, learner="ladder")
    assert model.predict(Features(vc="a", gpus=1)).basis.startswith("default")
    for n, seconds in enumerate((100, 200, 400)):
        model.observe(f"j{n}", Features(vc="a", gpus=1, user="u", name="resnet"), seconds)
    exact = model.predict(Features(vc="a", gpus=1, user="u", name="resnet"))
    assert exact.seconds == pytest.approx(200, rel=1e-6) and exact.basis.startswith("user+name")
    assert model.predict(Features(vc="a", gpus=1)).basis.startswith("vc+gpus")
    assert model.predict(Features(vc="zz", gpus=1)).basis.startswith("gpus")
    assert model.predict(Features(vc="zz", gpus=64)).basis.startswith("all")


def test_evaluation_never_learns_from_the_future() -> None:
    # Job b is submitted while a still runs: b's prediction must not know a's duration.
    jobs = pd.DataFrame(
        {
            "job_id": ["a", "a2", "a3", "b", "c"],
            "submit_time": [0.0, 1.0, 2.0, 10.0, 1000.0],
            "duration": [500.0, 500.0, 500.0, 50.0, 50.0],
            "gpus": [1, 1, 1, 1, 1],
            "vc": ["v"] * 5,
            "end_time": [np.nan] * 5,
            "queue": [np.nan] * 5,
            "user": [pd.NA] * 5,
            "name": [pd.NA] * 5,
        }
    )
    _, predicted = evaluate(jobs, DurationModel(default_s=7.0))
    assert predicted[3] == 7.0  # nothing had finished at t=10
    assert predicted[4] == pytest.approx(500.0)  # a, a2, a3 finished by t=1000


# -- CES ---------------------------------------------------------------------------------------------------


def test_forecast_and_power_plan() -> None:
    params = CesParams(buffer_nodes=4, min_interval_s=100.0, sample_s=1.0)
    history = DemandHistory()
    for t, nodes in enumerate([5, 9, 7, 6]):
        history.record(float(t), nodes, params)
    assert forecast_peak(history, 3.0, params) == 9
    assert plan_power(30, 30, 9, now=1000.0, last_down_at=0.0, params=params).down == 30 - 13
    assert plan_power(30, 30, 9, now=50.0, last_down_at=0.0, params=params).down == 0  # too soon after the last
    assert plan_power(10, 30, 9, now=50.0, last_down_at=0.0, params=params).up == 3  # forecast above powered
    assert plan_power(12, 30, 9, now=50.0, last_down_at=0.0, params=params).up == 0  # within the band


def test_ces_evaluation_on_a_synthetic_sequence() -> None:
    minutes = np.arange(3 * 24 * 60)
    active = (50 + 30 * (np.sin(minutes / 1440 * 2 * np.pi) > 0)).astype(int)  # a day-night step
    seq = pd.DataFrame({"t": minutes * 60.0, "active": active, "total": 100})
    report = evaluate_sequence(seq, CesParams(buffer_nodes=5))
    assert report.mean_nodes_off > 10
    assert report.utilization_after > report.utilization_before
    assert report.waits > 0 and report.mean_wait_s <= CesParams().boot_s + 600  # steps up wait for a boot


def test_ces_utilization_after_counts_only_served_demand_never_over_100_percent() -> None:
    # An idle start powers 18 of 20 nodes down; then every node is wanted for 7 minutes, while the
    # next decision is 10 minutes away. Demand without a booted node waits: it is counted as waiting,
    # not as utilization (counted so, this read 700%).
    active = np.where(np.arange(10) < 3, 0, 20)
    seq = pd.DataFrame({"t": np.arange(10) * 60.0, "active": active, "total": 20})
    report = evaluate_sequence(seq, CesParams(buffer_nodes=2, boot_s=600, min_interval_s=0))
    assert report.mean_nodes_off == 18
    assert report.wait_node_minutes == 7 * 18
    assert report.utilization_after == pytest.approx(7 * 2 / (10 * 2))  # its 2 powered nodes, busy 7 of 10 min


# -- simulation -----------------------------------------------------------------------------------------------


def _toy_trace(tmp_path: Path, rows: list[tuple[int, float, int, str]]) -> object:
    path = tmp_path / "philly.csv"
    lines = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for t, duration, gpus, vc in rows:
        stamp = pd.Timestamp("2017-10-01", tz="UTC") + pd.Timedelta(seconds=t)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S},{duration},{gpus},{duration * gpus},{vc}")
    path.write_text("\n".join(lines) + "\n")
    return load_philly_csv(path)


def _contended(tmp_path: Path) -> object:
    # One long job arrives first, then many short ones, on one 4-GPU node: order matters.
    rows = [(0, 5000.0, 4, "a"), *((10 + i, 100.0 * (1 + i % 3), 1 + i % 2, "a") for i in range(12))]
    return _toy_trace(tmp_path, rows)


SMALL = ClusterSpec(vcs={"a": VcSpec(nodes=1)}, gpus_per_node=4)


def test_the_job_table_of_a_log_row_by_row() -> None:
    """Each column of a job's row, from the events of a small log: a job preempted once, an elastic
    one still running, one still waiting, and a rejected submission."""

    def submitted(job: str, at: float, **spec: object) -> ev.JobSubmitted:
        return ev.JobSubmitted(job=job, at=at, spec=ev.JobSpec(**{"name": "", "user": "", **spec}), intake_source="t")

    def placed(job: str, at: float, attempt: int, gpus: int) -> ev.JobPlaced:
        allocation = ev.Allocation(node="n1", gpus=tuple(range(gpus)))
        return ev.JobPlaced(job=job, at=at, attempt=attempt, allocations=(allocation,))

    log = [
        submitted("a", 10.0, name="resnet", user="ann", gpus=2, vc="vc1", nodes=1),
        submitted("b", 11.0, gpus=4, elastic=ev.Elastic(min=2, max=4)),
        submitted("c", 12.0, gpus=1),
        ev.JobRejected(at=12.5, intake_source="t", intake_seq=4, reason="too large"),
        ev.JobDurationPredicted(job="a", at=13.0, seconds=100.0, model="m"),
        placed("a", 20.0, 1, 2),
        ev.JobStarted(job="a", at=20.0, attempt=1, node="n1"),
        ev.JobPreempted(job="a", at=50.0, attempt=1, reason="srtf"),
        ev.JobRequeued(job="a", at=60.0, attempt=1, reason="preempted"),
        ev.JobDurationPredicted(job="a", at=61.0, seconds=999.0, model="m"),  # (started once: not this one)
        placed("b", 70.0, 1, 4),
        ev.JobStarted(job="b", at=70.0, attempt=1, node="n1"),
        placed("a", 80.0, 2, 2),
        ev.JobStarted(job="a", at=80.0, attempt=2, node="n1"),
        ev.JobFinished(job="a", at=130.0, attempt=2, outcome="completed"),
    ]
    table = job_table(log)
    jobs = table.jobs.set_index("job_id")
    assert dict(table.jobs.dtypes.astype(str)) == TABLE_COLUMNS
    assert (table.rows_read, table.rejected) == (4, {"rejected at intake": 1})
    assert list(table.jobs["job_id"]) == ["a", "b", "c"]  # in submission order
    a, b, c = jobs.loc["a"], jobs.loc["b"], jobs.loc["c"]
    assert (a["start_time"], a["end_time"], a["jct"]) == (20.0, 130.0, 120.0)
    assert (a["duration"], a["queue"], a["gpu_seconds"]) == (90.0, 30.0, 180.0)  # 40 s, then 50 s, on 2 GPUs
    assert (a["preemptions"], a["attempts"], a["predicted"], a["state"]) == (1, 2, 100.0, "completed")
    assert (a["gpus"], a["gpu_request"], a["nodes"]) == (2, 2.0, 1.0)
    assert (a["user"], a["name"], a["vc"]) == ("ann", "resnet", "vc1")
    assert not a["elastic"] and b["elastic"] and not c["elastic"]
    assert b["state"] == "running" and b["start_time"] == 70.0 and pd.isna(b["end_time"]) and pd.isna(b["jct"])
    assert pd.isna(b["user"]) and pd.isna(b["name"]) and pd.isna(b["nodes"]) and b["vc"] == "default"
    assert c["state"] == "pending" and pd.isna(c["start_time"]) and c["attempts"] == 0 and pd.isna(c["cpus"])


def test_simulation_finishes_every_job_and_is_deterministic(tmp_path: Path) -> None:
    trace = _contended(tmp_path)
    first = simulate(submissions(trace), SMALL, "fifo")
    second = simulate(submissions(trace), SMALL, "fifo")
    assert [r.event for r in first.records] == [r.event for r in second.records]
    table = job_table(first.records).jobs
    assert len(table) == 13 and (table["state"] == "completed").all()
    np.testing.assert_allclose(sorted(table["duration"]), sorted(trace.jobs["duration"]))


def test_shortest_first_beats_fifo_and_the_log_audits_clean(tmp_path: Path) -> None:
    trace = _contended(tmp_path)
    jct = {}
    for policy in ("fifo", "sjf", "srtf", "qssf"):
        result = simulate(submissions(trace), SMALL, policy)
        jct[policy] = summarize(job_table(result.records).jobs)["all"]["avg_jct_s"]
        report = audit(result.records, SchedulerDecider(make_policy(policy)))
        assert report.ok, report.mismatches[:3]
        assert report.decisions_checked > 0
        assert violations(result.records) == []
    assert jct["sjf"] < jct["fifo"]
    assert jct["srtf"] <= jct["sjf"]


def test_qssf_places_by_predictions_it_learned(tmp_path: Path) -> None:
    # Early jobs teach the model that 1-GPU jobs in VC a are short, 2-GPU ones long.
    rows = [(i * 10, 50.0 if i % 2 else 2000.0, 1 if i % 2 else 2, "a") for i in range(8)]
    rows += [(5000, 3000.0, 4, "a"), *((5001 + i, 60.0 if i % 2 else 2500.0, 1 if i % 2 else 2, "a") for i in range(6))]
    trace = _toy_trace(tmp_path, rows)
    result = simulate(submissions(trace), SMALL, "qssf")
    predicted = {e.job: e for e in (r.event for r in result.records) if isinstance(e, ev.JobDurationPredicted)}
    assert len(predicted) == len(trace.jobs)
    late_short = [j for j in predicted.values() if j.basis.startswith("vc+gpus") and j.seconds < 100]
    assert late_short, "the model never predicted a short job"
    assert summarize(job_table(result.records).jobs)["all"]["finished"] == len(trace.jobs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tick_s", [0.0, -5.0])
def test_a_clock_tick_that_is_not_positive_is_refused_rather_than_never_ending(tmp_path: Path, tick_s: float) -> None:
    trace = _contended(tmp_path)
    with pytest.raises(SimulationError, match="tick"):
        simulate(submissions(trace), SMALL, "fifo", tick_s=tick_s)


def test_jobs_larger_than_their_vc_are_rejected_with_a_reason(tmp_path: Path) -> None:
    trace = _toy_trace(tmp_path, [(0, 10.0, 8, "a"), (1, 10.0, 1, "a"), (2, 10.0, 1, "b")])
    result = simulate(submissions(trace), SMALL, "fifo")
    reasons = sorted(r.event.reason for r in result.records if isinstance(r.event, ev.JobRejected))
    assert reasons == [
        "asks for 8 GPUs but VC a has a quota of 4 and may not borrow, so it could never start; ask for fewer GPUs "
        "or use another VC",
        "unknown virtual cluster 'b'; known: a, default",
    ]
    assert result.rejected == 2


def test_energy_saving_powers_idle_nodes_down_and_demand_powers_them_up(tmp_path: Path) -> None:
    # A burst, a long quiet gap, then another burst that needs every node.
    rows = [(i, 600.0, 4, "a") for i in range(4)] + [(50_000 + i, 600.0, 4, "a") for i in range(4)]
    trace = _toy_trace(tmp_path, rows)
    spec = ClusterSpec(vcs={"a": VcSpec(nodes=4)}, gpus_per_node=4)
    ces = {"buffer_nodes": 0, "min_interval_s": 600.0, "lookback_s": 1200.0}
    result = simulate(submissions(trace), spec, "fifo", ces=ces, tick_s=300.0, boot_s=120.0)
    events = [r.event for r in result.records]
    downs = [e for e in events if isinstance(e, ev.NodePowerDownRequested)]
    offs = [e for e in events if isinstance(e, ev.NodePoweredDown)]
    ups = [e for e in events if isinstance(e, ev.NodePowerUpRequested | ev.NodeWakeRequested)]
    assert downs and offs and ups
    assert any(isinstance(e, ev.NodeWakeRequested) and e.source == "scheduler" for e in ups)  # the burst woke them
    table = job_table(result.records).jobs
    assert (table["state"] == "completed").all()
    late = table[table["submit_time"] >= table["submit_time"].min() + 50_000]
    assert late["queue"].max() >= 120.0  # some waited for a node to boot
    power = {}  # node -> on/draining/off/booting, as the log says at each point
    moves = {
        ev.NodePowerDownRequested: {"on": "draining"},
        ev.NodePowerUpRequested: {"draining": "on", "off": "booting"},
        ev.NodeWakeRequested: {"draining": "on", "off": "booting"},
        ev.NodePoweredDown: {"draining": "off"},
        ev.NodePoweredUp: {"booting": "on", "draining": "on"},
    }
    placed_on = 0
    for e in events:
        if type(e) in moves:
            power[e.node] = moves[type(e)].get(power.get(e.node, "on"), power.get(e.node, "on"))
        elif isinstance(e, ev.JobPlaced):
            placed_on += len(e.allocations)
            assert all(power.get(a.node, "on") == "on" for a in e.allocations), (e, power)
    assert placed_on == len(trace.jobs)
    assert audit(result.records, SchedulerDecider(make_policy("fifo"))).ok
    assert violations(result.records) == []  # also: never placed on a node that was not on


class _CheckedScheduler(SchedulerDecider):
    """Every pass the decider makes (views and island index kept between passes, jobs of full
    VCs skipped, early stop) also made from scratch with every reason: the decisions must match."""

    passes = 0

    def _schedule(self, state, skip):
        fresh = plan(state, self.policy_for(state), backfill=state.scheduling.backfill, skip=skip)
        decided = super()._schedule(state, skip)
        assert [d for d in decided if isinstance(d, ev.JobPlaced | ev.JobPreempted)] == [
            *fresh.preempted,
            *fresh.placed,
        ]
        self.passes += 1
        return decided


@pytest.mark.parametrize("policy", ["fifo", "srtf", "qssf"])
def test_the_decider_s_kept_views_decide_what_a_fresh_pass_decides(tmp_path: Path, policy: str) -> None:
    rng = np.random.default_rng(11)
    rows = []
    for i in range(400):
        vc = str(rng.choice(["a", "b", "c"], p=[0.5, 0.3, 0.2]))
        gpus = int(rng.choice([1, 1, 2, 4, 8, 16], p=[0.4, 0.1, 0.2, 0.15, 0.1, 0.05]))
        rows.append((int(i * rng.exponential(40.0)), float(rng.lognormal(6.0, 1.5)), gpus, vc))
    trace = _toy_trace(tmp_path, rows)
    spec = ClusterSpec(vcs={"a": VcSpec(nodes=3), "b": VcSpec(nodes=2), "c": VcSpec(nodes=2)}, island=4)
    scheduler = _CheckedScheduler(make_policy(policy))
    deciders, _ = make_deciders(policy, ces={"buffer_nodes": 1, "min_interval_s": 900.0, "lookback_s": 1800.0})
    timers = [Timer("scheduler", ev.ClockTicked, 300.0), Timer("analytics", ev.AnalyticsTicked, 300.0)]
    sim = Simulation([scheduler, deciders[1]], timers=timers, boot_s=120.0)
    sim.setup([*spec.setup_events(), ev.PolicyConfigured(policy=policy)], at=trace.origin)
    sim.run(as_submissions(submissions(trace, start=trace.origin)))
    assert scheduler.passes > 300
    events = [r.event for r in sim.records]
    assert any(isinstance(e, ev.NodePoweredDown) for e in events)
    assert any(isinstance(e, ev.JobPreempted) for e in events) or policy != "srtf"
    assert violations(sim.records) == []


def test_simulated_logs_replay_from_a_file(tmp_path: Path) -> None:
    trace = _contended(tmp_path)
    result = simulate(submissions(trace), SMALL, "sjf")
    path = tmp_path / "events.jsonl"
    assert write_log_file(result.records, path) == len(result.records)
    again = read_log_file(path)
    assert [r.event for r in again] == [r.event for r in result.records]
    assert audit(again, SchedulerDecider(make_policy("sjf"))).ok


def test_replay_of_a_log_file_prints_its_jobs_by_status_as_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed a Python dict (``{'events': ..., 'by_status': {...}}``), not a table."""
    from apps.cli import build_parser

    result = simulate(submissions(_contended(tmp_path)), SMALL, "fifo")
    path = tmp_path / "events.jsonl"
    write_log_file(result.records, path)
    args = build_parser().parse_args(["replay", "--log", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "{" not in out and f"{len(result.records):,} events" in out
    ended = sum(1 for r in result.records if isinstance(r.event, ev.JobFinished))
    assert re.search(rf"completed\s+\S\s+{ended:,}\s", out), out
    assert re.search(rf"all\s+\S\s+{ended:,}\s", out), out
    args = build_parser().parse_args(["replay", "--audit", "--log", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("audited "), "piped, the finished progress bar left an empty line first"


@pytest.mark.parametrize("command", ["usage", "history"])
def test_usage_and_history_name_a_damaged_line_of_a_log_file(tmp_path: Path, command: str) -> None:
    from apps.cli import build_parser
    from gpuherd.errors import GpuherdError

    result = simulate(submissions(_contended(tmp_path)), SMALL, "fifo")
    path = tmp_path / "events.jsonl"
    write_log_file(result.records, path)
    with path.open("a") as f:
        f.write('{"type":"JobPlaced", broken\n')  # (a line cut short, as by a full disk)
    args = build_parser().parse_args([command, "--log", str(path)])
    with pytest.raises(GpuherdError, match=f"events.jsonl:{len(result.records) + 1}: "):
        args.func(args)


def test_history_refuses_a_negative_limit(tmp_path: Path) -> None:
    from apps.cli import build_parser
    from gpuherd.errors import GpuherdError

    path = tmp_path / "events.jsonl"
    write_log_file(simulate(submissions(_contended(tmp_path)), SMALL, "fifo").records, path)
    args = build_parser().parse_args(["history", "--log", str(path), "--limit", "-2"])  # (all but the oldest 2)
    with pytest.raises(GpuherdError, match="--limit"):
        args.func(args)


def test_cluster_spec_from_peaks_and_file(tmp_path: Path) -> None:
    trace = _toy_trace(tmp_path, [(0, 100.0, 4, "a"), (10, 100.0, 4, "a"), (0, 10.0, 1, "b")])
    assert vc_peak_demand(trace) == {"a": 8, "b": 1}
    spec = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=0.5, gpus_per_node=4)
    assert spec.vc_gpus("a") == 4 and spec.vc_gpus("b") == 4
    path = tmp_path / "cluster.yaml"
    path.write_text("gpus_per_node: 8\nvcs:\n  a: {nodes: 2}\n  b: {nodes: 1, gpus_per_node: 4}\n")
    loaded = ClusterSpec.from_file(path)
    assert (loaded.total_gpus, loaded.total_nodes) == (20, 3)


def test_report_for_a_trace_and_a_simulated_log(tmp_path: Path) -> None:
    path = tmp_path / "cluster_log.csv"
    path.write_text(HELIOS_CSV)
    page = write_report(load_helios(path), tmp_path / "trace-report")
    text = page.read_text()
    assert "Final status" in text and "Per-user concentration" in text
    assert (tmp_path / "trace-report" / "cdfs.png").stat().st_size > 1000
    result = simulate(submissions(_contended(tmp_path)), SMALL, "fifo")
    page = write_report(job_table(result.records), tmp_path / "log-report")
    assert "queueing" in page.read_text() and (tmp_path / "log-report" / "vc_usage.png").exists()


def test_the_elastic_service_and_the_memory_broker_run_in_simulation_too() -> None:
    def job(name: str, at: float, gpus: int, **more: object) -> ev.JobSubmitted:
        spec = ev.JobSpec(name=name, user="ana", gpus=gpus, duration_s=600.0, vc="a", **more)  # type: ignore[arg-type]
        return ev.JobSubmitted(job=name, spec=spec, at=at, intake_source="t")

    jobs = [
        job("elastic", 0.0, 2, elastic=ev.Elastic(min=1, max=6)),
        job("borrower", 50.0, 1, memory=ev.MemoryNeeds(extra_mb=8000, min_mb=1000)),
        job("rigid", 400.0, 3),
    ]
    spec = ClusterSpec(vcs={"a": VcSpec(nodes=2)}, gpus_per_node=4)
    result = simulate(jobs, spec, "fifo", elastic=True, memory=True, tick_s=60.0)
    kinds = Counter(type(r.event).__name__ for r in result.records)
    assert kinds["JobResized"] >= 2 and kinds["RescaleCompleted"] == kinds["JobResized"], kinds  # grew, shrank
    assert kinds["MemoryLeaseRequested"] == 1 and kinds["MemoryLeaseGranted"] >= 1, kinds
    assert kinds["MemoryLeaseReclaimed"] == 1, "the lease ends with its borrower"
    assert (job_table(result.records).jobs["state"] == "completed").all()
    for decider in ("scheduler", "elastic", "memory"):
        report = audit(result.records, make_decider(decider))
        assert report.ok and report.decisions_checked, (decider, report.mismatches[:3])
    assert violations(result.records) == []


def test_a_submission_is_forecast_even_when_decided_after_its_placement_but_not_after_its_end() -> None:
    # A live runner decides on everything it has folded: JobPlaced (or JobFinished) may be in already.
    analytics = make_decider("analytics")
    spec = ev.JobSpec(name="j", user="u", gpus=1, duration_s=10)
    gpus = tuple(ev.GpuInfo(index=i, uuid=f"g{i}", model="sim", memory_mb=1000) for i in range(2))
    submitted = ev.JobSubmitted(id="s1", at=1.0, job="j1", spec=spec, intake_source="test")
    placed = ev.JobPlaced(id="p1", at=1.0, job="j1", attempt=0, allocations=(ev.Allocation(node="n1", gpus=(0,)),))
    finished = ev.JobFinished(id="f1", at=20.0, job="j1", attempt=0, outcome="completed")
    state = analytics.initial_state()
    for seq, event in enumerate((ev.NodeRegistered(id="r", node="n1", gpus=gpus), submitted, placed), 1):
        state = analytics.evolve(state, seq, event)
    (forecast,) = analytics.decide(state, submitted)
    assert isinstance(forecast, ev.JobDurationPredicted) and forecast.job == "j1"
    state = analytics.evolve(state, 4, finished)
    assert analytics.decide(state, submitted) == []


async def _report_until_written(log: InProcessLog, out_dir: Path, written: Path) -> None:
    """Run the live reporter (``--report-dir``) on ``log`` until it has written ``written``."""
    task = asyncio.create_task(reporter(out_dir, 60.0)(SimpleNamespace(log=log)))  # type: ignore[arg-type]
    try:
        for _ in range(1200):  # (the report is drawn in a thread first)
            if written.exists() or task.done():
                break
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_live_report_s_summary_is_json_while_no_job_has_finished(tmp_path: Path) -> None:
    """``gpuherd serve analytics --report-dir`` (``gpuherd up``) writes summary.json: JSON has no NaN,
    and a summary of no finished job has them (as ``gpuherd sim``'s, they are null)."""
    log = InProcessLog()
    spec = ev.JobSpec(name="j", user="u", gpus=1, duration_s=10)
    await log.append([ev.JobSubmitted(id="s1", at=1.7e9, job="j1", spec=spec, intake_source="test")])
    summary = tmp_path / "summary.json"
    await _report_until_written(log, tmp_path, summary)

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    figures = json.loads(summary.read_text(), parse_constant=strict)
    assert figures["all"]["jobs"] == 1 and figures["all"]["finished"] == 0 and figures["all"]["avg_jct_s"] is None


def _running_jobs(t0: float) -> list[ev.Event]:
    """An elastic job on 1 GPU grown to 4 after an hour, a rigid one on 1 GPU from then, both still
    running when the log ends two hours in (its newest event: a third job's submission)."""
    from tests.helpers import node, submit

    def started(job: str, at: float, gpus: int) -> list[ev.Event]:
        allocation = ev.Allocation(node="n1", gpus=tuple(range(gpus)))
        return [
            ev.JobPlaced(job=job, at=at, attempt=1, allocations=(allocation,)),
            ev.JobStarted(job=job, at=at, attempt=1, node="n1"),
        ]

    elastic = ev.JobSpec(name="e", user="u", gpus=1, elastic=ev.Elastic(min=1, max=4))
    return [
        node("n1", 8, at=t0),
        ev.JobSubmitted(job="e", at=t0, spec=elastic, intake_source="test"),
        *started("e", t0, 1),
        submit("r", 1, at=t0 + 3600),
        *started("r", t0 + 3600, 1),
        ev.RescaleCompleted(job="e", at=t0 + 3600, attempt=1, generation=1, node="n1", world=4, world_before=1),
        submit("w", 1, at=t0 + 7200),
    ]


def test_running_jobs_count_what_they_held_up_to_the_log_s_end() -> None:
    # (A running job counted as ending where it started, so as nothing.)
    table = job_table(_running_jobs(0.0))
    jobs = table.jobs.set_index("job_id")
    assert table.log_end == 7200.0
    assert (jobs.loc["e", "duration"], jobs.loc["e", "gpu_seconds"]) == (7200.0, 1 * 3600.0 + 4 * 3600.0)
    assert (jobs.loc["r", "duration"], jobs.loc["r", "gpu_seconds"]) == (3600.0, 3600.0)
    assert jobs.loc["e", "state"] == "running" and pd.isna(jobs.loc["e", "end_time"])
    busy = utilization(table.jobs, 8, bucket_s=7200.0, log_end=table.log_end)
    assert list(busy["all"]) == [(18000.0 + 3600.0) / (8 * 7200.0)]


async def test_the_live_report_counts_the_gpus_running_jobs_held_up_to_now(tmp_path: Path) -> None:
    """``gpuherd serve analytics --report-dir``: the elastic job's GPU-hours are those of the GPUs it
    held (it followed no placement or rescale, so counted the 1 GPU asked for), up to the log's end."""
    t0 = 1.7e9
    log = InProcessLog()
    await log.append(_running_jobs(t0))
    await _report_until_written(log, tmp_path, tmp_path / "index.html")
    overview = pd.read_csv(tmp_path / "overview.csv").set_index("Unnamed: 0")["value"]
    assert overview["GPU-hours"] == "6"  # e: 1 GPU for an hour, then 4 for an hour; r: 1 for an hour
    busy = pd.read_csv(tmp_path / "vc_usage.csv")  # (busy GPUs per hour)
    assert busy["default"].sum() == pytest.approx(6.0)


def _five_jobs() -> list[Any]:
    from gpuherd.log import Record
    from tests.helpers import node, submit

    events = [node("n1", 1), *(submit(f"j{i}", 1, at=float(i)) for i in range(5))]
    return [Record(seq, event) for seq, event in enumerate(events, 1)]


def test_jobs_limit_shows_the_latest_and_refuses_a_negative_count(monkeypatch: Any, capsys: Any) -> None:
    from apps.cli import build_parser, common
    from gpuherd.errors import GpuherdError

    monkeypatch.setattr(common, "open_cli_log", _five_jobs_log)
    args = build_parser().parse_args(["jobs", "--limit", "2"])
    assert args.func(args) == 0
    shown = capsys.readouterr().out
    assert "j3" in shown and "j4" in shown and "j0" not in shown
    args = build_parser().parse_args(["jobs", "--limit", "-2"])  # (read as "all but the first two" before)
    with pytest.raises(GpuherdError, match="--limit"):
        args.func(args)


async def _five_jobs_log(args: Any) -> InProcessLog:
    """What ``gpuherd events`` opens in these tests: a log of five jobs, in memory."""
    log_ = InProcessLog()
    await log_.append([r.event for r in _five_jobs()])
    return log_


def test_events_last_refuses_a_negative_count(monkeypatch: Any) -> None:
    from apps.cli import build_parser, history
    from gpuherd.errors import GpuherdError

    monkeypatch.setattr(history, "open_cli_log", _five_jobs_log)
    args = build_parser().parse_args(["events", "--last", "-5"])
    with pytest.raises(GpuherdError, match="--last"):
        args.func(args)


def test_events_type_refuses_a_name_no_event_type_has(monkeypatch: Any, capsys: Any) -> None:
    # (The command is run as main() runs it, without main(): that configures logging onto this
    # test's captured stderr, which is closed once the test ends, and later tests' logs fail on it.)
    from apps.cli import build_parser, history
    from gpuherd.errors import GpuherdError

    monkeypatch.setattr(history, "open_cli_log", _five_jobs_log)
    args = build_parser().parse_args(["events", "--type", "JobSubmitted"])
    assert args.func(args) in (0, None) and capsys.readouterr().out.count("JobSubmitted") == 5
    args = build_parser().parse_args(["events", "--type", "JobPlaced,jobsubmitted,Bogus"])
    with pytest.raises(GpuherdError) as refused:  # (printed nothing and exited 0: read as "no such events")
        args.func(args)
    shown = str(refused.value)
    assert "no event type named Bogus, jobsubmitted (did you mean JobSubmitted?)" in shown
    assert all(name in shown for name in ev.EVENT_TYPES)


@pytest.mark.parametrize("name", ["*", ">", "n.1"])
def test_drain_refuses_a_node_name_that_is_a_subject_wildcard(monkeypatch: Any, name: str) -> None:
    from apps.cli import build_parser, config
    from gpuherd.errors import GpuherdError

    calls: list[Any] = []
    monkeypatch.setattr(config, "client_call", lambda args, call: calls.append(call))
    for command in ("drain", "undrain"):
        args = build_parser().parse_args([command, name])  # ('*' matched every node's subject: "drained *")
        with pytest.raises(GpuherdError, match="not a NATS subject token"):
            args.func(args)
    assert calls == []


@pytest.mark.parametrize("name", ["*", ">", "n.1"])
def test_the_client_refuses_to_drain_a_subject_wildcard(name: str) -> None:
    import asyncio

    from gpuherd.client import Client
    from gpuherd.errors import SubmissionError

    class Unconnected:  # (refused before it reads the log: nothing is sent)
        def new_inbox(self) -> str:
            return "_INBOX.test"

    client = Client(nc=Unconnected())
    with pytest.raises(SubmissionError, match="not a NATS subject token"):
        asyncio.run(client.drain(name))


def test_a_report_of_a_trace_without_start_times_has_no_queueing_column(tmp_path: Path) -> None:
    path = tmp_path / "cluster01.csv"
    path.write_text("job_id,submission_time,duration,num_gpu\n1,0,100,1\n2,5,200,2\n3,9,50,1\n")
    out = tmp_path / "itp-report"
    page = write_report(load_trace(path), out).read_text()
    assert "queueing delay (the data has no start times)" in page  # said once, as not shown
    assert "queue_s" not in (out / "quantiles.csv").read_text() and "queue_s" not in page
