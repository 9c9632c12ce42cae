"""Public GPU-cluster traces -> one normalized job table, and back out as events or Helios CSV.

Every loader returns a :class:`Trace`: a pandas DataFrame with the columns of
``COLUMNS`` (one row per usable job) and a count of the rows it could not use,
by reason. Nothing is dropped silently: a row with a negative duration, no
GPUs (a count of 0, below 0, or none readable), more GPUs than ``MAX_JOB_GPUS`` or a timestamp
that does not parse is counted under its reason, and
``Trace.describe()`` says how many. So is a row that runs longer than ``MAX_DURATION_S`` (a year:
real traces hold jobs of weeks, the longest 145 days; a run of decades is a unit or a data error, and
simulating it ticked the virtual clock for all of it) or whose times lie outside the years
1677-2262 (what a calendar timestamp holds). A CSV's header repeated further down (files joined end
to end) is counted as a ``repeated header row``, not as a job with bad times. Nor is anything
changed silently: a row asking for a fraction of a GPU (0.5, 1.5) is used at the whole GPUs it would
hold (rounded up: gpuherd schedules whole GPUs; the fraction stays in ``gpu_request``), epoch times
written in milliseconds, microseconds or nanoseconds are converted to seconds (``_epoch``), and a
job with no id is named ``row-<n>`` by its place in the file; each counted under ``Trace.changed``.
Every row that is a job is one job: a row that uses an earlier row's job id with other fields (ids
reset per day, a resubmission logged under its name) is renamed ``<id>-<n>`` (changed), and a row
equal to an earlier one in every field (the same file joined twice) is left out as ``SAME_ROW`` (a
row with no id, as all of a Philly CSV's, only when its equal is in an earlier file of those joined
end to end: equal rows of one file are jobs no id tells apart, ``_copies``).

Times are seconds. Traces with calendar timestamps (Philly, Helios) keep
seconds since the Unix epoch (UTC) and set ``absolute_time``; traces that
only give offsets (ITP, Alibaba) start at their own zero, so time-of-day
patterns are not known for them.

| loader                 | file                                 | what is missing                                    |
|------------------------|--------------------------------------|----------------------------------------------------|
| ``load_philly_csv``    | ``philly/philly.csv`` (Sia artifact) | user, job name, start/end (no queueing), status     |
| ``load_itp``           | ``itp/cluster*.csv``                 | user, VC (the file's cluster is the VC), status     |
| ``load_alibaba_openb`` | ``alibaba-openb/openb_pod_list_*``   | user; fractional GPU share in ``gpu_request``       |
| ``load_helios``        | Helios ``cluster_log.csv`` schema    | job name                                            |
| ``load_philly_json``   | Philly ``cluster_job_log`` JSON      | GPU count is the GPUs of the last attempt           |

Any of them may be gzip-compressed (known by its first bytes, whatever its name). Job states are
read as exports spell them: in any case, ``canceled`` or ``cancelled``, Slurm's ``CANCELLED by N``,
``OUT_OF_MEMORY``, ``NODE_FAIL``, ``PREEMPTED``; one not known is ``<NA>``.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from gpuherd import events as ev
from gpuherd.errors import GpuherdError

COLUMNS: dict[str, str] = {
    "job_id": "string",
    "submit_time": "float64",  # seconds (epoch UTC when absolute_time, else from the trace's start)
    "start_time": "float64",  # NaN when the trace does not say
    "end_time": "float64",
    "duration": "float64",  # run time in seconds
    "queue": "float64",  # start - submit, NaN when unknown
    "gpus": "int64",  # whole GPUs the job holds
    "gpu_request": "float64",  # GPUs asked for, fractional where the trace shares GPUs (Alibaba)
    "cpus": "float64",
    "nodes": "float64",
    "user": "string",
    "vc": "string",
    "name": "string",
    "state": "string",  # completed | failed | cancelled | timeout | running (at trace end) | <NA>
}

_STATES = {
    "completed": "completed",
    "pass": "completed",
    "succeeded": "completed",
    "success": "completed",
    "failed": "failed",
    "node_fail": "failed",
    "boot_fail": "failed",
    "out_of_memory": "failed",
    "oom": "failed",
    "killed": "cancelled",
    "cancelled": "cancelled",
    "canceled": "cancelled",
    "preempted": "cancelled",  # (Slurm: ended by a preemption and not requeued)
    "timeout": "timeout",
    "deadline": "timeout",
    "running": "running",
}


def _state_of(value: object) -> object:
    """A trace's job state -> ``COLUMNS["state"]``'s (``<NA>`` when unknown). Exports spell them in
    any case, Slurm's sacct writes who cancelled ("CANCELLED by 1234"), and "canceled" is as common
    as "cancelled"."""
    if value is None or value is pd.NA or (isinstance(value, float) and np.isnan(value)):
        return pd.NA
    text = str(value).strip().lower().split(" by ", 1)[0].strip().replace(" ", "_").replace("-", "_")
    return _STATES.get(text, pd.NA)


FRACTIONAL_GPUS = "fractional GPU count, rounded up to whole GPUs"
# The most GPUs one job may hold: beyond any cluster (the largest trace job holds 128). A count
# past int64 (1e30, 2**63) wrapped to -9223372036854775808 and was counted as GPUs in use.
MAX_JOB_GPUS = 65_536
TOO_MANY_GPUS = f"GPU count over {MAX_JOB_GPUS:,}"
MAX_DURATION_S = 365 * 86400.0
TOO_LONG = "duration over 365 days"
MAX_TIME_S = pd.Timestamp.max.timestamp()  # (and -MAX_TIME_S: epoch seconds of 1677-2262)
TIME_OUT_OF_RANGE = "a time beyond the years 1677-2262"
ZERO_DURATION = "zero duration (never ran)"
REPEATED_HEADER = "repeated header row"
TIME_IN_ANOTHER_UNIT = "a time in another unit than the rest of its column"
NO_JOB_ID = "no job id, named row-<n> by its place in the file"
SAME_ROW = "the same row again (every field equal to an earlier row's)"
REPEATED_ID = "a job id used by an earlier row, renamed <id>-<n>"


class TraceError(GpuherdError):
    """A trace file that cannot be read at all (missing, unknown format, wrong columns)."""


class NoUsableJobsError(TraceError):
    """A trace or log with no job a command can use: no rows at all, or every row left out."""


@dataclass
class Trace:
    """A normalized job table, what could not be used and what was changed to be used."""

    name: str
    jobs: pd.DataFrame
    rows_read: int
    rejected: dict[str, int] = field(default_factory=dict)
    absolute_time: bool = False
    changed: dict[str, int] = field(default_factory=dict)  # rows used with a value changed, by how
    log_end: float | None = None  # folded from a log: its newest event's time (running jobs count up to it)
    # Folded from a log: intake's reason for each submission it rejected -> how many, most first.
    intake_rejections: dict[str, int] = field(default_factory=dict)

    @property
    def origin(self) -> float:
        return float(self.jobs["submit_time"].min()) if len(self.jobs) else 0.0

    def describe(self) -> str:
        kept = len(self.jobs)
        text = f"{self.name}: {kept:,} of {self.rows_read:,} rows used"
        if self.rejected:
            text += "; not used: " + ", ".join(f"{n:,} {why}" for why, n in sorted(self.rejected.items()))
        if self.changed:
            text += "; changed: " + ", ".join(f"{n:,} {how}" for how, n in sorted(self.changed.items()))
        return text


def require_jobs(trace: Trace, source: str, needs: str) -> Trace:
    """``trace``, unless it has no job to use: then an error that says why (no rows, or why each
    row was left out) and what the command needs."""
    if len(trace.jobs):
        return trace
    found = "it has no rows" if trace.rows_read == 0 else trace.describe()
    raise NoUsableJobsError(f"no usable jobs in {source}: {found}; {needs}")


def finished_runs(trace: Trace) -> Trace:
    """Only the jobs that ran to completion (state ``completed``, a run time > 0): what a duration
    is learned from and scored against. A log's table also holds jobs cancelled before they started
    and jobs still waiting or running at its end, whose run times are 0 or partial; each row left
    out is counted under its reason in ``rejected``, so ``describe()`` says how many and why."""
    jobs = trace.jobs
    completed = jobs["state"].eq("completed").fillna(False).astype(bool)  # (a trace's state may be unknown)
    ran = jobs["duration"] > 0
    rejected = dict(trace.rejected)
    for state, count in jobs.loc[~completed, "state"].fillna("unknown").value_counts(sort=False).items():
        why = f"not completed ({state})"
        rejected[why] = rejected.get(why, 0) + int(count)
    without_run = int((completed & ~ran).sum())
    if without_run:
        rejected["completed without a run time"] = rejected.get("completed without a run time", 0) + without_run
    return replace(trace, jobs=jobs[completed & ran].reset_index(drop=True), rejected=rejected)


def _finish(
    name: str,
    raw: pd.DataFrame,
    rows_read: int,
    *,
    absolute: bool,
    rejected: dict[str, int],
    changes: dict[str, pd.Series] | None = None,
    refused: dict[str, pd.Series] | None = None,
    joined: pd.Series | None = None,
    ids_in_file: bool = True,
) -> Trace:
    """Check and type the normalized columns; rows that cannot be used are counted by reason (a
    loader's own reasons, ``refused``, first). ``raw``'s index is each row's place in the file (from
    0): a job with no id is named ``row-<n>`` by it. ``joined``: which of the files joined end to
    end each row is in (``_read_csv``); ``ids_in_file``: False where the loader named the rows
    (Philly CSV), so no id tells two equal rows apart."""
    df = raw.copy()
    for column in COLUMNS:
        if column not in df:
            df[column] = np.nan
    ids, unnamed = _ids_or_places(df["job_id"])
    fields = [column for column in raw.columns if ids_in_file or column != "job_id"]
    copies = _copies(raw[fields], unnamed | (not ids_in_file), joined)
    df["job_id"] = ids
    changes = {**(changes or {}), NO_JOB_ID: unnamed} if unnamed.any() else changes
    checks = [
        *(refused or {}).items(),
        ("bad or missing submit time", ~np.isfinite(df["submit_time"].astype("float64"))),
        ("bad or missing duration", ~np.isfinite(df["duration"].astype("float64"))),
        ("negative duration", df["duration"].astype("float64") < 0),
        (TOO_LONG, df["duration"].astype("float64") > MAX_DURATION_S),
        (
            TIME_OUT_OF_RANGE,
            (df[["submit_time", "start_time", "end_time"]].astype("float64").abs() > MAX_TIME_S).any(axis=1),
        ),
        # (Helios traces hold jobs cancelled before they ran, of 0 s: intake refuses a run of 0 s.)
        (ZERO_DURATION, df["duration"].astype("float64") == 0),
        # (inf: no whole number of GPUs. Each reason says what the count is: an empty cell, "two" or
        # -1 were all "zero GPUs".)
        ("bad or missing GPU count", ~np.isfinite(df["gpus"].astype("float64"))),
        ("negative GPU count", df["gpus"].astype("float64") < 0),
        ("zero GPUs", df["gpus"].astype("float64") == 0),
        (TOO_MANY_GPUS, df["gpus"].astype("float64") > MAX_JOB_GPUS),
        ("ends before it starts", df["end_time"].astype("float64") < df["start_time"].astype("float64")),
        # (Last: a copy of a row left out for another reason is left out for that reason too.)
        (SAME_ROW, copies),
    ]
    keep = pd.Series(True, index=df.index)
    for why, bad in checks:
        bad = bad & keep
        if bad.any():
            rejected[why] = rejected.get(why, 0) + int(bad.sum())
        keep &= ~bad
    df = df[keep].copy()
    df["job_id"], repeated = _repeats_renamed(df["job_id"])
    if repeated.any():
        changes = {**(changes or {}), REPEATED_ID: repeated}
    # gpuherd schedules whole GPUs: a job asking for part of one holds a whole one (the share asked
    # for stays in gpu_request), where int64 would truncate 0.5 to no GPU at all.
    gpus = df["gpus"].astype("float64")
    fractional = gpus != np.floor(gpus)
    changed: dict[str, int] = {}
    for how, rows in (changes or {}).items():  # (a loader's own changes, counted over the rows used)
        n = int(rows.reindex(df.index, fill_value=False).sum())
        if n:
            changed[how] = n
    if fractional.any():
        changed[FRACTIONAL_GPUS] = int(fractional.sum())
        df["gpus"] = np.ceil(gpus)
    if "queue" not in raw:
        df["queue"] = df["start_time"] - df["submit_time"]
    df = df[list(COLUMNS)].astype(COLUMNS)
    df = df.sort_values(["submit_time", "job_id"], kind="stable").reset_index(drop=True)
    return Trace(name=name, jobs=df, rows_read=rows_read, rejected=rejected, absolute_time=absolute, changed=changed)


def _copies(fields: pd.DataFrame, unnamed: pd.Series, joined: pd.Series | None) -> pd.Series:
    """Which rows copy an earlier row (every field the loader reads equal): the same file joined
    twice, or a log written twice. A row with a job id is one job, so its equal is a copy. Rows with no id
    (``unnamed``: a Philly CSV's are all) can be equal and still two jobs (philly.csv holds 65, a
    sweep's jobs of one size submitted in one second): such a row is a copy only when its equal is
    in an earlier file of those joined end to end (``joined``)."""
    if not len(fields):
        return pd.Series(False, index=fields.index)
    # (One number per distinct row; dropna: a field that is empty in both rows is equal.)
    group = fields.groupby(list(fields.columns), dropna=False, sort=False).ngroup()
    again = group.duplicated()
    if joined is None or not unnamed.any():
        return again & ~unnamed
    part = joined.reindex(fields.index)
    in_a_later_file = part > part.groupby(group).transform("min")
    return again & (~unnamed | in_a_later_file)


def _repeats_renamed(ids: pd.Series) -> tuple[pd.Series, pd.Series]:
    """The job ids of the rows used (in file order), each one an earlier row uses renamed
    ``<id>-2``, ``<id>-3``... (an id the trace does not use), and which were. Intake took a second
    job under one id for the first submitted again (dropped) or, of another spec, refused it. ("-":
    intake ids and NATS subject tokens keep it (``job_id_for``); "#" would be "_", and intake makes
    ``<id>#<step>`` ids itself.)"""
    ids = ids.astype("string")
    repeated = ids.duplicated(keep="first")
    if not repeated.any():
        return ids, repeated
    taken = set(ids)
    last: dict[str, int] = {}  # id -> the last n given it
    renamed = ids.copy()
    for place in ids.index[repeated]:
        base = str(ids[place])
        renamed[place], last[base] = _unused(base, taken, last.get(base, 1) + 1)
    return renamed, repeated


def _unused(base: str, taken: set[str], n: int) -> tuple[str, int]:
    """The first of ``base`` (``n`` 1) and ``<base>-<n>``, from ``n`` up, that ``taken`` lacks, and
    its ``n``; it is taken from then on."""
    while (name := base if n == 1 else f"{base}-{n}") in taken:
        n += 1
    taken.add(name)
    return name, n


def _ids_or_places(ids: pd.Series) -> tuple[pd.Series, pd.Series]:
    """A trace's job ids, each missing or blank one replaced by ``row-<n>`` (its row's place in the
    file, from 1), and which were. (All of them were one id, "None" or "<NA>", and intake refused
    all but the first as resubmissions.) A derived id the trace already uses gets "-2", "-3"...,
    so it stays a job of its own."""
    ids = ids.astype("string")
    unnamed = (ids.isna() | ids.str.strip().eq("")).fillna(True).astype(bool)
    if not unnamed.any():
        return ids, unnamed
    taken = set(ids[~unnamed])
    named = ids.copy()
    for place in ids.index[unnamed]:
        named[place], _ = _unused(f"row-{int(place) + 1}", taken, 1)
    return named, unnamed


# The unit of epoch times known by their size: a time of 1973-5138 is 1e8-1e11 in seconds, 1e11-1e14
# in milliseconds, 1e14-1e17 in microseconds and 1e17-1e20 in nanoseconds.
_EPOCH_UNITS: tuple[tuple[str, float], ...] = (
    ("seconds", 1.0),
    ("milliseconds", 1e3),
    ("microseconds", 1e6),
    ("nanoseconds", 1e9),
)
_EPOCH_LOW = 1e8  # seconds: 1973-03-03. Smaller numbers say nothing of their unit.


@dataclass(frozen=True)
class _Epoch:
    """A column of times read as epoch seconds (``_epoch``)."""

    seconds: pd.Series  # NaN: none, or not readable as a time
    unit: str  # what the column's numbers count: seconds, milliseconds, microseconds or nanoseconds
    converted: pd.Series  # rows whose number was converted from ``unit`` to seconds
    other_unit: pd.Series  # rows whose number is a time in another unit than the column's


def _epoch(series: pd.Series) -> _Epoch:
    """Times -> epoch seconds (UTC). A calendar timestamp is converted (one without a zone is UTC);
    unparseable -> NaN. A number is epoch time in the unit its column is written in, known from the
    size of the column's numbers as a whole: each number from 1e8 up is a time of 1973-5138 in
    exactly one unit (seconds below 1e11, milliseconds below 1e14, microseconds below 1e17,
    nanoseconds below 1e20), and the unit most of them are in is the column's (seconds on a tie, or
    when none is that large). Every number of the column is divided into seconds by it; one of
    another unit's size (seconds among milliseconds) is marked ``other_unit`` for the loader to
    count, not read as a time a thousand times off. Numbers below 1e8 (a 0 or -1 for "none", seconds from a trace's
    start) and above 1e20 decide nothing: a column of only small numbers stays seconds, and a time
    beyond 1677-2262 in its column's unit is still out of range when converted. (pandas takes a
    number for nanoseconds: epoch seconds were read as jobs submitted 1.5 s after 1970; epoch
    milliseconds, as exports from Java or JavaScript write them, were all out of range.)"""
    numeric = pd.to_numeric(series, errors="coerce").astype("float64")
    parsed = pd.to_datetime(series.where(numeric.isna()), errors="coerce", utc=True, format="mixed")
    from_text = (parsed - pd.Timestamp(0, tz="UTC")).dt.total_seconds().astype("float64")
    size = numeric.abs()
    sized = (size >= _EPOCH_LOW) & (size < _EPOCH_LOW * 1e12)
    # (0-3: seconds to nanoseconds; -1: a number too small or too large to say.)
    which = pd.Series(-1, index=series.index)
    which[sized] = (np.log10(size[sized] / _EPOCH_LOW) // 3).clip(0, 3).astype(int)
    counts = np.bincount(which[sized].to_numpy(dtype=int), minlength=len(_EPOCH_UNITS))
    column = int(np.argmax(counts))  # (the first most: seconds on a tie)
    unit, per_second = _EPOCH_UNITS[column]
    seconds = numeric / per_second
    converted = np.isfinite(numeric) & (numeric != 0) & (per_second != 1.0)
    other_unit = sized & (which != column)
    return _Epoch(seconds.where(numeric.notna(), from_text), unit, converted, other_unit)


def _epoch_times(times: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, pd.Series], dict[str, pd.Series]]:
    """A trace's time columns as epoch seconds (``_epoch``, column by column), with the rows whose
    times were converted from another unit (by unit: ``changes`` for ``_finish``) and the rows with a
    time in another unit than the rest of its column (``refused``)."""
    seconds = pd.DataFrame(index=times.index)
    converted: dict[str, pd.Series] = {}
    other_unit = pd.Series(False, index=times.index)
    for name in times.columns:
        read = _epoch(times[name])
        seconds[name] = read.seconds
        if read.converted.any():
            how = f"times in epoch {read.unit}, converted to seconds"
            converted[how] = converted.get(how, pd.Series(False, index=times.index)) | read.converted
        other_unit |= read.other_unit
    return seconds, converted, {TIME_IN_ANOTHER_UNIT: other_unit}


def _must_be_a_file(path: Path) -> None:
    if path.is_dir():
        raise TraceError(f"{path}: a folder, not a trace file (give one of the trace files in it)")
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")


def _gzipped(path: Path) -> bool:
    """Whether ``path`` is gzip-compressed (by its first bytes: traces ship as ``.csv.gz`` and under
    other names)."""
    with path.open("rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _read_csv(path: Path, required: set[str], text: set[str]) -> tuple[pd.DataFrame, dict[str, int], pd.Series]:
    """The CSV at ``path`` (gzip-compressed or not), which must hold the ``required`` columns; the
    ``text`` columns (ids, names) are read as written, never as numbers ("007" is not 7, VC "011"
    not "11.0"). Returns its rows, each indexed by its place in the file (from 0), the rows left
    out as no job, by reason: the header repeated (``_repeated_headers``), and which of the files
    joined end to end each row is in (0, 1 after the first repeated header...)."""
    _must_be_a_file(path)
    try:
        # (skipinitialspace: "a, b" is the fields "a" and "b", as the header's names are stripped below)
        compression = "gzip" if _gzipped(path) else None
        df = pd.read_csv(path, skipinitialspace=True, dtype=dict.fromkeys(text, str), compression=compression)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as exc:
        raise TraceError(f"{path}: not a readable CSV trace ({exc})") from None  # e.g. a row of too many fields
    if not isinstance(df.index, pd.RangeIndex):
        df = _fields_beyond_the_header(path, df)
    df.columns = [str(name).strip() for name in df.columns]
    missing = required - set(df.columns)
    if missing:
        raise TraceError(f"{path}: missing columns {', '.join(sorted(missing))}; it has {', '.join(df.columns)}")
    headers = _repeated_headers(path, df, required)
    joined = headers.cumsum()[~headers]
    if not headers.any():
        return df, {}, joined
    df = df[~headers]
    # (A header's names in a column of numbers made pandas read all of it as text: read again as
    # numbers what pandas would have read so, a column whose every value is one.)
    for name in df.columns:
        if name not in text and not pd.api.types.is_numeric_dtype(df[name]):
            numbers = pd.to_numeric(df[name], errors="coerce")
            if numbers.notna().sum() == df[name].notna().sum():
                df[name] = numbers
    return df, {REPEATED_HEADER: int(headers.sum())}, joined


def _repeated_headers(path: Path, df: pd.DataFrame, required: set[str]) -> pd.Series:
    """Which rows repeat the header: files joined end to end (``cat a.csv b.csv``) hold each file's
    header again, which is no job. Such a row has the ``required`` names each in its own column, and
    each of its other fields is empty or its column's name. A row of the same names in another order
    is refused: the rows after it are of a file whose fields would be read under other names."""
    names = [str(name) for name in df.columns]
    numeric = [pd.api.types.is_numeric_dtype(df[name]) for name in names]
    if any(is_number and df[name].notna().all() for name, is_number in zip(names, numeric, strict=True)):
        return pd.Series(False, index=df.index)  # (a number in every row: no row is of names only)
    cells = pd.DataFrame(
        {
            # (A column of numbers holds no name; a byte-order mark may open a joined file's header.)
            name: (
                pd.Series(pd.NA, index=df.index, dtype="string")
                if is_number
                else df[name].astype("string").str.strip().str.lstrip("\ufeff")
            )
            for name, is_number in zip(names, numeric, strict=True)
        },
        index=df.index,
    )
    empty = cells.isna()
    of_names = (cells.isin(names) | empty).all(axis=1) & (~empty).sum(axis=1).ge(len(required))
    in_place = pd.Series(False, index=df.index)
    for row in df.index[of_names]:
        fields = cells.loc[row]
        given = fields.dropna()
        if not required <= set(given):
            continue  # (a few names where a job's fields should be: counted by why they are bad)
        if (given.index == given.to_numpy()).all():
            in_place[row] = True
            continue
        header = ",".join(names)
        written = ",".join("" if pd.isna(value) else str(value) for value in fields)
        raise TraceError(
            f"{path}: row {int(row) + 1:,} repeats the header in another order ({written}, the header is {header}): "
            "the rows after it would be read under other columns' names; give each file on its own"
        )
    return in_place


def _fields_beyond_the_header(path: Path, df: pd.DataFrame) -> pd.DataFrame:
    """A CSV whose every row holds more fields than its header names: pandas took each row's first
    fields for an index, and every value sat one column left of its name (a duration read as the
    timestamp). Empty extra fields (a delimiter ending each row) are left out; any other is refused."""
    names = [str(c) for c in df.columns]
    extra = df.index.nlevels
    rows = pd.concat([df.index.to_frame(index=False), df.reset_index(drop=True)], axis=1)
    rows.columns = pd.RangeIndex(len(rows.columns))
    beyond = rows.iloc[:, len(names) :].notna().any(axis=1)
    if beyond.any():
        row = int(np.argmax(beyond.to_numpy()))
        raise TraceError(
            f"{path}: row {row + 1:,} has {len(names) + extra} fields, the header names {len(names)} "
            f"({','.join(names)})"
        )
    rows = rows.iloc[:, : len(names)]
    rows.columns = names
    return rows


def load_philly_csv(path: str | Path) -> Trace:
    """The Sia artifact's ``philly.csv``: timestamp,duration,num_gpus,gpu_time,cluster."""
    path = Path(path)
    df, skipped, joined = _read_csv(path, {"timestamp", "duration", "num_gpus", "cluster"}, text={"cluster"})
    times, changes, refused = _epoch_times(pd.DataFrame({"submit_time": df["timestamp"]}))
    out = pd.DataFrame(
        {
            "job_id": [f"philly-{i}" for i in range(len(df))],
            "submit_time": times["submit_time"],
            "duration": pd.to_numeric(df["duration"], errors="coerce"),
            "gpus": pd.to_numeric(df["num_gpus"], errors="coerce"),
            "vc": df["cluster"].astype("string"),
        }
    )
    out["gpu_request"] = out["gpus"].astype("float64")
    rows_read = len(df) + sum(skipped.values())
    return _finish(
        path.stem,
        out,
        rows_read,
        absolute=True,
        rejected=skipped,
        changes=changes,
        refused=refused,
        joined=joined,
        ids_in_file=False,
    )


def load_itp(path: str | Path) -> Trace:
    """An ITP cluster file: job_id,submission_time,duration,num_gpu (seconds from the trace start).
    The VC is the cluster the file describes."""
    path = Path(path)
    df, skipped, joined = _read_csv(path, {"job_id", "submission_time", "duration", "num_gpu"}, text={"job_id"})
    out = pd.DataFrame(
        {
            "job_id": df["job_id"].astype("string"),
            "submit_time": pd.to_numeric(df["submission_time"], errors="coerce"),
            "duration": pd.to_numeric(df["duration"], errors="coerce"),
            "gpus": pd.to_numeric(df["num_gpu"], errors="coerce"),
        }
    )
    out["gpu_request"] = out["gpus"].astype("float64")
    out["vc"] = path.stem
    rows_read = len(df) + sum(skipped.values())
    return _finish(f"itp-{path.stem}", out, rows_read, absolute=False, rejected=skipped, joined=joined)


def load_alibaba_openb(path: str | Path) -> Trace:
    """Alibaba's 2023 GPU pods. ``num_gpu`` GPUs of which each pod uses ``gpu_milli``/1000 (a
    pod with gpu_milli < 1000 shares its GPU): the job holds ``gpus`` = num_gpu whole GPUs and asks
    for ``gpu_request`` = num_gpu x gpu_milli / 1000. Pods never scheduled have no run time; pods
    still running at the end of the trace keep state ``running`` (their duration is a lower bound)."""
    path = Path(path)
    df, rejected, joined = _read_csv(
        path,
        {"name", "num_gpu", "gpu_milli", "creation_time", "deletion_time", "scheduled_time"},
        text={"name", "qos", "pod_phase", "gpu_spec"},
    )
    never = df["scheduled_time"].isna()
    if never.any():
        rejected["never scheduled (no run time)"] = int(never.sum())
    df = df[~never]
    start = pd.to_numeric(df["scheduled_time"], errors="coerce")
    end = pd.to_numeric(df["deletion_time"], errors="coerce")
    gpus = pd.to_numeric(df["num_gpu"], errors="coerce")
    given = pd.to_numeric(df["gpu_milli"], errors="coerce")
    milli = given.fillna(1000).clip(lower=0, upper=1000)
    changes = {  # (gpu_request only: a pod holds its whole GPUs whatever its share)
        "gpu_milli missing or unreadable, taken as a whole GPU (1000)": given.isna(),
        "gpu_milli over 1000, taken as 1000": given > 1000,
        "gpu_milli below 0, taken as 0": given < 0,
    }
    phase = df["pod_phase"].astype("string") if "pod_phase" in df else pd.Series(pd.NA, index=df.index)
    out = pd.DataFrame(
        {
            "job_id": df["name"].astype("string"),
            "submit_time": pd.to_numeric(df["creation_time"], errors="coerce"),
            "start_time": start,
            "end_time": end,
            "duration": end - start,
            "gpus": gpus,
            "gpu_request": gpus * milli / 1000.0,
            "cpus": pd.to_numeric(df.get("cpu_milli"), errors="coerce") / 1000.0,
            "nodes": 1.0,
            "vc": df["qos"].astype("string") if "qos" in df else "default",
            "name": df["name"].astype("string"),
            "state": phase.map(_state_of),
        }
    )
    rows_read = len(df) + sum(rejected.values())
    return _finish("alibaba-openb", out, rows_read, absolute=False, rejected=rejected, changes=changes, joined=joined)


def load_helios(path: str | Path) -> Trace:
    """The Helios ``cluster_log.csv`` schema:
    job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue.
    Times may be calendar strings or epoch seconds (or milliseconds, microseconds, nanoseconds:
    ``_epoch``)."""
    path = Path(path)
    df, skipped, joined = _read_csv(
        path, {"job_id", "vc", "gpu_num", "submit_time", "duration"}, text={"job_id", "user", "vc", "jobname", "state"}
    )
    given = [column for column in ("submit_time", "start_time", "end_time") if column in df]
    times, changes, refused = _epoch_times(df[given])
    out = pd.DataFrame(
        {
            "job_id": df["job_id"].astype("string"),
            "submit_time": times["submit_time"],
            "start_time": times.get("start_time", np.nan),
            "end_time": times.get("end_time", np.nan),
            "duration": pd.to_numeric(df["duration"], errors="coerce"),
            "gpus": pd.to_numeric(df["gpu_num"], errors="coerce"),
            "cpus": pd.to_numeric(df.get("cpu_num"), errors="coerce"),
            "nodes": pd.to_numeric(df.get("node_num"), errors="coerce"),
            "user": df["user"].astype("string") if "user" in df else pd.NA,
            "vc": df["vc"].astype("string"),
            "name": df["jobname"].astype("string") if "jobname" in df else pd.NA,
            "state": df["state"].astype("string").map(_state_of) if "state" in df else pd.NA,
        }
    )
    out["gpu_request"] = out["gpus"].astype("float64")
    if "queue" in df:
        out["queue"] = pd.to_numeric(df["queue"], errors="coerce")
    rows_read = len(df) + sum(skipped.values())
    return _finish(
        path.stem, out, rows_read, absolute=True, rejected=skipped, changes=changes, refused=refused, joined=joined
    )


def load_philly_json(path: str | Path) -> Trace:
    """Philly's ``cluster_job_log``: a JSON list of jobs with status, vc, jobid, user,
    submitted_time and attempts (start_time, end_time, detail: [{ip, gpus}]). The run is the
    first attempt's start to the last attempt's end; GPUs are those of the last attempt."""
    path = Path(path)
    _must_be_a_file(path)
    try:
        data = gzip.decompress(path.read_bytes()) if _gzipped(path) else path.read_bytes()
    except (gzip.BadGzipFile, EOFError) as exc:
        raise TraceError(f"{path}: not a readable gzip file ({exc})") from None
    text = _utf8_text(path, data)
    try:
        jobs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON ({exc})") from None
    except RecursionError:  # (json's decoder recurses once per bracket: "[[[[..." exhausts the stack)
        raise TraceError(f"{path}: not a Philly job log (JSON nested too deeply)") from None
    if not isinstance(jobs, list):
        raise TraceError(f"{path}: expected a JSON list of jobs, got {type(jobs).__name__}")
    rows = []
    for index, entry in enumerate(jobs):
        job, attempts, detail = _philly_json_job(path, index, len(jobs), entry)
        last = attempts[-1] if attempts else {}
        jobid = job.get("jobid")
        rows.append(
            {
                # (No jobid, null or "None", as Philly's log writes what it does not know (its times
                # too): _finish names the job row-<n> by its place in the list.)
                "job_id": None if jobid is None or jobid == "None" else str(jobid),
                "submit_time": job.get("submitted_time"),
                "start_time": attempts[0].get("start_time") if attempts else None,
                "end_time": last.get("end_time"),
                "gpus": sum(len(d.get("gpus") or []) for d in detail),
                "nodes": len(detail),
                "user": job.get("user"),
                "vc": job.get("vc"),
                "state": _state_of(job.get("status")),
            }
        )
    columns = ["job_id", "submit_time", "start_time", "end_time", "gpus", "nodes", "user", "vc", "state"]
    df = pd.DataFrame(rows, columns=columns)
    given = df[["submit_time", "start_time", "end_time"]]
    times, changes, refused = _epoch_times(given.where(given != "None"))
    df[times.columns] = times
    df["duration"] = df["end_time"] - df["start_time"]
    df["gpu_request"] = df["gpus"].astype("float64")
    return _finish(path.stem, df, len(jobs), absolute=True, rejected={}, changes=changes, refused=refused)


def _utf8_text(path: Path, data: bytes) -> str:
    """``data`` read from ``path`` as UTF-8 (less a byte-order mark), else a TraceError that names
    the first bad byte."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        raise TraceError(f"{path}: not UTF-8 text (byte 0x{bad} at offset {exc.start:,})") from None


def _philly_json_job(
    path: Path, index: int, count: int, job: object
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """A Philly job, its attempts and its last attempt's detail (one object per node), each checked
    to be what the format says: a job whose parts are of another type is not a Philly job log."""

    def refuse(what: str, value: object) -> TraceError:
        found = type(value).__name__
        if isinstance(value, list):
            odd = next((v for v in value if not isinstance(v, dict)), None)
            found = f"a list holding {type(odd).__name__}"
        return TraceError(f"{path}: job {index + 1:,} of {count:,} is not a Philly job: {what}, got {found}")

    if not isinstance(job, dict):
        raise refuse("each job is a JSON object", job)
    attempts = job.get("attempts") or []
    if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
        raise refuse("attempts is a list of objects", attempts)
    detail = (attempts[-1].get("detail") if attempts else None) or []
    if not isinstance(detail, list) or not all(isinstance(d, dict) for d in detail):
        raise refuse("an attempt's detail is a list of objects", detail)
    for node in detail:
        gpus = node.get("gpus") or []
        if not isinstance(gpus, list):
            raise TraceError(
                f"{path}: job {index + 1:,} of {count:,} is not a Philly job: a node's gpus is a list, "
                f"got {type(gpus).__name__}"
            )
    return job, attempts, detail


# Each kind of CSV trace (its --kind), known by columns only it has.
_RECOGNIZED: tuple[tuple[str, frozenset[str], Callable[[Path], Trace]], ...] = (
    ("philly", frozenset({"timestamp", "num_gpus", "cluster"}), load_philly_csv),
    ("itp", frozenset({"submission_time", "num_gpu"}), load_itp),
    ("alibaba", frozenset({"gpu_milli", "num_gpu", "creation_time"}), load_alibaba_openb),
    ("helios", frozenset({"gpu_num", "submit_time", "vc"}), load_helios),
)


def load_trace(path: str | Path, kind: str | None = None) -> Trace:
    """Load a trace, choosing the loader by ``kind`` or by the file's name and columns."""
    path = Path(path)
    loaders = {
        "philly": load_philly_csv,
        "philly-json": load_philly_json,
        "itp": load_itp,
        "alibaba": load_alibaba_openb,
        "helios": load_helios,
    }
    if kind is not None:
        if kind not in loaders:
            raise TraceError(f"unknown trace kind {kind!r}; choose one of: {', '.join(loaders)}")
        return loaders[kind](path)
    if path.suffix == ".json" or path.suffixes[-2:] == [".json", ".gz"]:
        return load_philly_json(path)
    _must_be_a_file(path)
    try:
        with gzip.open(path, "rb") if _gzipped(path) else path.open("rb") as f:
            first = _utf8_text(path, f.readline())
    except (gzip.BadGzipFile, EOFError) as exc:
        raise TraceError(f"{path}: not a readable gzip file ({exc})") from None
    # (Read as CSV: names may be quoted or follow ", "; a byte-order mark is no part of the first.)
    header = {name.strip() for name in next(csv.reader([first]), [])} - {""}
    if not header:
        raise TraceError(f"{path}: no header row (the file is empty or its first line blank)")
    for _, columns, load in _RECOGNIZED:
        if columns <= header:
            return load(path)
    known = "; ".join(f"{kind}: {','.join(sorted(columns))}" for kind, columns, _ in _RECOGNIZED)
    raise TraceError(
        f"{path}: columns {', '.join(sorted(header))} match no known job trace (a trace has one row per job; "
        f"each kind is known by these columns: {known}); give --kind if it is one of them"
    )


# -- out of the table ---------------------------------------------------------------------------

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
MAX_JOB_ID = 128  # intake's limit on an intake id, which a trace job's id is


def job_id_for(trace_id: str, n: int = 1) -> str:
    """A gpuherd job id for a trace job (a NATS subject token: no dots or spaces); ``n`` > 1: the
    id of the n-th trace id that gives the same token (``<id>-n``). An id longer than intake takes
    keeps its start and ends with a hash of the whole trace id, so two long ids stay two jobs (cut,
    intake would refuse the job, and the simulation would count it rejected)."""
    token = _TOKEN.sub("_", trace_id)
    suffix = f"-{n}" if n > 1 else ""
    if len(token) + len(suffix) <= MAX_JOB_ID:
        return token + suffix
    hashed = hashlib.blake2b(trace_id.encode(), digest_size=8).hexdigest()
    return f"{token[: MAX_JOB_ID - len(hashed) - 1 - len(suffix)]}_{hashed}{suffix}"


def submissions(trace: Trace, *, start: float = 0.0) -> Iterator[ev.JobSubmitted]:
    """The trace's jobs as the ``JobSubmitted`` events a live cluster writes, in submission order,
    at ``start`` + (submit time - the trace's first submission). Each job runs its trace duration
    (a ``sim`` job), asks for its whole GPUs, and keeps the trace's user, name and VC."""
    origin = trace.origin
    jobs = trace.jobs
    # One id per trace id: two trace ids of one token ("a.b", "a_b") were one intake id, and intake
    # took the second job for the first submitted again (dropped, unsaid). The later one gets "-2",
    # "-3"... (the first keeps its id, and the estimates given for it). (A loaded trace repeats no id:
    # _finish renames a repeated one. A table that does, built otherwise, stays one id: intake judges
    # a resubmission.)
    ids: dict[str, str] = {}  # trace id -> its job id
    used: set[str] = set()
    for row in jobs.itertuples(index=False):
        trace_id = str(row.job_id)
        job = ids.get(trace_id)
        if job is None:
            job = job_id_for(trace_id)
            n = 2
            while job in used:
                job = job_id_for(trace_id, n)
                n += 1
            ids[trace_id] = job
            used.add(job)
        spec = ev.JobSpec(
            name=str(row.name) if not pd.isna(row.name) else "",
            user=str(row.user) if not pd.isna(row.user) else "",
            gpus=int(row.gpus),
            vc=str(row.vc) if not pd.isna(row.vc) else "default",
            duration_s=float(row.duration),
            intake_id=job,
        )
        yield ev.JobSubmitted(
            id=f"trace:{trace.name}:{job}",
            at=start + float(row.submit_time) - origin,
            source=f"trace:{trace.name}",
            job=job,
            spec=spec,
            intake_source=f"trace:{trace.name}",
        )


HELIOS_COLUMNS = [
    "job_id",
    "user",
    "vc",
    "gpu_num",
    "cpu_num",
    "node_num",
    "state",
    "submit_time",
    "start_time",
    "end_time",
    "duration",
    "queue",
]


def to_helios_csv(jobs: pd.DataFrame, path: str | Path, *, absolute_time: bool = True) -> int:
    """Write a normalized job table in the Helios ``cluster_log.csv`` schema; returns the rows
    written. Calendar times are written as ``YYYY-MM-DD HH:MM:SS`` (UTC) when ``absolute_time``."""

    def when(series: pd.Series) -> pd.Series:
        if not absolute_time:
            return series.round().astype("Int64")
        return pd.to_datetime(series, unit="s", utc=True).dt.strftime("%Y-%m-%d %H:%M:%S")

    out = pd.DataFrame(
        {
            "job_id": jobs["job_id"],
            "user": jobs["user"],
            "vc": jobs["vc"],
            "gpu_num": jobs["gpus"],
            "cpu_num": jobs["cpus"].round().astype("Int64"),
            "node_num": jobs["nodes"].round().astype("Int64"),
            "state": jobs["state"].str.upper(),
            "submit_time": when(jobs["submit_time"]),
            "start_time": when(jobs["start_time"]),
            "end_time": when(jobs["end_time"]),
            "duration": jobs["duration"].round().astype("Int64"),
            "queue": jobs["queue"].round().astype("Int64"),
        }
    )
    out.to_csv(path, index=False, columns=HELIOS_COLUMNS)
    return len(out)


def vc_peak_demand(trace: Trace) -> dict[str, int]:
    """Each VC's peak concurrent GPU demand had every job started on submission (submit to
    submit + duration): the capacity at which nobody in the VC would ever wait."""
    peaks: dict[str, int] = {}
    jobs = trace.jobs
    # A job without a VC is submitted to "default" (``submissions``): its demand counts there.
    for vc, group in jobs.groupby(jobs["vc"].fillna("default"), sort=True):
        starts = group["submit_time"].to_numpy()
        ends = starts + group["duration"].to_numpy()
        gpus = group["gpus"].to_numpy()
        times = np.concatenate([starts, ends])
        deltas = np.concatenate([gpus, -gpus])
        order = np.lexsort((deltas, times))  # at equal times, ends (negative) first
        peaks[str(vc)] = int(np.cumsum(deltas[order]).max())
    return peaks
