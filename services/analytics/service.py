"""The analytics service's own loop beside the generic decider shell (``spec.py`` wires it in):
every ``--report-every`` seconds, when ``--report-dir`` is set, the characterization report of the
jobs seen so far is rewritten there (HTML, PNGs, CSVs). (Its timer, ``AnalyticsTicked`` while energy
saving is on, is the shell's.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from gpuherd.obs import get_logger
from gpuherd.runtime.runner import DeciderRunner, ExtraTask
from services.analytics.state import AnalyticsState

log = get_logger("gpuherd.analytics")


def reporter(out_dir: Path, every_s: float) -> ExtraTask:
    """Keep the report current: fold the log into the job table as it grows and rewrite the report
    (at most every ``every_s``) while it does."""

    async def report(runner: DeciderRunner[AnalyticsState]) -> None:
        # pandas and matplotlib load only when a report is asked for: every service's process
        # imports this spec (the registry looks them all up) and would pay for both at its start
        # and at its exit.
        from services.analytics.jobs import JobTable, json_safe, summarize
        from services.analytics.report import write_report

        # Every event goes to the table, which picks the job events it folds: a list of them here
        # had drifted from it (no placements or rescales, so no GPUs held), and any event's time
        # is the log's end, up to which a running job counts.
        folded = JobTable()
        dirty = asyncio.Event()

        async def follow() -> None:
            async for record in runner.log.read(1, follow=True):
                folded.add(record.event)
                dirty.set()

        follower = asyncio.create_task(follow(), name="report-follow")
        try:
            while True:
                await dirty.wait()
                dirty.clear()
                table = folded.trace("gpuherd")
                if len(table.jobs):
                    await asyncio.to_thread(write_report, table, out_dir)
                    (out_dir / "summary.json").write_text(json.dumps(json_safe(summarize(table.jobs)), indent=2))
                    log.info("report written", jobs=len(table.jobs), dir=str(out_dir))
                await asyncio.sleep(every_s)
        finally:
            follower.cancel()

    return report
