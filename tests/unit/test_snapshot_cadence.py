"""When a fold's snapshot is due: counted in events folded, not in the distance between positions."""

from __future__ import annotations

from gpuherd.log.pages import PAGE_SLOTS
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
