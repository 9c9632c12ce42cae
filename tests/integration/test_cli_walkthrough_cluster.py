"""CLI commands that answered wrongly on a live log (the session's NATS, events written by hand):
``cancel`` of a job that had ended said "cancel requested" and exited 0 (the scheduler's refusal was
in the log, unseen); ``events --job/--type --last N`` filtered the log's last N events, often to
nothing; ``undrain`` of a node that was not drained said "undrained" and recorded it."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import pytest

from apps.cli import build_parser
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import open_log
from tests.helpers import finish, node, submit, tick


def _fresh(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def _append(url: str, events: list[ev.Event]) -> None:
    async def run() -> None:
        log_ = await open_log(url, name="walkthrough", persistent=False)
        try:
            await log_.append(events)
        finally:
            await log_.close()

    asyncio.run(run())


def _events(url: str) -> list[ev.Event]:
    async def run() -> list[ev.Event]:
        log_ = await open_log(url, name="walkthrough", persistent=False)
        try:
            return [r.event for r in await log_.read_all()]
        finally:
            await log_.close()

    return asyncio.run(run())


def _run(url: str, *argv: str) -> int:
    args = build_parser().parse_args(["--nats-url", url, *argv])
    return args.func(args)


def test_cancel_of_a_job_that_has_ended_says_so_and_requests_nothing(nats_url: str, capsys: Any) -> None:
    done, waiting = _fresh("jdone"), _fresh("jwait")
    _append(nats_url, [submit(done, at=1.0), finish(done, at=2.0, outcome="failed"), submit(waiting, at=3.0)])
    with pytest.raises(GpuherdError, match=rf"nothing to cancel: job {done} has already ended \(failed\)"):
        _run(nats_url, "cancel", done)
    assert not [e for e in _events(nats_url) if isinstance(e, ev.JobCancelRequested) and e.job == done]
    assert _run(nats_url, "cancel", waiting) == 0  # (a job still waiting: requested, as before)
    assert f"cancel requested for {waiting}" in capsys.readouterr().out


def test_events_last_n_counts_only_the_events_that_match(nats_url: str, capsys: Any) -> None:
    """``events --job J --last 1`` (or ``--type``): the log's last event filtered after printed nothing."""
    job = _fresh("jev")
    _append(nats_url, [submit(job, at=1.0), *(tick(2.0 + i) for i in range(40))])
    capsys.readouterr()
    assert _run(nats_url, "events", "--job", job, "--last", "1", "--json") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]  # (not log lines)
    assert len(lines) == 1 and '"JobSubmitted"' in lines[0] and job in lines[0], lines


def test_undrain_of_a_node_that_is_not_drained_says_so_and_records_nothing(nats_url: str, capsys: Any) -> None:
    name = _fresh("wn")
    _append(nats_url, [node(name, 2)])
    with pytest.raises(GpuherdError, match=rf"node {name} is not drained \(it is up\).*nothing to undrain"):
        _run(nats_url, "undrain", name)
    assert not [e for e in _events(nats_url) if isinstance(e, ev.NodeUndrained) and e.node == name]
    assert _run(nats_url, "drain", name) == 0
    assert _run(nats_url, "undrain", name) == 0  # (drained: undrained, as before)
    assert f"undrained {name}" in capsys.readouterr().out
    assert [e for e in _events(nats_url) if isinstance(e, ev.NodeUndrained) and e.node == name]


def test_cancel_of_an_array_whose_jobs_have_all_ended_is_an_error_as_of_one_job(nats_url: str) -> None:
    array = _fresh("a")
    jobs = []
    for index in range(2):
        job = submit(f"{array}_{index}", at=1.0)
        member = ev.ArrayMember(array=array, index=index, size=2)
        jobs.append(msgspec.structs.replace(job, spec=msgspec.structs.replace(job.spec, array_of=member)))
    _append(nats_url, [*jobs, *(finish(j.job, at=2.0) for j in jobs)])
    with pytest.raises(GpuherdError, match=rf"nothing to cancel: the 2 jobs of {array} have all ended"):
        _run(nats_url, "cancel", array)
    assert not [e for e in _events(nats_url) if isinstance(e, ev.JobCancelRequested) and e.job.startswith(array)]
