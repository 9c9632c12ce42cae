"""Trace files as they ship: gzip-compressed under any name, job states spelled as each exporter
spells them, and a folder given for a file."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pytest

from services.analytics.traces import TraceError, load_trace

HELIOS = "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue\n"


def helios_rows(states: list[str]) -> str:
    rows = [
        f"j{i},u,vc1,1,4,1,{state},2020-04-01 00:00:{i:02d},2020-04-01 00:01:00,2020-04-01 00:11:00,600,60\n"
        for i, state in enumerate(states)
    ]
    return HELIOS + "".join(rows)


def test_slurm_and_other_spellings_of_states_are_read(tmp_path: Path) -> None:
    given = ["COMPLETED", "CANCELLED by 1234", "Canceled", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "Timeout"]
    given.append("PENDING?")
    path = tmp_path / "cluster_log.csv"
    path.write_text(helios_rows(given))
    states = load_trace(path).jobs["state"].tolist()
    assert states[:7] == ["completed", "cancelled", "cancelled", "failed", "failed", "cancelled", "timeout"]
    assert states[7] is pd.NA  # (unknown: no state rather than a guess)


@pytest.mark.parametrize("name", ["cluster_log.csv.gz", "cluster_log.csv"])
def test_a_gzipped_trace_loads_whatever_its_name(tmp_path: Path, name: str) -> None:
    plain = tmp_path / "plain.csv"
    plain.write_text(helios_rows(["COMPLETED", "FAILED"]))
    packed = tmp_path / "packed" / name
    packed.parent.mkdir()
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_trace(packed).jobs.equals(load_trace(plain).jobs)


def test_a_gzipped_philly_job_log_loads(tmp_path: Path) -> None:
    job = {
        "status": "Pass",
        "vc": "vc1",
        "jobid": "application_1",
        "user": "u",
        "submitted_time": "2017-10-01 00:00:00",
        "attempts": [
            {
                "start_time": "2017-10-01 00:01:00",
                "end_time": "2017-10-01 01:01:00",
                "detail": [{"ip": "n1", "gpus": ["gpu0", "gpu1"]}],
            }
        ],
    }
    path = tmp_path / "cluster_job_log.json.gz"
    path.write_bytes(gzip.compress(json.dumps([job]).encode()))
    jobs = load_trace(path).jobs
    assert jobs["gpus"].tolist() == [2] and jobs["state"].tolist() == ["completed"]


def test_a_truncated_gzip_and_a_folder_say_what_they_are(tmp_path: Path) -> None:
    path = tmp_path / "cut.csv.gz"
    path.write_bytes(gzip.compress(helios_rows(["COMPLETED"] * 50).encode())[:60])
    with pytest.raises(TraceError, match=r"cut\.csv\.gz"):
        load_trace(path, kind="helios")
    with pytest.raises(TraceError, match="a folder, not a trace file"):
        load_trace(tmp_path)


def test_alibaba_gpu_shares_taken_otherwise_than_given_are_counted(tmp_path: Path) -> None:
    head = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    head += "creation_time,deletion_time,scheduled_time\n"
    rows = [
        "p1,1000,100,1,500,,LS,Succeeded,0,100,10",  # as given
        "p2,1000,100,1,,,LS,Succeeded,1,100,10",  # no share: a whole GPU
        "p3,1000,100,2,1500,,LS,Succeeded,2,100,10",  # over a whole GPU
        "p4,1000,100,1,-200,,LS,Succeeded,3,100,10",  # below none
    ]
    path = tmp_path / "openb_pod_list_x.csv"
    path.write_text(head + "\n".join(rows) + "\n")
    trace = load_trace(path)
    assert trace.jobs.set_index("job_id")["gpu_request"].to_dict() == {"p1": 0.5, "p2": 1.0, "p3": 2.0, "p4": 0.0}
    assert trace.changed == {
        "gpu_milli missing or unreadable, taken as a whole GPU (1000)": 1,
        "gpu_milli over 1000, taken as 1000": 1,
        "gpu_milli below 0, taken as 0": 1,
    }
