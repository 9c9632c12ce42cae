"""``gpuherd logs NAME`` for a name that is no job (a typo, an array's or a workflow's id) said "job
NAME has never been placed, so it has no output yet": now it says there is no such job, or what the
name is and how to see its jobs' output."""

from __future__ import annotations

import argparse
import asyncio

import msgspec
import pytest

from apps.cli import build_parser, jobs
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log.inprocess import InProcessLog
from tests.helpers import node, submit


def _member(job: str, **of: object) -> ev.JobSubmitted:
    e = submit(job, at=1.0)
    return msgspec.structs.replace(e, spec=msgspec.structs.replace(e.spec, **of))


@pytest.fixture(autouse=True)
def log_(monkeypatch: pytest.MonkeyPatch) -> InProcessLog:
    log_ = InProcessLog()
    events: list[ev.Event] = [node("n1", 2), submit("waits", at=1.0)]
    events += [_member(f"arr1_{i}", array_of=ev.ArrayMember(array="arr1", index=i, size=2)) for i in range(2)]
    events += [
        _member(f"wf1-{step}", workflow_of=ev.WorkflowMember(workflow="wf1", name="pipeline", step=step))
        for step in ("prep", "train")
    ]
    asyncio.run(log_.append(events))

    async def opened(args: argparse.Namespace) -> InProcessLog:
        return log_

    monkeypatch.setattr(jobs, "open_cli_log", opened)
    return log_


def _logs(name: str) -> None:
    args = build_parser().parse_args(["logs", name])
    args.func(args)


def test_logs_of_no_job_says_there_is_none() -> None:
    with pytest.raises(GpuherdError, match=r"^no job 'nosuch': see `gpuherd jobs` for the ids$"):
        _logs("nosuch")


def test_logs_of_an_array_says_it_is_one_and_how_to_see_its_jobs_output() -> None:
    with pytest.raises(GpuherdError, match=r"arr1 is an array of 2 jobs \(arr1_0, arr1_1\), not a job") as e:
        _logs("arr1")
    assert "`gpuherd logs arr1_0`" in str(e.value) and "`gpuherd jobs --array arr1`" in str(e.value)


@pytest.mark.parametrize("name", ["wf1", "pipeline"])
def test_logs_of_a_workflow_says_it_is_one(name: str) -> None:
    with pytest.raises(GpuherdError, match=rf"{name} is a workflow of 2 steps \(wf1-prep, wf1-train\), not a job"):
        _logs(name)


def test_logs_of_a_job_not_placed_yet_says_where_it_is() -> None:
    with pytest.raises(GpuherdError, match=r"job waits has never been placed \(it is pending\), so it has no output"):
        _logs("waits")
