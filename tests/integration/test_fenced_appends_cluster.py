"""Appends that check one subject, in flight together on a clustered (R3) stream.

A clustered stream refuses an append that checks a subject's last sequence while another append
checking that subject is not applied yet (err_code 10164, "wrong last sequence" with no sequence).
Every append of a leader checks its fence: its timer's ticks and its decisions may be in flight
together, and a decider appends while its last append waits for the fsync. Such a refusal is
retried, never taken for a newer leader's fence (which stays a ``ConcurrencyError``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.errors import ConcurrencyError, LogUnavailable
from gpuherd.log import open_log
from gpuherd.natsd import NatsCluster
from gpuherd.runtime.runner import append_reliably
from tests.helpers import submit

pytestmark = pytest.mark.slow


def leader(n: int) -> ev.LeadershipTaken:
    return ev.LeadershipTaken(
        id=f"scheduler:leader:i{n}", at=0.0, source="scheduler", service="scheduler", instance=f"i{n}"
    )


async def test_fenced_appends_in_flight_together_on_a_cluster_all_land(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "nats", size=3).start()
    log_ = None
    try:
        log_ = await asyncio.wait_for(open_log(cluster.url, name="fenced", replicas=3), 120)
        fence = ev.leadership_subject("scheduler")
        first = await append_reliably(log_, [leader(1)], expect={fence: 0})
        expect = {fence: first.seqs[0]}
        busy: list[Exception] = []

        async def one(n: int) -> int:
            while True:  # (raw: what the log reports before append_reliably retries it)
                try:
                    return (await log_.append([submit(f"j{n}", 1)], expect=expect)).seqs[0]
                except LogUnavailable as exc:
                    busy.append(exc)
                    await asyncio.sleep(0.01)

        raw = await asyncio.wait_for(asyncio.gather(*(one(n) for n in range(30))), 60)
        assert len(set(raw)) == 30
        assert busy, "the cluster refused some appends while another checking the fence was in flight"
        assert "not applied yet" in str(busy[0])
        reliable = await asyncio.wait_for(
            asyncio.gather(*(append_reliably(log_, [submit(f"k{n}", 1)], expect=expect) for n in range(30))), 60
        )
        assert len({r.seqs[0] for r in reliable}) == 30, "retried until stored, each once"

        await append_reliably(log_, [leader(2)], expect=expect)  # a newer leader's fence
        with pytest.raises(ConcurrencyError):
            await append_reliably(log_, [submit("stale", 1)], expect=expect)
    finally:
        if log_ is not None:
            await log_.close()
        cluster.stop()
