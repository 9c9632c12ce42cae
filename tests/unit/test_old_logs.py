"""Logs recorded by an earlier version (``tests/fixtures``) still read, fold and audit cleanly."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import pytest

from apps import registry
from apps.registry import make_decider
from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from gpuherd.runtime.decider import replay

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOGS = {"live": ("log-f7b0f06-live.jsonl.gz", "fifo"), "sim": ("log-f7b0f06-sim-srtf-ces.jsonl.gz", "srtf")}


def load(name: str) -> list[Record]:
    with gzip.open(FIXTURES / LOGS[name][0], "rb") as f:
        return [Record(seq, ev.decode(line)) for seq, line in enumerate(f, 1)]


@pytest.mark.parametrize("name", sorted(LOGS))
@pytest.mark.parametrize("decider", registry.auditable())
def test_every_decision_of_an_old_log_is_made_again(name: str, decider: str) -> None:
    records = load(name)
    report = audit(records, make_decider(decider, policy=LOGS[name][1]))
    assert report.ok, report.mismatches[:3]
    if decider == "scheduler":
        assert report.decisions_checked > 30


@pytest.mark.parametrize("name", sorted(LOGS))
def test_an_old_log_folds_for_every_service_and_keeps_its_invariants(name: str) -> None:
    records = load(name)
    assert violations(records) == []
    for service in registry.deciders():
        state = replay(make_decider(service.name), records)
        assert state.seq == len(records) and not state.queue, service.name


def test_what_changed_since_is_upcast_on_read() -> None:
    live = Counter(type(r.event).__name__ for r in load("live"))
    assert live["MemoryTicked"] and live["ElasticTicked"] and "ClockTicked" not in live, "one tick type per service"
    assert all(r.event.unchecked for r in load("live") if isinstance(r.event, ev.Command))
    sim = load("sim")
    assert any(isinstance(r.event, ev.NodeWakeRequested) and r.event.source == "scheduler" for r in sim)
    assert all(r.event.source == "analytics" for r in sim if isinstance(r.event, ev.NodePowerUpRequested))
    assert all(r.event.intake_rules == 1 for r in sim if isinstance(r.event, ev.JobSubmitted))
