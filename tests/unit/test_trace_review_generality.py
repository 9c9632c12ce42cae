"""Review of the trace loaders against the ways real exports of the same public traces vary (time
as epoch seconds or calendar strings, a byte-order mark, quoted or spaced headers, trailing
delimiters, ids that look like numbers, ...): each variation is read as the same jobs, or refused
or counted with why; never read into other numbers without a word."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from services.analytics.traces import (
    REPEATED_HEADER,
    TIME_IN_ANOTHER_UNIT,
    TIME_OUT_OF_RANGE,
    TraceError,
    load_alibaba_openb,
    load_helios,
    load_itp,
    load_philly_csv,
    load_philly_json,
    load_trace,
)

PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster"
SUBMIT = 1507532515.0  # 2017-10-09 07:01:55 UTC


# -- times: epoch seconds are seconds -----------------------------------------------------------------


def test_a_philly_csv_with_epoch_second_timestamps_keeps_them_as_seconds(tmp_path: Path) -> None:
    # (pandas took an integer for nanoseconds: the job was submitted 1.5 s after 1970.)
    path = tmp_path / "philly.csv"
    path.write_text(f"{PHILLY_HEADER}\n1507532515,66.0,1,66.0,a\n2017-10-09 07:01:56,66.0,1,66.0,a\n")
    trace = load_philly_csv(path)
    assert list(trace.jobs["submit_time"]) == [SUBMIT, SUBMIT + 1]


def test_a_philly_json_with_epoch_second_times_keeps_them_as_seconds(tmp_path: Path) -> None:
    attempt = {"start_time": SUBMIT + 5, "end_time": SUBMIT + 3605, "detail": [{"gpus": ["0"]}]}
    job = {"jobid": "a", "vc": "v", "status": "Pass", "submitted_time": int(SUBMIT), "attempts": [attempt]}
    path = tmp_path / "cluster_job_log.json"
    path.write_text(json.dumps([job]))
    row = load_philly_json(path).jobs.iloc[0]
    assert (row["submit_time"], row["duration"], row["queue"]) == (SUBMIT, 3600.0, 5.0)


# -- rows of more fields than the header names ----------------------------------------------------------


def test_rows_of_more_fields_than_the_header_are_refused_not_shifted_a_column(tmp_path: Path) -> None:
    # (pandas took each row's first field for an index: the duration was read as the timestamp, the
    # GPU count as the duration... and the job was used.)
    path = tmp_path / "philly.csv"
    path.write_text(f"{PHILLY_HEADER}\n2017-10-09 07:01:55,66.0,1,66.0,a,extra\n")
    with pytest.raises(TraceError, match=r"philly\.csv: row 1 has 6 fields, the header names 5 \(timestamp,"):
        load_philly_csv(path)


def test_a_trailing_delimiter_on_every_row_is_read_as_the_fields_before_it(tmp_path: Path) -> None:
    path = tmp_path / "philly.csv"
    path.write_text(f"{PHILLY_HEADER}\n2017-10-09 07:01:55,66.0,2,132.0,a,\n2017-10-09 07:01:56,7.0,1,7.0,b,\n")
    jobs = load_philly_csv(path).jobs
    assert list(jobs["duration"]) == [66.0, 7.0]
    assert list(jobs["gpus"]) == [2, 1]
    assert list(jobs["vc"]) == ["a", "b"]


# -- headers as a CSV writer writes them ------------------------------------------------------------------

ROW = "2017-10-09 07:01:55,66.0,1,66.0,a"


@pytest.mark.parametrize(
    "header",
    [
        "\ufeff" + PHILLY_HEADER,  # (a byte-order mark: Excel's "CSV UTF-8")
        ",".join(f'"{name}"' for name in PHILLY_HEADER.split(",")),  # (quoted names)
        PHILLY_HEADER.replace(",", ", "),  # (a space after each comma)
    ],
    ids=["bom", "quoted", "spaced"],
)
def test_a_philly_header_as_csv_writers_write_it_is_recognised(tmp_path: Path, header: str) -> None:
    # (The format sniff split the first line on commas: "\ufefftimestamp", '"timestamp"' and
    # " duration" matched no known trace.)
    path = tmp_path / "philly.csv"
    row = ROW.replace(",", ", ") if ", " in header else ROW
    path.write_text(f"{header}\n{row}\n", encoding="utf-8")
    trace = load_trace(path)
    row0 = trace.jobs.iloc[0]
    assert (trace.name, row0["submit_time"], row0["duration"], row0["gpus"], row0["vc"]) == (
        "philly",
        SUBMIT,
        66.0,
        1,
        "a",
    )


def test_a_philly_json_with_a_byte_order_mark_loads(tmp_path: Path) -> None:
    attempt = {"start_time": "2017-10-09 07:02:00", "end_time": "2017-10-09 08:02:00", "detail": [{"gpus": ["0"]}]}
    job = {"jobid": "a", "vc": "v", "status": "Pass", "submitted_time": "2017-10-09 07:01:55", "attempts": [attempt]}
    path = tmp_path / "cluster_job_log.json"
    path.write_text("\ufeff" + json.dumps([job]), encoding="utf-8")
    assert len(load_philly_json(path).jobs) == 1


def test_an_empty_file_is_refused_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("")
    with pytest.raises(TraceError, match=r"trace\.csv: no header row \(the file is empty"):
        load_trace(path)


# -- ids and names are text, even where they look like numbers ----------------------------------------------


def test_vc_and_job_ids_that_look_like_numbers_are_kept_as_written(tmp_path: Path) -> None:
    # (pandas read a column of numbers-to-look-at as numbers: job "007" became "7", and beside an
    # empty cell VC "011" became "11.0"; Philly's VC ids are hex, "103959" one of them.)
    path = tmp_path / "cluster_log.csv"
    path.write_text(
        "job_id,user,vc,gpu_num,submit_time,duration\n007,0042,011,1,0,60\n8,,,1,1,60\n9.0,1e3,103959,1,2,60\n"
    )
    jobs = load_helios(path).jobs
    assert list(jobs["job_id"]) == ["007", "8", "9.0"]
    assert list(jobs["user"].fillna("-")) == ["0042", "-", "1e3"]
    assert list(jobs["vc"].fillna("-")) == ["011", "-", "103959"]
    philly = tmp_path / "philly.csv"
    philly.write_text(f"{PHILLY_HEADER}\n2017-10-09 07:01:55,66.0,1,66.0,011\n2017-10-09 07:01:55,66.0,1,66.0,\n")
    assert list(load_philly_csv(philly).jobs["vc"].fillna("-")) == ["011", "-"]


# -- why a GPU count is not used ------------------------------------------------------------------------------


def test_a_missing_unreadable_or_negative_gpu_count_is_counted_as_such_not_as_zero_gpus(tmp_path: Path) -> None:
    # (Everything not above 0 was "zero GPUs": an empty cell, "two" and -1 alike.)
    path = tmp_path / "philly.csv"
    rows = ["", "two", "-1", "0", "inf", "1"]
    path.write_text(PHILLY_HEADER + "\n" + "".join(f"2017-10-09 07:01:55,66.0,{n},66.0,a\n" for n in rows))
    trace = load_philly_csv(path)
    assert trace.rejected == {"bad or missing GPU count": 3, "negative GPU count": 1, "zero GPUs": 1}
    assert len(trace.jobs) == 1


# -- files joined end to end: the header again, further down ---------------------------------------------

# One small file of each CSV kind, with the columns of numbers a repeated header turned into text.
KINDS = {
    "philly.csv": (
        load_philly_csv,
        PHILLY_HEADER,
        ["2017-10-09 07:01:55,66.0,1,66.0,a", "2017-10-09 07:01:56,7,2,14,b"],
    ),
    "cluster09.csv": (load_itp, "job_id,submission_time,duration,num_gpu", ["j1,0,60,1", "j2,5,30.5,2"]),
    "pods.csv": (
        load_alibaba_openb,
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time",
        ["p0,1000,10,1,460,,LS,Running,0,100,10", "p1,2000,10,2,1000,,BE,Succeeded,5,50,5"],
    ),
    "cluster_log.csv": (
        load_helios,
        "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue",
        ["1,u,a,8,64,1,COMPLETED,1507532515,1507532525,1507532585,60,10", "2,u,a,1,8,1,FAILED,5,6,16,10,1"],
    ),
}


@pytest.mark.parametrize("name", list(KINDS))
def test_a_header_repeated_by_joining_files_is_counted_as_such_and_the_rest_read_as_one_file(
    tmp_path: Path, name: str
) -> None:
    # (The header again, as `cat a.csv b.csv` leaves it, was a job of "bad or missing submit time",
    # and it made pandas read each column of numbers as text.)
    load, header, rows = KINDS[name]
    one = tmp_path / "one" / name
    one.parent.mkdir()
    one.write_text(f"{header}\n" + "".join(f"{row}\n" for row in rows))
    joined = tmp_path / name
    quoted = ",".join(f'"{column}"' for column in header.split(","))  # (as another CSV writer wrote it)
    joined.write_text(f"{header}\n{rows[0]}\n{header}\n\ufeff{header}\n{quoted}\n{rows[1]}\n", encoding="utf-8")
    trace = load(joined)
    assert trace.rejected == {REPEATED_HEADER: 3}
    assert trace.rows_read == 5 and len(trace.jobs) == 2
    pd.testing.assert_frame_equal(trace.jobs, load(one).jobs)  # (same values, same types)
    assert f"not used: 3 {REPEATED_HEADER}" in trace.describe()


def test_a_header_repeated_in_another_order_is_refused_naming_the_row(tmp_path: Path) -> None:
    # (The rows after it are of a file of other column order: read under the first header's names, a
    # GPU count would be a duration.)
    path = tmp_path / "cluster09.csv"
    path.write_text(
        "job_id,submission_time,duration,num_gpu\nj1,0,60,1\njob_id,submission_time,num_gpu,duration\nj2,5,2,30\n"
    )
    with pytest.raises(TraceError, match=r"cluster09\.csv: row 2 repeats the header in another order"):
        load_itp(path)


def test_a_job_whose_fields_hold_a_column_name_is_no_header(tmp_path: Path) -> None:
    # (A VC named as a column is a job's VC; a row naming some of the columns is a bad job.)
    path = tmp_path / "philly.csv"
    path.write_text(f"{PHILLY_HEADER}\n2017-10-09 07:01:55,66.0,1,66.0,cluster\ntimestamp,duration,,,\n")
    trace = load_philly_csv(path)
    assert list(trace.jobs["vc"]) == ["cluster"] and trace.rejected == {"bad or missing submit time": 1}


# -- times: epoch milliseconds, microseconds and nanoseconds are converted to seconds -------------------


@pytest.mark.parametrize(
    ("unit", "per_second"), [("milliseconds", 1_000), ("microseconds", 10**6), ("nanoseconds", 10**9)]
)
def test_a_philly_csv_with_epoch_times_in_a_finer_unit_is_read_as_seconds(
    tmp_path: Path, unit: str, per_second: int
) -> None:
    # (Every row was "a time beyond the years 1677-2262".)
    path = tmp_path / "philly.csv"
    stamps = [int(SUBMIT) * per_second, (int(SUBMIT) + 1) * per_second, (int(SUBMIT) + 3600) * per_second]
    path.write_text(PHILLY_HEADER + "\n" + "".join(f"{t},66.0,1,66.0,a\n" for t in stamps))
    trace = load_philly_csv(path)
    assert list(trace.jobs["submit_time"]) == [SUBMIT, SUBMIT + 1, SUBMIT + 3600]
    assert not trace.rejected
    assert trace.changed == {f"times in epoch {unit}, converted to seconds": 3}


def test_a_helios_log_in_epoch_milliseconds_keeps_its_run_times_and_waits(tmp_path: Path) -> None:
    # (Each time column is read by its own numbers; duration and queue stay seconds, as the schema says.)
    ms = int(SUBMIT) * 1000
    path = tmp_path / "cluster_log.csv"
    path.write_text(
        "job_id,vc,gpu_num,submit_time,start_time,end_time,duration,queue\n"
        f"a,v,1,{ms},{ms + 10_000},{ms + 70_000},60,10\n"
        f"b,v,1,{ms + 1000},,,60,\n"  # (never started: no start or end)
    )
    jobs = load_helios(path).jobs
    assert list(jobs["submit_time"]) == [SUBMIT, SUBMIT + 1]
    assert (jobs.iloc[0]["start_time"], jobs.iloc[0]["end_time"]) == (SUBMIT + 10, SUBMIT + 70)
    assert list(jobs["duration"]) == [60.0, 60.0] and jobs.iloc[0]["queue"] == 10.0


def test_a_philly_json_with_epoch_millisecond_times_is_read_as_seconds(tmp_path: Path) -> None:
    ms = int(SUBMIT) * 1000
    attempt = {"start_time": ms + 5000, "end_time": ms + 3_605_000, "detail": [{"gpus": ["0"]}]}
    job = {"jobid": "a", "vc": "v", "status": "Pass", "submitted_time": ms, "attempts": [attempt]}
    path = tmp_path / "cluster_job_log.json"
    path.write_text(json.dumps([job]))
    trace = load_philly_json(path)
    row = trace.jobs.iloc[0]
    assert (row["submit_time"], row["duration"], row["queue"]) == (SUBMIT, 3600.0, 5.0)
    assert trace.changed == {"times in epoch milliseconds, converted to seconds": 1}


def test_small_times_stay_seconds_and_decide_no_unit(tmp_path: Path) -> None:
    # (Seconds from a trace's start, and a 0 for "not known" in a column of milliseconds, are no
    # milliseconds: a column of small numbers stays seconds, and a 0 stays 0.)
    path = tmp_path / "cluster_log.csv"
    path.write_text("job_id,vc,gpu_num,submit_time,duration\na,v,1,0,10\nb,v,1,86400,10\nc,v,1,9000000,10\n")
    trace = load_helios(path)
    assert list(trace.jobs["submit_time"]) == [0.0, 86400.0, 9e6] and not trace.changed
    ms = int(SUBMIT) * 1000
    path.write_text(f"job_id,vc,gpu_num,submit_time,duration\na,v,1,{ms},10\nb,v,1,{ms + 2000},10\nc,v,1,0,10\n")
    assert list(load_helios(path).jobs["submit_time"]) == [0.0, SUBMIT, SUBMIT + 2]


def test_a_time_in_another_unit_than_its_column_and_one_beyond_range_are_each_counted_so(tmp_path: Path) -> None:
    # (A column of milliseconds holding one time in seconds: read as milliseconds, it was a job of
    # 1970-01-18; 1e13 ms is the year 2286, beyond what a timestamp holds in any unit.)
    ms = int(SUBMIT) * 1000
    path = tmp_path / "philly.csv"
    stamps = [ms, ms + 1000, ms + 2000, int(SUBMIT), int(1e13)]
    path.write_text(PHILLY_HEADER + "\n" + "".join(f"{t},66.0,1,66.0,a\n" for t in stamps))
    trace = load_philly_csv(path)
    assert list(trace.jobs["submit_time"]) == [SUBMIT, SUBMIT + 1, SUBMIT + 2]
    assert trace.rejected == {TIME_IN_ANOTHER_UNIT: 1, TIME_OUT_OF_RANGE: 1}
    # (and the other way round: a column of seconds keeps its seconds, its one millisecond time counted)
    path.write_text(PHILLY_HEADER + "\n" + "".join(f"{t},66.0,1,66.0,a\n" for t in [int(SUBMIT), int(SUBMIT) + 1, ms]))
    trace = load_philly_csv(path)
    assert list(trace.jobs["submit_time"]) == [SUBMIT, SUBMIT + 1] and trace.rejected == {TIME_IN_ANOTHER_UNIT: 1}
