"""Elastic jobs' rescales, read back from the log: what changed, why, and how long each phase took
(``gpuherd rescales``, the demo's summary)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuherd import events as ev
from gpuherd.log import Record

PHASES = ("notice_s", "wait_s", "reform_s", "restore_s", "first_step_s", "pause_s", "total_s")


def rescale_rows(records: Iterable[Record], job: str | None = None) -> list[dict[str, Any]]:
    """One row per generation an elastic job was resized to, in log order."""
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    sizes: dict[tuple[str, int], int] = {}
    for record in records:
        e = record.event
        if isinstance(e, ev.JobPlaced):
            sizes[(e.job, e.attempt)] = sum(len(a.gpus) for a in e.allocations)
        if job is not None and getattr(e, "job", None) != job:
            continue
        if isinstance(e, ev.JobResized):
            size = sum(len(a.gpus) for a in e.allocations)
            rows[(e.job, e.attempt, e.generation)] = {
                "job": e.job,
                "attempt": e.attempt,
                "generation": e.generation,
                "kind": e.kind,
                "gpus": f"{sizes.get((e.job, e.attempt), '?')} -> {size}",
                "decided_at": e.at,
                "outcome": "in flight",
                "reason": e.reason,
            }
            sizes[(e.job, e.attempt)] = size
        elif isinstance(e, ev.RescaleCompleted | ev.RescaleFailed):
            row = rows.get((e.job, e.attempt, e.generation))
            if row is None or row["outcome"] != "in flight":
                continue
            if isinstance(e, ev.RescaleCompleted):
                row["outcome"] = "completed"
                row |= {k: round(v, 3) for k, v in e.durations().items()}
            else:
                row["outcome"] = f"failed: {e.reason}"
    return list(rows.values())


def phase_cell(row: dict[str, Any], phase: str) -> str:
    """A phase's seconds; a rescale that failed or is still under way has none (said so, not left blank).
    Every completed rescale has every phase (``RescaleCompleted`` v2; older records are completed on read)."""
    if phase in row:
        return f"{row[phase]:.3f}"
    return "…" if row["outcome"] == "in flight" else "-"


def rescale_table(rows: list[dict[str, Any]], title: str, *, compact: bool = False) -> Any:
    """A rich table of ``rescale_rows``; ``compact``: the pause and the total only (a narrow terminal)."""
    import time

    from rich.markup import escape  # (a reason is text, never markup: see apps.cli.common.plain)
    from rich.table import Table

    phases = ("pause_s", "total_s") if compact else PHASES
    table = Table(title=title)
    for col in ("job", "gen", "kind", "gpus", "decided", "outcome", *(p.removesuffix("_s") for p in phases)):
        # (the job's id whole on one line, as `why`/`logs` take it; an outcome's reason folds, never "…")
        table.add_column(col, no_wrap=col == "job", overflow="fold" if col in ("job", "outcome") else "ellipsis")
    if not compact:
        table.add_column("why", overflow="fold")
    for row in rows:
        cells = [
            row["job"],
            str(row["generation"]),
            row["kind"],
            row["gpus"],
            time.strftime("%H:%M:%S", time.localtime(row["decided_at"])),
            row["outcome"],
            *(phase_cell(row, p) for p in phases),
        ]
        table.add_row(*map(escape, cells), *(() if compact else (escape(row["reason"]),)))
    return table
