"""``gpuherd rescales`` and the demo's table: every rescale row says its pause and total, whether its
record was written with every phase (v2), by a simulated agent, or before the phases were complete (v1)."""

from __future__ import annotations

from apps.cli.rescales import phase_cell, rescale_rows, rescale_table
from gpuherd import events as ev
from gpuherd.log import Record


def _resized(generation: int, size: int, at: float) -> ev.JobResized:
    return ev.JobResized(
        id=f"r{generation}",
        at=at,
        job="j",
        attempt=0,
        generation=generation,
        allocations=(ev.Allocation("n1", tuple(range(size))),),
        kind="grow" if generation % 2 else "shrink",
    )


def test_every_rescale_row_says_its_pause_and_total() -> None:
    v1_without_quiesce = (
        b'{"type":"RescaleCompleted","id":"c1","at":13.0,"source":"agent.n1","v":1,"job":"j","attempt":0,'
        b'"generation":1,"node":"n1","world":3,"world_before":1,'
        b'"times":{"decided":10.0,"noticed":11.0,"reformed":12.0,"restored":12.5,"first_step":13.0}}'
    )
    simulated = ev.RescaleCompleted(
        id="c2",
        job="j",
        attempt=0,
        generation=2,
        node="n1",
        world=2,
        world_before=3,
        times=ev.complete_phase_times({"decided": 20.0, "first_step": 20.2}),
    )
    failed = ev.RescaleFailed(id="f3", job="j", attempt=0, generation=3, node="n1", reason="no store")
    log = [
        _resized(1, 3, 10.0),
        ev.decode(v1_without_quiesce),
        _resized(2, 2, 20.0),
        simulated,
        _resized(3, 3, 30.0),
        failed,
        _resized(4, 1, 40.0),  # still under way
    ]
    rows = rescale_rows([Record(seq, e) for seq, e in enumerate(log, 1)])
    assert [r["outcome"] for r in rows][:2] == ["completed", "completed"]
    assert (rows[0]["pause_s"], rows[0]["total_s"]) == (1.0, 3.0)
    assert (rows[1]["pause_s"], rows[1]["total_s"]) == (0.0, 0.2)
    cells = [(phase_cell(row, "pause_s"), phase_cell(row, "total_s")) for row in rows]
    assert cells == [("1.000", "3.000"), ("0.000", "0.200"), ("-", "-"), ("…", "…")]
    assert all(cell for pair in cells for cell in pair)  # never an empty cell
    assert rescale_table(rows, "rescales", compact=True).row_count == 4
