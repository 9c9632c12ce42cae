"""The live analytics service: the analytics decider on the log, plus two timers.

- ``AnalyticsTicked`` every ``--tick`` seconds while energy saving is on (``--ces``): the decider
  samples demand and decides power on ticks, so time reaches it as an event and a replay
  decides the same.
- Every ``--report-every`` seconds, when ``--report-dir`` is set, the characterization report
  of the jobs seen so far is rewritten there (HTML, PNGs, CSVs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.obs import configure, get_logger
from gpuherd.runtime.runner import DeciderRunner, ExtraTask
from gpuherd.runtime.serve import serve_decider
from gpuherd.runtime.timers import clock_ticker
from gpuherd.service_args import service_parser
from services.analytics.ces import CesParams
from services.analytics.decide import AnalyticsDecider
from services.analytics.jobs import job_table, summarize
from services.analytics.report import write_report
from services.analytics.state import AnalyticsState

log = get_logger("gpuherd.analytics")

JOB_EVENTS = (
    ev.JobSubmitted,
    ev.JobRejected,
    ev.JobStarted,
    ev.JobPreempted,
    ev.JobRequeued,
    ev.JobFinished,
    ev.JobDurationPredicted,
)


def reporter(out_dir: Path, every_s: float) -> ExtraTask:
    """Keep the report current: follow the job events of the log and rewrite the report."""

    async def report(runner: DeciderRunner[AnalyticsState]) -> None:
        seen: list[Record] = []
        dirty = asyncio.Event()

        async def follow() -> None:
            async for record in runner.log.read(1, follow=True):
                if isinstance(record.event, JOB_EVENTS):
                    seen.append(record)
                    dirty.set()

        follower = asyncio.create_task(follow(), name="report-follow")
        try:
            while True:
                await dirty.wait()
                dirty.clear()
                table = job_table(list(seen), name="gpuherd")
                if len(table.jobs):
                    await asyncio.to_thread(write_report, table, out_dir)
                    (out_dir / "summary.json").write_text(json.dumps(summarize(table.jobs), indent=2))
                    log.info("report written", jobs=len(table.jobs), dir=str(out_dir))
                await asyncio.sleep(every_s)
        finally:
            follower.cancel()

    return report


async def serve(
    url: str,
    *,
    ces: CesParams | None,
    tick_s: float,
    report_dir: Path | None,
    report_every_s: float,
    instance: str | None = None,
    metrics_port: int | None = None,
) -> None:
    extra: list[ExtraTask] = []
    if ces is not None:
        extra.append(clock_ticker(ev.AnalyticsTicked, tick_s))
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        extra.append(reporter(report_dir, report_every_s))

    def setup(runner: DeciderRunner[AnalyticsState]) -> None:
        runner.metrics.watch_cluster(lambda: runner.state)

    await serve_decider(
        url,
        AnalyticsDecider(ces=ces),
        extra_tasks=extra,
        instance=instance,
        metrics_port=metrics_port,
        setup=setup,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = service_parser("analytics", "gpuherd analytics: duration predictions, energy saving, reports")
    parser.add_argument("--ces", help='turn on energy saving with these CesParams (JSON; "{}" for defaults)')
    parser.add_argument("--tick", type=float, default=60.0, help="seconds between clock ticks (with --ces)")
    parser.add_argument("--report-dir", help="keep the characterization report current in this folder")
    parser.add_argument("--report-every", type=float, default=300.0)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure("analytics")
    ces = CesParams(**json.loads(args.ces)) if args.ces is not None else None
    report_dir = Path(args.report_dir) if args.report_dir else None
    asyncio.run(
        serve(
            args.nats_url,
            ces=ces,
            tick_s=args.tick,
            report_dir=report_dir,
            report_every_s=args.report_every,
            instance=args.instance,
            metrics_port=args.metrics_port,
        )
    )
