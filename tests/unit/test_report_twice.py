"""A report a relay pages may be stored twice (its relay's answer was lost, so its agent appended it
too: ``gpuherd.log.relay``). Every reader takes the first word on a task, so the second copy changes
nothing: whole simulations (every service that takes part, the agents too) with each such report
doubled, at once or later (across elastic parts leaving and coming back), decide exactly what they
decide without."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd
import pytest

from apps.sim.agents import SimAgents
from apps.sim.cluster import ClusterSpec
from apps.sim.elastic import ElasticWorkload
from apps.sim.run import SimResult, simulate
from gpuherd import events as ev
from gpuherd.fold.core import ClusterState
from gpuherd.log import Record
from gpuherd.log.relay import PAGED_REPORTS
from services.analytics.traces import load_trace, submissions, vc_peak_demand

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "philly-sample.csv"
# What ties a decision to its place in the log, which the extra copies move: not what was decided.
_PLACE = ("id", "based_on", "cause")


def _doubling(monkeypatch: pytest.MonkeyPatch, later: int) -> None:
    """The agents append each paged report twice (what they report as they fold the log, and as
    their tasks end): the copy at once (``later`` 0), or with their reports ``later`` outputs on
    (once more was folded: long enough for an elastic part to leave and come back meanwhile)."""
    held: collections.deque[list[ev.Event]] = collections.deque([] for _ in range(later))

    def doubled(out: list[ev.Event]) -> list[ev.Event]:
        copies = [e for e in out if type(e) in PAGED_REPORTS]
        if not later:
            return out + copies
        held.append(copies)
        return held.popleft() + out

    observe, fire = SimAgents.observe, SimAgents.fire

    def observe_twice(
        self: SimAgents, record: Record, state: ClusterState, job_id: str | None, before: Iterable[str], now: float
    ) -> tuple[list[ev.Event], list[Any]]:
        out, timers = observe(self, record, state, job_id, before, now)
        return doubled(out), timers

    def fire_twice(self: SimAgents, kind: str, payload: tuple, state: ClusterState, now: float) -> list[ev.Event]:
        return doubled(fire(self, kind, payload, state, now))

    monkeypatch.setattr(SimAgents, "observe", observe_twice)
    monkeypatch.setattr(SimAgents, "fire", fire_twice)


@functools.cache
def _once(policy: str) -> SimResult:
    return _run(policy)


def _run(policy: str) -> SimResult:
    trace = load_trace(SAMPLE)
    cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=0.3)
    return simulate(
        submissions(trace, start=trace.origin),
        cluster,
        policy,
        start=trace.origin,
        memory=True,
        elastic_jobs=ElasticWorkload(share=0.3, seed=3),
        tick_s=60.0,
    )


def _without_copies(records: list[Record]) -> list[dict[str, Any]]:
    seen: set[str] = set()
    kept = []
    for record in records:
        event = record.event
        if type(event) in PAGED_REPORTS:
            if event.id in seen:
                continue
            seen.add(event.id)
        fields = msgspec.to_builtins(event)
        kept.append({k: v for k, v in fields.items() if k not in _PLACE})
    return kept


@pytest.mark.parametrize("later", [0, 200], ids=["at-once", "later"])
@pytest.mark.parametrize("policy", ["sjf", "srtf"])
def test_every_start_and_end_of_a_task_stored_twice_changes_no_decision(
    monkeypatch: pytest.MonkeyPatch, policy: str, later: int
) -> None:
    once = _once(policy)
    _doubling(monkeypatch, later)
    twice = _run(policy)
    doubled = len(twice.records) - len(once.records)
    reports = sum(type(r.event) in PAGED_REPORTS for r in once.records)
    assert doubled >= reports - 4 * later, "each report was stored twice (but the last few, held back for later)"
    assert _without_copies(twice.records) == _without_copies(once.records)
    kinds = {type(r.event) for r in once.records}
    assert {ev.JobPreempted, ev.RescaleCompleted, ev.MemoryLeaseGranted} & kinds, "preemptions, rescales, leases ran"
    pd.testing.assert_frame_equal(twice.table.jobs, once.table.jobs)
