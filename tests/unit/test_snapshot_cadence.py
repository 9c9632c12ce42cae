"""When a fold's snapshot is due: counted in events folded, not in the distance between positions,
and never sooner than its last one's cost allows."""

from __future__ import annotations

import pytest

from gpuherd.log.pages import PAGE_SLOTS
from gpuherd.runtime import snapshots
from gpuherd.runtime.snapshots import Cadence


def test_a_snapshot_is_due_after_every_events_however_far_apart_their_positions() -> None:
    cadence = Cadence(every=3, interval_s=3600.0)
    positions = [PAGE_SLOTS * n for n in range(1, 10)]  # one event a message: positions 1000 apart
    due = []
    for position in positions:
        cadence.folded()
        if cadence.due(position):
            due.append(position)
            cadence.taken(position)
    assert due == [positions[2], positions[5], positions[8]]


def test_nothing_folded_since_is_never_due() -> None:
    cadence = Cadence(every=1, interval_s=0.0)
    cadence.taken(5000)
    assert not cadence.due(5000)
    cadence.folded()
    assert cadence.due(5001)


def test_a_costly_snapshot_puts_the_next_off_by_its_cost_over_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A state that took 0.1 s to snapshot, with snapshots allowed 2% of the time: the next is due
    5 s later at the earliest, however many events were folded; then as usual."""
    clock = [1000.0]
    monkeypatch.setattr(snapshots.time, "monotonic", lambda: clock[0])
    cadence = Cadence(every=10, interval_s=3600.0, share=0.02)
    cadence.taken(100, cost_s=0.1)
    cadence.folded(50)
    clock[0] += 4.9
    assert not cadence.due(150)
    clock[0] += 0.2
    assert cadence.due(150)
    cadence.taken(150)  # a cheap one: no wait
    cadence.folded(10)
    assert cadence.due(160)
