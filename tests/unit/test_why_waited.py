"""`gpuherd why` of a job that waits no more said only "is completed": nothing of why it had
waited, which is what a user asks of the log ("why did my job wait?"). Its waits are now replayed:
the scheduler's own pass on the state of each moment it waited, and the decision that placed it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import msgspec
import pandas as pd
import pytest

from apps.cli import build_parser
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.log.files import write_log_file
from services.analytics.traces import load_philly_csv, submissions
from services.scheduler import explain
from services.scheduler.explain import NEXT_PASS, wait_history

ONE_NODE = ClusterSpec(vcs={"a": VcSpec(nodes=1)}, gpus_per_node=4)


def _log(tmp_path: Path, rows: list[tuple[int, float, int]], policy: str = "fifo") -> list:
    path = tmp_path / "philly.csv"
    lines = ["timestamp,duration,num_gpus,gpu_time,cluster"]
    for t, duration, gpus in rows:
        stamp = pd.Timestamp("2017-10-01", tz="UTC") + pd.Timedelta(seconds=t)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S},{duration},{gpus},{duration * gpus},a")
    path.write_text("\n".join(lines) + "\n")
    return simulate(submissions(load_philly_csv(path)), ONE_NODE, policy).records


def _job_of(records: list, n: int) -> str:
    return [r.event.job for r in records if isinstance(r.event, ev.JobSubmitted)][n]


def test_a_job_that_waited_for_gpus_is_told_why_and_what_placed_it(tmp_path: Path) -> None:
    records = _log(tmp_path, [(0, 5000.0, 4), (10, 100.0, 2)])
    first, second = _job_of(records, 0), _job_of(records, 1)
    placed = next(r.event for r in records if isinstance(r.event, ev.JobPlaced) and r.event.job == second)
    freed = next(r.event for r in records if isinstance(r.event, ev.JobFinished) and r.event.job == first)

    (wait,) = wait_history(records, second)
    submitted = next(r.event for r in records if isinstance(r.event, ev.JobSubmitted) and r.event.job == second)
    assert (wait.since, wait.until) == (submitted.at, placed.at)
    assert wait.ended_by == f"placed on {placed.allocations[0].node}"
    assert wait.placed_by.startswith(f"{placed.id}, decided on JobFinished of {first}")
    assert freed.at <= placed.at
    held, last = wait.spans[0], wait.spans[-1]
    assert held.kind != NEXT_PASS and "GPU" in held.detail, held  # it waited for GPUs the first job held
    assert last.kind == NEXT_PASS and last.end == placed.at
    assert held.start == wait.since and held.end == last.start  # the reasons cover the wait, one after another
    assert wait.passes_replayed == wait.passes_in_wait > 0

    (no_wait,) = wait_history(records, first)  # placed on the pass after its submission
    assert no_wait.until == no_wait.since and [s.kind for s in no_wait.spans] == [NEXT_PASS]


def test_a_preempted_job_has_a_wait_per_queueing(tmp_path: Path) -> None:
    records = _log(tmp_path, [(0, 5000.0, 4), *((10 + i, 100.0, 2) for i in range(4))], policy="srtf")
    requeued = [r.event.job for r in records if isinstance(r.event, ev.JobRequeued)]
    assert requeued, "the long job is preempted by the short ones under srtf"
    job = requeued[0]
    waits = wait_history(records, job)
    assert len(waits) == 1 + requeued.count(job)
    assert [w.attempt for w in waits] == list(range(len(waits)))
    assert all(w.ended_by.startswith("placed on") for w in waits)
    assert all(a.until is not None and a.until <= b.since for a, b in itertools.pairwise(waits))


def test_a_long_wait_is_replayed_at_evenly_spread_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _log(tmp_path, [(0, 5000.0, 4), *((10 + i, 100.0, 1) for i in range(12))])
    monkeypatch.setattr(explain, "MAX_PASSES_REPLAYED", 3)
    (wait,) = wait_history(records, _job_of(records, 12))
    assert wait.passes_replayed == 3 < wait.passes_in_wait
    assert wait.spans[-1].kind == NEXT_PASS  # the last pass of the wait is always among them


def test_why_of_a_log_file_prints_the_waits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = _log(tmp_path, [(0, 5000.0, 4), (10, 100.0, 2)])
    path = tmp_path / "events.jsonl"
    write_log_file(records, path)
    second = _job_of(records, 1)

    args = build_parser().parse_args(["why", second, "--log", str(path), "--json"])
    assert args.func(args) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["status"] == "completed" and len(answer["waits"]) == 1
    assert answer["waits"][0]["ended_by"].startswith("placed on")

    args = build_parser().parse_args(["why", second, "--log", str(path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "wait 1:" in out and "placed by scheduler:" in out and "the scheduler's reasons" in out
    args = build_parser().parse_args(["why", _job_of(records, 0), "--log", str(path)])
    assert args.func(args) == 0
    assert "wait 1: none - placed on" in capsys.readouterr().out


def test_a_log_that_ends_while_the_job_waits_says_so(tmp_path: Path) -> None:
    records = _log(tmp_path, [(0, 5000.0, 4), (10, 100.0, 2)])
    second = _job_of(records, 1)
    placed = next(i for i, r in enumerate(records) if isinstance(r.event, ev.JobPlaced) and r.event.job == second)
    for cut in (placed, placed - 1):  # the log ends just before the placement, or one record earlier
        (wait,) = wait_history(records[:cut], second)
        assert wait.until is None and wait.ended_by == "still waiting at the log's end"
        assert wait.spans and wait.spans[0].kind != NEXT_PASS
    (wait,) = wait_history(records[: placed + 1], second)  # the placement is the log's last record
    assert wait.ended_by.startswith("placed on") and wait.placed_by


def test_why_of_a_job_waiting_at_the_log_s_end_replays_its_waits_only_with_history(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = _log(tmp_path, [(0, 5000.0, 4), (10, 100.0, 2)])
    second = _job_of(records, 1)
    placed = next(i for i, r in enumerate(records) if isinstance(r.event, ev.JobPlaced) and r.event.job == second)
    path = tmp_path / "cut.jsonl"
    write_log_file(records[: placed - 1], path)  # before the pass that placed it: it waits for the GPUs

    def why(*more: str) -> dict:
        args = build_parser().parse_args(["why", second, "--log", str(path), "--json", *more])
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    now = why()
    assert now["status"] == "pending" and now["position"] == 1 and now["waiting"] == 1
    assert "GPU" in now["why"] and "waits" not in now  # (its pass now says why: nothing is replayed)
    history = why("--history")
    assert {k: v for k, v in history.items() if k != "waits"} == now
    (wait,) = history["waits"]
    assert wait["until"] is None and wait["passes_replayed"] == wait["passes_in_wait"] > 0
    assert wait["spans"] and wait["spans"][0]["kind"] == now["kind"]


def test_why_of_a_job_the_log_never_held_says_so(tmp_path: Path) -> None:
    records = _log(tmp_path, [(0, 100.0, 1)])
    path = tmp_path / "events.jsonl"
    write_log_file(records, path)
    args = build_parser().parse_args(["why", "j-none", "--log", str(path)])
    with pytest.raises(GpuherdError, match="no job 'j-none'"):
        args.func(args)


def test_why_of_a_job_the_next_pass_places_replays_its_wait_so_far(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = _log(tmp_path, [(0, 100.0, 1)])
    job = _job_of(records, 0)
    submitted = next(i for i, r in enumerate(records) if isinstance(r.event, ev.JobSubmitted))
    path = tmp_path / "cut.jsonl"
    write_log_file(records[: submitted + 1], path)  # the log ends on its submission: nothing holds it back
    args = build_parser().parse_args(["why", job, "--log", str(path), "--json"])
    assert args.func(args) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["status"] == "pending" and answer["why"].startswith("nothing holds it back")
    (wait,) = answer["waits"]
    assert wait["until"] is None and [span["kind"] for span in wait["spans"]] == [NEXT_PASS]


def _why_json(path: Path, job: str, capsys: pytest.CaptureFixture[str]) -> dict:
    args = build_parser().parse_args(["why", job, "--log", str(path), "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_a_job_that_ended_stays_ended_though_a_later_submission_reuses_its_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(A hand-built log: intake never accepts an id twice.) The fold the answer comes from holds the
    ended job and ignores the second submission; the scheduler's own fold forgets ended jobs, and
    took it for a new, waiting one."""
    records = _log(tmp_path, [(0, 100.0, 1)])
    submitted = next(r.event for r in records if isinstance(r.event, ev.JobSubmitted))
    again = msgspec.structs.replace(submitted, id="hand-made", at=records[-1].event.at + 1)
    path = tmp_path / "events.jsonl"
    write_log_file([*records, Record(len(records) + 1, again)], path)
    answer = _why_json(path, submitted.job, capsys)
    assert answer["status"] == "completed" and "kind" not in answer


def test_a_waiting_job_whose_placement_the_fold_ignored_is_answered_by_its_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A placement of an attempt the job never had ends no wait in the fold: the job waits, and its
    pass says why (its waits only with --history), whatever a first read took that placement for."""
    records = _log(tmp_path, [(0, 5000.0, 4), (10, 100.0, 2)])
    second = _job_of(records, 1)
    placed = next(i for i, r in enumerate(records) if isinstance(r.event, ev.JobPlaced) and r.event.job == second)
    stale = msgspec.structs.replace(records[placed].event, id="scheduler:999999:0", attempt=99)
    path = tmp_path / "events.jsonl"
    write_log_file([*records[: placed - 1], Record(placed, stale)], path)
    answer = _why_json(path, second, capsys)
    assert answer["status"] == "pending" and "GPU" in answer["why"] and "waits" not in answer
