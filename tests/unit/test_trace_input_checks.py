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

import pytest

from apps.cli import build_parser
from apps.sim.cluster import ClusterSpec, ClusterSpecError
from gpuherd.errors import GpuherdError
from services.analytics.traces import TraceError, load_philly_json, load_trace

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
