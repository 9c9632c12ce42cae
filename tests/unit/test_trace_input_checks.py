"""The files the analytics commands read (traces, cluster specs, node sequences) when they are not
what they should be: each is refused with an error that names the file and what is wrong (a
GpuherdError, which the CLI prints without a traceback), or its bad rows are counted, never turned
into numbers nobody asked for.

The command functions are called directly (``build_parser().parse_args`` then ``args.func``), never
the CLI's ``main``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from apps.cli import build_parser
from apps.sim.cluster import ClusterSpec, ClusterSpecError
from gpuherd.errors import GpuherdError
from services.analytics.ces import CesParamsError, NodeSequenceError, evaluate_sequence, load_node_sequence
from services.analytics.jobs import MAX_BUCKETS, BucketsError, utilization
from services.analytics.traces import (
    TIME_OUT_OF_RANGE,
    TOO_LONG,
    TOO_MANY_GPUS,
    TraceError,
    load_helios,
    load_itp,
    load_philly_json,
    load_trace,
)

PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster"


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def _philly_job(**changes: Any) -> dict[str, Any]:
    attempt = {"start_time": "2017-10-09 07:02:00", "end_time": "2017-10-09 08:02:00", "detail": [{"gpus": ["0"]}]}
    job: dict[str, Any] = {"jobid": "a", "vc": "v", "submitted_time": "2017-10-09 07:01:55", "attempts": [attempt]}
    job.update(changes)
    return job


# -- files that are not what their format says: refused with why, no traceback -----------------------


def test_a_trace_whose_header_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes(PHILLY_HEADER.encode() + b"\xff\n2017-10-09 07:01:55,66.0,1,66.0,a\n")
    with pytest.raises(TraceError, match=r"trace\.csv: not UTF-8 text \(byte 0xff at offset 44\)"):
        load_trace(path)  # (the format sniff read it as text: UnicodeDecodeError)
    with pytest.raises(GpuherdError, match="not UTF-8"):
        _run(["sim", str(path)])


def test_a_philly_json_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster_job_log.json"
    path.write_bytes(b"[\xff]")
    with pytest.raises(TraceError, match=r"cluster_job_log\.json: not UTF-8 text \(byte 0xff at offset 1\)"):
        load_trace(path)


@pytest.mark.parametrize(
    ("jobs", "problem"),
    [
        ([1, 2], "job 1 of 2 is not a Philly job: each job is a JSON object, got int"),
        ([_philly_job(), _philly_job(attempts=5)], "job 2 of 2 is not a Philly job: attempts is a list of objects"),
        (
            [_philly_job(attempts=[1])],
            "job 1 of 1 is not a Philly job: attempts is a list of objects, got a list holding int",
        ),
        (
            [_philly_job(attempts=[{"start_time": "2017-10-09 07:02:00", "detail": [1]}])],
            "job 1 of 1 is not a Philly job: an attempt's detail is a list of objects, got a list holding int",
        ),
        (
            [_philly_job(attempts=[{"start_time": "2017-10-09 07:02:00", "detail": [{"gpus": 5}]}])],
            "job 1 of 1 is not a Philly job: a node's gpus is a list, got int",
        ),
    ],
)
def test_a_philly_json_whose_jobs_are_not_of_its_format_is_refused_naming_the_job(
    tmp_path: Path, jobs: list[Any], problem: str
) -> None:
    path = tmp_path / "log.json"
    path.write_text(json.dumps(jobs))
    with pytest.raises(TraceError, match=f"log\\.json: {problem}"):
        load_philly_json(path)


def test_a_well_formed_philly_json_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "log.json"
    path.write_text(json.dumps([_philly_job(), _philly_job(jobid="b", attempts=[])]))
    trace = load_philly_json(path)
    assert list(trace.jobs["gpus"]) == [1] and trace.rejected == {"bad or missing duration": 1}


def test_a_philly_json_nested_too_deeply_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TraceError, match=r"deep\.json: not a Philly job log \(JSON nested too deeply\)"):
        load_trace(path)


def test_a_cluster_spec_that_is_not_utf8_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"vcs:\n  a:\n    nodes: 1 \xff\n")
    with pytest.raises(ClusterSpecError, match=r"cluster\.yaml: not a cluster spec \(not UTF-8: byte 0xff"):
        ClusterSpec.from_file(path)


def test_a_cluster_spec_nested_too_deeply_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 20_000)
    with pytest.raises(ClusterSpecError, match=r"deep\.yaml: not a cluster spec \(nested too deeply\)"):
        ClusterSpec.from_file(path)


def test_a_cluster_spec_s_own_checks_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text('{"vcs": {}}')
    with pytest.raises(ClusterSpecError, match=r"empty\.json: a cluster spec needs at least one VC"):
        ClusterSpec.from_file(path)


# -- numbers out of range: counted as not used, or refused, never wrapped into others ----------------


def test_gpu_counts_beyond_any_cluster_are_counted_as_not_used_rather_than_wrapped_to_negative(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cluster09.csv"
    path.write_text(
        "job_id,submission_time,duration,num_gpu\n1,0,10,1e30\n2,5,10,1\n3,5,10,9223372036854775808\n4,6,10,65536\n"
    )
    trace = load_itp(path)  # (1e30 and 2**63 were jobs of -9223372036854775808 GPUs, counted as in use)
    assert list(trace.jobs["job_id"]) == ["2", "4"] and list(trace.jobs["gpus"]) == [1, 65536]
    assert trace.rejected == {TOO_MANY_GPUS: 2}
    assert trace.describe() == "itp-cluster09: 2 of 4 rows used; not used: 2 GPU count over 65,536"


@pytest.mark.parametrize(
    ("rows", "problem"),
    [
        (
            "t0,3,4\nt1,inf,4\n",
            "1 of its rows hold a count of nodes that is not a whole number from 0 to 10,000,000 "
            "\\(the first on line 3\\)",
        ),
        ("t0,1e30,420\nt1,3,4\n", "1 of its rows hold a count of nodes that is not a whole number"),
        ("t0,2.5,4\n", "1 of its rows hold a count of nodes that is not a whole number"),
        ("t0,3,4\nt1,-5,4\n", "1 of its rows hold fewer than 0 active or 1 total nodes \\(the first on line 3\\)"),
        ("t0,0,0\n", "1 of its rows hold fewer than 0 active or 1 total nodes"),
        ("t0,5,4\n", "1 of its rows hold more active nodes than the cluster's total"),
        ("t1,3,4\nt0,3,4\n", "1 of its rows are not later than the row before them \\(times must increase\\)"),
    ],
)
def test_a_node_sequence_with_counts_no_cluster_has_is_refused_naming_the_line(
    tmp_path: Path, rows: str, problem: str
) -> None:
    path = tmp_path / "nodes.csv"
    rows = rows.replace("t0", "2017-10-03 00:00:00").replace("t1", "2017-10-03 00:01:00")
    path.write_text("time,active,total\n" + rows)
    with pytest.raises(NodeSequenceError, match=f"nodes\\.csv: {problem}"):
        load_node_sequence(str(path))  # (inf active nodes was a utilization of 7.7e19%)


def _node_sequence(tmp_path: Path) -> Path:
    path = tmp_path / "nodes.csv"
    path.write_text("time,active,total\n2017-10-03 00:00:00,1,4\n2017-10-03 00:10:00,2,4\n")
    return path


def test_a_valid_node_sequence_loads_as_whole_counts(tmp_path: Path) -> None:
    seq = load_node_sequence(str(_node_sequence(tmp_path)))
    assert list(seq["active"]) == [1, 2] and str(seq["active"].dtype) == "int64"
    assert evaluate_sequence(seq, decide_every_s=600).utilization_before == 3 / 8


@pytest.mark.parametrize("every", ["nan", "0", "-600", "inf"])
def test_ces_refuses_a_decision_interval_that_is_not_seconds_above_zero(tmp_path: Path, every: str) -> None:
    path = _node_sequence(tmp_path)
    with pytest.raises(GpuherdError, match=f"--every is seconds > 0 between the controller's decisions, got {every}"):
        _run(["ces", str(path), "--every", every])
    with pytest.raises(CesParamsError, match="decides every so many seconds > 0"):
        evaluate_sequence(load_node_sequence(str(path)), decide_every_s=float(every))


@pytest.mark.parametrize(("option", "value"), [("--scale", "nan"), ("--scale", "inf"), ("--bucket", "inf")])
def test_sim_refuses_a_scale_or_bucket_that_is_not_finite(tmp_path: Path, option: str, value: str) -> None:
    path = tmp_path / "cluster09.csv"
    path.write_text("job_id,submission_time,duration,num_gpu\n1,0,10,1\n")
    with pytest.raises(GpuherdError, match=f"{option} is .*, got {value}"):
        _run(["sim", str(path), option, value])  # (math.ceil of NaN, np.arange to inf: tracebacks)


# -- runs no cluster ever ran: counted as not used, not simulated tick by tick -----------------------

YEAR_S = 365 * 86400


def test_a_run_longer_than_a_year_is_counted_as_not_used(tmp_path: Path) -> None:
    path = tmp_path / "cluster09.csv"
    path.write_text(f"job_id,submission_time,duration,num_gpu\n1,0,1e15,8\n2,5,1e9,8\n3,5,{YEAR_S},8\n")
    trace = load_itp(path)  # (a run of 53 days is the longest of the shared traces; of 145, Alibaba's)
    assert list(trace.jobs["job_id"]) == ["3"] and trace.rejected == {TOO_LONG: 2}
    assert trace.describe() == "itp-cluster09: 1 of 3 rows used; not used: 2 duration over 365 days"


def test_times_beyond_what_a_calendar_timestamp_holds_are_counted_as_not_used(tmp_path: Path) -> None:
    path = tmp_path / "cluster_log.csv"
    path.write_text(
        "job_id,vc,gpu_num,submit_time,start_time,duration\n"
        "c,v,1,-1e300,,10\na,v,1,2020-01-01 00:00:00,,10\nb,v,1,1e300,,10\nd,v,1,1577836800,1e300,10\n"
    )
    trace = load_helios(path)  # (a run of 10 s submitted 1e300 s after another: a span no bucket covers)
    assert list(trace.jobs["job_id"]) == ["a"] and trace.rejected == {TIME_OUT_OF_RANGE: 3}


@pytest.mark.timeout(60)
def test_sim_of_a_trace_with_runs_of_decades_leaves_them_out_and_says_so(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "long.csv"
    trace.write_text("job_id,submission_time,duration,num_gpu\n1,0,1e15,8\n2,5,1e9,8\n3,6,10,8\n")
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"vcs": {"long": {"nodes": 1}}}')  # (job 3 waited 1e9 s: ticks every 300 s, for hours)
    assert _run(["sim", str(trace), "--cluster", str(cluster), "--workers", "1"]) == 0  # (1e15: a 2 TiB MemoryError)
    out = capsys.readouterr().out
    assert "itp-long: 1 of 3 rows used; not used: 2 duration over 365 days" in out
    assert "fifo: 1 jobs (0 rejected)" in out


def test_a_utilization_of_more_buckets_than_it_can_hold_is_refused() -> None:
    jobs = pd.DataFrame(
        {"start_time": [0.0], "end_time": [MAX_BUCKETS * 3600.0 + 7200], "duration": [1.0], "gpus": [1], "vc": ["v"]}
    )
    with pytest.raises(BucketsError, match="give a bucket of at least 3,601 s"):
        utilization(jobs, {"v": 1}, bucket_s=3600)
    assert len(utilization(jobs, {"v": 1}, bucket_s=3601)) <= MAX_BUCKETS


def test_sim_refuses_a_bucket_too_short_for_the_trace_before_it_runs(tmp_path: Path) -> None:
    trace = tmp_path / "cluster09.csv"
    trace.write_text("job_id,submission_time,duration,num_gpu\n1,0,86400,1\n2,5,10,1\n")
    with pytest.raises(GpuherdError, match=r"over 86,400 s in buckets of 0.001 s .* at least 1 s"):
        _run(["sim", str(trace), "--bucket", "0.001"])


@pytest.mark.timeout(60)
def test_sim_with_a_limit_says_how_many_usable_jobs_it_left_out(tmp_path: Path, capsys: Any) -> None:
    trace = tmp_path / "four.csv"
    trace.write_text("job_id,submission_time,duration,num_gpu\n1,0,10,1\n2,5,10,1\n3,6,10,1\n4,7,-1,1\n")
    assert _run(["sim", str(trace), "--limit", "2", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "3 of 4 rows used" in out  # (the trace's own account: one row has a negative duration)
    assert "--limit: the first 2 of 3 usable jobs are simulated" in out
