"""Review of trace jobs as gpuherd jobs: two trace ids are two jobs, none dropped; a job the trace
gives no id is named by its place in the file; an id the trace repeats on another job is renamed,
and a row the trace repeats whole (a file joined twice) is left out as a copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from apps.cli import build_parser
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from services.analytics.traces import (
    NO_JOB_ID,
    REPEATED_ID,
    SAME_ROW,
    load_helios,
    load_philly_csv,
    load_philly_json,
    load_trace,
    submissions,
)


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


def test_ids_longer_than_intake_takes_are_shortened_and_stay_distinct(tmp_path: Path) -> None:
    """A trace id of 128 characters takes intake's whole limit, so its "-2" twin went over it, and
    a longer id was refused outright: each job was counted rejected instead of run."""
    long_a, long_b = "a" * 200, "a" * 199 + "b"  # (one start, one job each)
    exact = "e" * 128
    path = tmp_path / "cluster_log.csv"
    # "e...e." and "e...e_" are one token of 128 characters: the second is renamed "<it>-2", over 128.
    rows = [(long_a, 0), (long_b, 1), (exact, 2), ("e" * 127 + ".", 3), ("e" * 127 + "_", 4)]
    path.write_text(
        "job_id,user,vc,gpu_num,state,submit_time,start_time,end_time,duration\n"
        + "".join(f"{job},u,a,1,COMPLETED,{at},{at},{at + 100},100\n" for job, at in rows)
    )
    jobs = [s.job for s in submissions(load_helios(path))]
    assert len(set(jobs)) == len(rows)
    assert all(len(job) <= 128 for job in jobs), [len(job) for job in jobs]
    assert jobs[2] == exact  # (one that fits keeps its id)
    result = simulate(submissions(load_helios(path)), ClusterSpec(vcs={"a": VcSpec(nodes=1)}), "fifo")
    assert result.rejected == 0 and (result.table.jobs["state"] == "completed").all()


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


# -- ids and rows the trace repeats -------------------------------------------------------------------

HELIOS = "job_id,user,vc,gpu_num,state,submit_time,start_time,end_time,duration\n"


def _all_completed(trace: Any, jobs: int) -> None:
    """``trace`` replayed: each of its ``jobs`` jobs submitted under an id of its own, and finished."""
    ids = [s.job for s in submissions(trace)]
    assert len(set(ids)) == len(ids) == jobs
    result = simulate(submissions(trace), ClusterSpec(vcs={"a": VcSpec(nodes=1)}), "fifo")
    assert result.submitted == jobs and result.rejected == 0
    assert len(result.table.jobs) == jobs and (result.table.jobs["state"] == "completed").all()


def test_a_helios_job_id_used_again_by_another_job_is_renamed_and_every_job_simulated(tmp_path: Path) -> None:
    # (Ids reset per day, a resubmission logged under its name: intake took the second "7" of one
    # spec for the first submitted again, and refused the one of another spec.)
    path = tmp_path / "cluster_log.csv"
    path.write_text(
        HELIOS
        + "7,u,a,1,COMPLETED,0,0,100,100\n"
        + "7,u,a,1,COMPLETED,50,50,150,100\n"  # (another submit time)
        + "7,u,a,2,FAILED,60,60,90,30\n"  # (another spec)
        + "7-2,u,a,1,COMPLETED,70,70,80,10\n"  # (the trace's own "7-2": the rename is another)
    )
    trace = load_helios(path)
    by_submit = dict(zip(trace.jobs["submit_time"], trace.jobs["job_id"], strict=True))
    assert by_submit == {0.0: "7", 50.0: "7-3", 60.0: "7-4", 70.0: "7-2"}  # (in file order)
    assert trace.changed == {REPEATED_ID: 2} and not trace.rejected
    assert "changed: 2 a job id used by an earlier row, renamed <id>-<n>" in trace.describe()
    _all_completed(trace, 4)


def test_a_helios_row_repeated_whole_is_left_out_as_the_same_row_again(tmp_path: Path) -> None:
    # (The same file joined twice, its header dropped: intake took each copy for the first
    # submitted again, unsaid.)
    rows = "1,u,a,1,COMPLETED,0,0,100,100\n2,u,a,1,COMPLETED,5,5,105,100\n"
    path = tmp_path / "cluster_log.csv"
    path.write_text(HELIOS + rows + rows + "1,u,a,1,COMPLETED,9,9,109,100\n")
    trace = load_helios(path)
    assert list(trace.jobs["job_id"]) == ["1", "2", "1-2"]
    assert trace.rejected == {SAME_ROW: 2} and trace.changed == {REPEATED_ID: 1}
    assert "not used: 2 the same row again (every field equal to an earlier row's)" in trace.describe()
    _all_completed(trace, 3)


PHILLY = "timestamp,duration,num_gpus,gpu_time,cluster\n"
PHILLY_ROWS = (
    "2017-10-01 00:00:45,30.0,1,30.0,a\n2017-10-01 00:00:45,30.0,1,30.0,a\n2017-10-01 00:01:00,61.0,2,122.0,a\n"
)


def test_a_philly_csv_joined_to_itself_is_read_once(tmp_path: Path) -> None:
    # (A Philly CSV has no job ids: each copy was a job of its own, and the trace twice the work.)
    path = tmp_path / "philly.csv"
    path.write_text(PHILLY + PHILLY_ROWS + PHILLY + PHILLY_ROWS)
    trace = load_philly_csv(path)
    assert trace.rows_read == 7 and len(trace.jobs) == 3
    assert trace.rejected == {"repeated header row": 1, SAME_ROW: 3} and not trace.changed
    _all_completed(trace, 3)


def test_equal_philly_csv_rows_of_one_file_stay_jobs_of_their_own(tmp_path: Path) -> None:
    # (No id tells them apart: a sweep's jobs of one size submitted in one second, as philly.csv
    # holds, not a copy.)
    path = tmp_path / "philly.csv"
    path.write_text(PHILLY + PHILLY_ROWS)
    trace = load_philly_csv(path)
    assert len(trace.jobs) == 3 and not trace.rejected and not trace.changed


def test_rows_without_an_id_are_copies_only_from_a_file_joined_after(tmp_path: Path) -> None:
    path = tmp_path / "cluster_log.csv"
    path.write_text(HELIOS + ",u,a,1,COMPLETED,0,0,100,100\n" * 2 + HELIOS + ",u,a,1,COMPLETED,0,0,100,100\n")
    trace = load_helios(path)
    assert list(trace.jobs["job_id"]) == ["row-1", "row-2"]
    assert trace.rejected == {"repeated header row": 1, SAME_ROW: 1} and trace.changed == {NO_JOB_ID: 2}


def test_a_philly_log_s_jobid_used_again_is_renamed(tmp_path: Path) -> None:
    # (_philly_log's jobs differ in their times: each is another job.)
    trace = load_philly_json(_philly_log(tmp_path, ["app_1", "app_1", None, "app_1"]))
    assert list(trace.jobs["job_id"]) == ["app_1", "app_1-2", "row-3", "app_1-3"]
    assert trace.changed == {REPEATED_ID: 2, NO_JOB_ID: 1}
    _all_completed(trace, 4)


def test_a_philly_log_written_twice_is_read_once(tmp_path: Path) -> None:
    jobs = json.loads(_philly_log(tmp_path, ["app_1", "app_2"]).read_text())
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(jobs + jobs))
    trace = load_philly_json(path)
    assert list(trace.jobs["job_id"]) == ["app_1", "app_2"] and trace.rejected == {SAME_ROW: 2}


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("cluster01.csv", "job_id,submission_time,duration,num_gpu\nj,0,100,1\nj,10,100,1\n"),
        (
            "pods.csv",
            "name,num_gpu,gpu_milli,qos,creation_time,deletion_time,scheduled_time\n"
            "p,1,1000,a,0,100,0\np,1,1000,a,10,110,10\n",
        ),
        ("cluster_log.csv", HELIOS + "j,u,a,1,COMPLETED,0,0,100,100\nj,u,a,1,COMPLETED,10,10,110,100\n"),
    ],
)
def test_every_format_renames_an_id_used_again(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    trace = load_trace(path)
    assert len(trace.jobs) == 2 and trace.changed == {REPEATED_ID: 1}
    assert list(trace.jobs["job_id"].str.endswith("-2")) == [False, True]


def test_gpuherd_sim_replays_every_job_of_a_trace_that_repeats_ids(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "cluster_log.csv"
    row = "{},u,a,1,COMPLETED,{t},{t},{end},100\n"
    path.write_text(
        HELIOS + row.format("3", t=0, end=100) * 2 + row.format("3", t=5, end=105) + "3,u,a,2,COMPLETED,6,6,106,100\n"
    )
    args = build_parser().parse_args(["sim", str(path), "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == (
        "cluster_log: 3 of 4 rows used; not used: 1 the same row again (every field equal to an earlier row's); "
        "changed: 2 a job id used by an earlier row, renamed <id>-<n>"
    )
    assert (out["fifo"]["submitted"], out["fifo"]["rejected"]) == (3, 0)
