"""Review of trace jobs as gpuherd jobs: two trace ids are two jobs, none dropped (an id the trace
repeats is intake's to judge: ``test_analytics_cli``'s reused intake id), and a job the trace
gives no id is named by its place in the file."""

from __future__ import annotations

import json
from pathlib import Path

from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from services.analytics.traces import NO_JOB_ID, load_helios, load_philly_json, submissions


def _trace(tmp_path: Path):
    # "j.1" and "j_1" are one gpuherd id (a NATS token has no dots); "j_1-2" is taken already.
    path = tmp_path / "cluster_log.csv"
    path.write_text(
        "job_id,user,vc,gpu_num,state,submit_time,start_time,end_time,duration\n"
        "j.1,u,a,1,COMPLETED,0,0,100,100\n"
        "j_1,u,a,1,COMPLETED,10,10,110,100\n"
        "j_1-2,u,a,1,COMPLETED,5,5,105,100\n"
        "j2,u,a,1,COMPLETED,30,30,130,100\n"
    )
    return load_helios(path)


def test_every_trace_job_is_submitted_under_an_id_of_its_own(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    jobs = [s.job for s in submissions(trace)]
    assert len(jobs) == 4
    assert len(set(jobs)) == 4
    assert jobs == ["j_1", "j_1-2", "j_1-3", "j2"]  # (in submission order, the first keeps its id)


def test_a_simulation_runs_every_trace_job(tmp_path: Path) -> None:
    result = simulate(submissions(_trace(tmp_path)), ClusterSpec(vcs={"a": VcSpec(nodes=1)}), "fifo")
    assert result.submitted == 4
    assert len(result.table.jobs) == 4
    assert (result.table.jobs["state"] == "completed").all()


# -- jobs the trace gives no id ----------------------------------------------------------------------


MISSING = object()  # (a job with no jobid key at all)


def _philly_log(tmp_path: Path, ids: list[object]) -> Path:
    jobs = []
    for n, jobid in enumerate(ids):
        attempt = {"start_time": 1507532520 + n, "end_time": 1507536120 + n, "detail": [{"gpus": ["0"]}]}
        job: dict[str, object] = {"vc": "a", "status": "Pass", "submitted_time": 1507532515 + n, "attempts": [attempt]}
        if jobid is not MISSING:
            job["jobid"] = jobid
        jobs.append(job)
    path = tmp_path / "cluster_job_log.json"
    path.write_text(json.dumps(jobs))
    return path


def test_philly_jobs_without_an_id_are_named_by_their_place_in_the_log_and_all_simulated(tmp_path: Path) -> None:
    # (Each was job "None" (or ""): intake refused all but the first as resubmissions of it.)
    trace = load_philly_json(_philly_log(tmp_path, [None, MISSING, "None", "", "app_1"]))
    assert list(trace.jobs["job_id"]) == ["row-1", "row-2", "row-3", "row-4", "app_1"]
    assert trace.changed == {NO_JOB_ID: 4} and not trace.rejected
    assert "changed: 4 no job id, named row-<n> by its place in the file" in trace.describe()
    result = simulate(submissions(trace), ClusterSpec(vcs={"a": VcSpec(nodes=1)}), "fifo")
    assert result.submitted == 5 and result.rejected == 0
    assert (result.table.jobs["state"] == "completed").all() and len(result.table.jobs) == 5


def test_a_derived_id_the_trace_already_uses_is_made_another(tmp_path: Path) -> None:
    trace = load_philly_json(_philly_log(tmp_path, ["row-2", None]))
    assert list(trace.jobs["job_id"]) == ["row-2", "row-2-2"]


def test_csv_jobs_with_an_empty_id_are_named_by_their_row(tmp_path: Path) -> None:
    # (Each was job "<NA>", one job to intake.)
    path = tmp_path / "cluster_log.csv"
    path.write_text("job_id,vc,gpu_num,submit_time,duration\n,a,1,0,10\nj,a,1,1,10\n  ,a,1,2,10\n")
    trace = load_helios(path)
    assert list(trace.jobs["job_id"]) == ["row-1", "j", "row-3"] and trace.changed == {NO_JOB_ID: 2}
    assert len({s.job for s in submissions(trace)}) == 3
