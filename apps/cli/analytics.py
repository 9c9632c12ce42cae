"""``gpuherd sim``, ``predict``, ``ces``, ``report`` and ``export``: history in, insight out.

These commands use the analytics service's modules (traces, prediction, CES, reports) and the
simulator (``apps.sim``); the services themselves never import each other.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpuherd.errors import GpuherdError

console = Console(width=None if sys.stdout.isatty() else 160)  # tables of many columns stay readable in logs


def load_history(source: str, kind: str | None = None, *, completed_runs_only: bool = False) -> Any:
    """A trace file, or a gpuherd log file (``.jsonl``), as a normalized ``Trace``.
    ``completed_runs_only``: of a log, only the jobs that ran to completion (``finished_runs``; the
    rest are counted as not used): a log also holds jobs that never ran or are still running."""
    path = Path(source)
    if path.suffix == ".jsonl":
        from gpuherd.log.files import iter_log_file
        from services.analytics.jobs import job_table
        from services.analytics.traces import finished_runs

        table = job_table(iter_log_file(path), name=path.stem)
        return finished_runs(table) if completed_runs_only else table
    from services.analytics.traces import load_trace

    return load_trace(path, kind)


def _table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(header):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _cluster_spec(args: argparse.Namespace, trace: Any) -> Any:
    from apps.sim.cluster import ClusterSpec
    from services.analytics.traces import vc_peak_demand

    if args.cluster:
        return ClusterSpec.from_file(args.cluster)
    peaks = vc_peak_demand(trace)
    return ClusterSpec.from_peaks(peaks, scale=args.scale, gpus_per_node=args.gpus_per_node, can_borrow=args.can_borrow)


def ces_params(text: str, option: str) -> dict[str, Any]:
    """``--ces`` / ``--params``: CES parameters as a JSON object, checked before anything runs."""
    import msgspec

    from services.analytics.ces import CesParams

    try:
        params = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GpuherdError(
            f"{option} takes a JSON object, e.g. '{{\"buffer_nodes\": 4}}'; got {text!r} ({exc})"
        ) from None
    if not isinstance(params, dict):
        raise GpuherdError(f"{option} takes a JSON object of CES parameters, e.g. {{}}; got {text!r}")
    unknown = sorted(set(params) - set(CesParams.__struct_fields__))
    if unknown:
        known = ", ".join(CesParams.__struct_fields__)
        raise GpuherdError(f"{option}: unknown CES parameters {', '.join(unknown)}; known: {known}")
    try:
        msgspec.convert(params, CesParams)
    except msgspec.ValidationError as exc:
        raise GpuherdError(f"{option}: {exc}") from None
    return params


# -- sim ---------------------------------------------------------------------------------------------


REASONS_SHOWN = 10  # a table lists this many reasons, the most frequent (--json lists every one)


def _reasons_lines(reasons: dict[str, int]) -> list[str]:
    """A line per reason, most frequent first (reasons hold ';': they cannot share a line)."""
    lines = [f"    {count:,}: {reason}" for reason, count in list(reasons.items())[:REASONS_SHOWN]]
    if len(reasons) > REASONS_SHOWN:
        others = sum(list(reasons.values())[REASONS_SHOWN:])
        lines.append(f"    {others:,} more, for {len(reasons) - REASONS_SHOWN:,} other reasons (--json lists them)")
    return lines


def sim_model(args: argparse.Namespace) -> Any:
    """The model ``--model`` names, with the switches given on the command line."""
    from apps.sim.model import HELIOS, MODELS

    checkpoint = args.checkpoint_cost
    if checkpoint is None:
        costs = None  # the model's
    elif checkpoint == "helios":
        costs = HELIOS.checkpoint_costs
    else:
        costs = ((1 << 30, float(checkpoint)),) if float(checkpoint) > 0 else ()
    return MODELS[args.model].with_switches(
        partition_vcs=args.partition_vcs,
        backfill=args.backfill,
        consolidate=args.consolidate,
        per_second=args.per_second,
        checkpoint_costs=costs,
    )


def checkpoint_cost(text: str) -> str:
    """``--checkpoint-cost``: seconds (0: none) or ``helios`` (by size)."""
    if text == "helios":
        return text
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give seconds or 'helios', not {text!r}") from None
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"a checkpoint cost is seconds >= 0, not {text}")
    return str(seconds)


def cmd_sim(args: argparse.Namespace) -> int:
    from apps.cli.common import policy_names
    from apps.sim.elastic import ElasticWorkload, parse_range
    from apps.sim.model import load_estimates
    from apps.sim.run import simulate
    from apps.sim.sweep import cores_each, sweep, workers_for
    from gpuherd.log.files import write_log_file
    from services.analytics import jobs as jobs_mod
    from services.analytics import traces
    from services.analytics.traces import require_jobs

    if not 0 < args.bucket < math.inf:  # (checked before the run: the utilization is computed after it)
        raise GpuherdError(f"--bucket is seconds > 0, got {args.bucket:g}")
    if not 0 < args.scale < math.inf:  # (a cluster of inf or NaN x the peak demand has no number of nodes)
        raise GpuherdError(f"--scale is a factor > 0 of each VC's peak demand, got {args.scale:g}")
    if args.gpus_per_node < 1:
        raise GpuherdError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if args.limit < 0:  # head(-N) would keep all but the last N jobs
        raise GpuherdError(f"--limit takes the number of first jobs to simulate (0: all), got {args.limit}")
    ces = ces_params(args.ces, "--ces") if args.ces is not None else None
    # (Else a trace without rows reads as "a cluster spec needs at least one VC".)
    trace = require_jobs(load_history(args.trace, args.kind), args.trace, "a simulation needs jobs to submit")
    usable, described = len(trace.jobs), trace.describe()  # (what the trace gave, before --limit)
    if args.limit:
        trace.jobs = trace.jobs.head(args.limit)
    # (The run spans at least its jobs' submissions to their ends: a bucket too short for that is
    # refused now, not after the run.)
    least_span = float((trace.jobs["submit_time"] + trace.jobs["duration"]).max() - trace.jobs["submit_time"].min())
    if math.isfinite(least_span):  # (a log's table may lack run times: then its utilization checks)
        jobs_mod.check_buckets(least_span, args.bucket)
    cluster = _cluster_spec(args, trace)
    model = sim_model(args)
    estimates = load_estimates(args.estimates) if args.estimates else None
    policies = policy_names(args.policy)
    elastic_jobs = None
    if args.elastic_share > 0:
        low, high = parse_range(args.elastic_range)
        elastic_jobs = ElasticWorkload(share=args.elastic_share, min_gpus=low, max_gpus=high, seed=args.seed)
    quiet = args.json
    if not quiet:
        console.print(described)
        if len(trace.jobs) < usable:
            console.print(f"--limit: the first {len(trace.jobs):,} of {usable:,} usable jobs are simulated")
        console.print(
            f"cluster: {cluster.total_nodes} nodes, {cluster.total_gpus} GPUs in {len(cluster.vcs)} VCs "
            f"({'may' if cluster.can_borrow else 'may not'} borrow)"
        )
    out_dir = Path(args.out) if args.out else None
    start = trace.origin if trace.absolute_time else 0.0
    at_once = workers_for(len(policies), args.workers)

    def run_policy(policy: str, progress: Callable[[int], None]) -> dict[str, Any]:
        result = simulate(
            traces.submissions(trace, start=start),
            cluster,
            policy,
            predict=not args.no_predict,
            ces=ces,
            tick_s=args.tick,
            on_submit=progress,
            start=start,
            elastic=args.elastic,
            memory=args.memory,
            model=model,
            estimates=estimates,
            workers=cores_each(at_once),
            keep_log=out_dir is not None,  # (no event file: keep only the job table, far less memory)
            elastic_jobs=elastic_jobs,
        )
        table = result.table
        table.name = f"sim-{policy}"
        capacity = {vc: cluster.vc_gpus(vc) for vc in cluster.vcs}
        util = jobs_mod.utilization(table.jobs, capacity, bucket_s=args.bucket, log_end=table.log_end)
        figures = {
            "wall_s": round(result.wall_s, 2),
            "jobs_per_s": round(result.submitted / max(result.wall_s, 1e-9), 1),
            "events": result.events,
            "submitted": result.submitted,
            "rejected": result.rejected,
            "rejected_reasons": table.intake_rejections,  # intake's reason -> submissions it rejected for it
            "mean_utilization": None if (mean := jobs_mod.mean_utilization(util)) is None else round(mean, 4),
            "rescales": int(table.jobs["rescales"].sum()),
            "paused_gpu_s": round(float(table.jobs["paused_gpu_s"].sum()), 1),
            "summary": jobs_mod.summarize(table.jobs),
        }
        if out_dir is not None:  # (written where the run is: its log never crosses between processes)
            target = out_dir / policy
            target.mkdir(parents=True, exist_ok=True)
            for part, records in result.logs.items():  # a partitioned run: one log per VC
                folder = target / part if part else target
                folder.mkdir(parents=True, exist_ok=True)
                write_log_file(records, folder / "events.jsonl")
            table.jobs.to_csv(target / "jobs.csv", index=False)
            util.to_csv(target / "utilization.csv", index=False)
            (target / "summary.json").write_text(json.dumps(jobs_mod.json_safe(figures), indent=2))
        return figures

    results: dict[str, Any] = {}
    began = time.perf_counter()
    with Progress(
        TextColumn("[bold]{task.description}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=quiet,
    ) as progress:
        bars = {policy: progress.add_task(policy, total=len(trace.jobs)) for policy in policies}

        def advance(policy: str, n: int) -> None:
            progress.advance(bars[policy], n)

        for policy, figures in sweep(policies, run_policy, workers=at_once, on_progress=advance):
            results[policy] = figures
            progress.update(bars[policy], visible=False)
            if not quiet:
                console.print(
                    f"{policy}: {figures['submitted']:,} jobs ({figures['rejected']:,} rejected) in "
                    f"{figures['wall_s']:.1f}s, {figures['jobs_per_s']:,.0f} jobs/s, {figures['events']:,} events"
                )
                if figures["rejected_reasons"]:
                    lines = ["  rejected at intake, by reason:", *_reasons_lines(figures["rejected_reasons"])]
                    console.print("\n".join(lines), highlight=False)
    results = {policy: results[policy] for policy in policies}  # (in the order asked, not finished)
    if not quiet and len(policies) > 1:
        console.print(f"{len(policies)} policies in {time.perf_counter() - began:.1f}s, {at_once} at a time")
    if quiet:
        out = {"trace": trace.describe(), "cluster_gpus": cluster.total_gpus, **results}
        console.print_json(json.dumps(jobs_mod.json_safe(out)))
        return 0
    header = ["policy", *jobs_mod.SUMMARY_HEADER[1:], "preemptions", "utilization"]
    header += ["rescales", "paused GPU-s"] if elastic_jobs is not None or args.elastic else []
    rows = []
    for policy, r in results.items():
        row = jobs_mod.summary_rows(r["summary"])[0]
        row[0] = policy
        util = "-" if r["mean_utilization"] is None else f"{r['mean_utilization']:.1%}"  # (None: no job ran)
        rows.append([*row, f"{r['summary']['all']['preemptions']:,}", util])
        if len(header) > len(rows[-1]):
            rows[-1] += [f"{r['rescales']:,}", f"{r['paused_gpu_s']:,.0f}"]
    console.print(_table("all VCs", header, rows))
    if args.per_vc:
        for policy, r in results.items():
            keys = [k for k in r["summary"] if k != "all"]
            console.print(
                _table(f"{policy} per VC", jobs_mod.SUMMARY_HEADER, jobs_mod.summary_rows(r["summary"], keys))
            )
    if out_dir is not None:
        logs = "<policy>/<vc>/events.jsonl (one log per VC)" if model.partition_vcs else "<policy>/events.jsonl"
        console.print(f"wrote {out_dir}/{logs} (replay: gpuherd replay --log ... --audit), jobs.csv")
    return 0


# -- predict / ces / export ------------------------------------------------------------------------------


def cmd_predict(args: argparse.Namespace) -> int:
    from services.analytics import predict
    from services.analytics.traces import require_jobs

    rows = []
    out: dict[str, Any] = {}
    # A log's jobs that never ran, or have not finished, have no duration to learn or to score.
    # (All are loaded and checked first: an empty input is refused before any model is trained.)
    histories = [
        require_jobs(
            load_history(source, args.kind, completed_runs_only=True),
            source,
            "duration prediction needs jobs with a run time (of a log: jobs that completed)",
        )
        for source in args.traces
    ]
    for trace in histories:
        if not args.json:
            console.print(trace.describe())
        acc, _ = predict.evaluate(trace.jobs)
        base = predict.constant_baseline(trace.jobs)
        out[trace.name] = {
            "model": acc.row(),
            "trace_median": base.row(),
            "basis": acc.by_basis,
            "rows": {"read": trace.rows_read, "used": len(trace.jobs), "not_used": trace.rejected},
        }
        for label, a in (("model", acc), ("trace median", base)):
            r = a.row()
            rows.append(
                [
                    trace.name,
                    label,
                    f"{r['jobs']:,}",
                    f"{r['MAE (s)']:,}",
                    f"{r['median rel. error']:.2f}",
                    f"{r['within 2x']:.1%}",
                ]
            )
    if args.json:
        console.print_json(json.dumps(out))
    else:
        header = ["trace", "predictor", "jobs", "MAE s", "median rel. error", "within 2x"]
        console.print(_table("duration prediction (time-ordered: learns only from finished jobs)", header, rows))
    return 0


def cmd_ces(args: argparse.Namespace) -> int:
    from services.analytics import ces

    if not 0 < args.every < math.inf:  # (NaN never came due: no decision at all; inf decided once)
        raise GpuherdError(f"--every is seconds > 0 between the controller's decisions, got {args.every:g}")
    params = ces.CesParams(**ces_params(args.params, "--params")) if args.params else ces.CesParams()
    report = ces.evaluate_sequence(ces.load_node_sequence(args.sequence), params, decide_every_s=args.every)
    if args.json:
        console.print_json(json.dumps(report.__dict__))
    else:
        console.print(_table(f"CES on {args.sequence}", ["", "value"], [list(r) for r in report.rows()]))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    trace = _history_or_live(args)
    from services.analytics.traces import to_helios_csv

    rows = to_helios_csv(trace.jobs, args.output, absolute_time=trace.absolute_time)
    console.print(f"wrote {rows:,} jobs to {args.output} (Helios cluster_log.csv schema)")
    return 0


def _history_or_live(args: argparse.Namespace) -> Any:
    if args.source:
        return load_history(args.source, getattr(args, "kind", None))
    from apps.cli.common import records_of
    from services.analytics.jobs import job_table

    return job_table(records_of(args), name="gpuherd")


def cmd_report(args: argparse.Namespace) -> int:
    trace = _history_or_live(args)
    from services.analytics.report import write_report

    page = write_report(trace, args.output)
    console.print(f"wrote {page}")
    return 0


def add_commands(sub: Any) -> None:
    s = sub.add_parser("sim", help="simulate a trace (or a log) under one or more policies, with the live deciders")
    s.add_argument("trace", help="a trace file (philly.csv, itp cluster*.csv, Alibaba pods, Helios CSV, Philly JSON)")
    s.add_argument("--kind", help="trace format, when the file name and columns do not tell")
    s.add_argument("--policy", default="fifo", help="one policy or a comma-separated list (fifo,sjf,qssf,srtf,las,...)")
    s.add_argument("--cluster", help="cluster spec file (JSON/YAML); default: derived from the trace's VC peaks")
    s.add_argument("--scale", type=float, default=1.0, help="derived cluster: capacity = scale x VC peak demand")
    s.add_argument("--gpus-per-node", type=int, default=8, help="derived cluster: GPUs of each node")
    s.add_argument("--can-borrow", action="store_true", help="VCs may borrow idle GPUs of other VCs")
    s.add_argument("--limit", type=int, default=0, help="only the first N jobs (0: all)")
    s.add_argument("--no-predict", action="store_true", help="no duration predictions (QSSF then ranks by GPUs)")
    s.add_argument("--elastic", action="store_true", help="also run the elastic service (for elastic jobs)")
    s.add_argument(
        "--elastic-share",
        type=float,
        default=0.0,
        metavar="F",
        help="make this seeded share of the trace's jobs elastic (0..1; runs the elastic service)",
    )
    s.add_argument(
        "--elastic-range",
        default="1-8",
        metavar="MIN-MAX",
        help="elastic jobs' sizes, clipped so each job's asked GPUs lie within (default 1-8)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of which jobs are elastic and how they scale")
    s.add_argument("--memory", action="store_true", help="also run the memory broker (for jobs that lease memory)")
    s.add_argument("--ces", help="power idle nodes down: CES params as JSON, e.g. '{\"buffer_nodes\": 4}' or {}")
    s.add_argument("--tick", type=float, default=300.0, help="virtual seconds between clock ticks")
    s.add_argument("--bucket", type=float, default=3600.0, help="utilization time bucket (s)")
    s.add_argument("--per-vc", action="store_true", help="also print per-VC tables")
    s.add_argument(
        "--model",
        choices=["gpuherd", "helios"],
        default="gpuherd",
        help="how the cluster is modelled: gpuherd's own (as live) or the Helios simulator's (all the switches below)",
    )
    switches = s.add_argument_group("model switches (each overrides the model's choice)")
    on_off = argparse.BooleanOptionalAction
    switches.add_argument("--partition-vcs", action=on_off, help="each VC alone on its own nodes")
    switches.add_argument("--backfill", action=on_off, help="later jobs may start ahead of a waiting head")
    switches.add_argument("--consolidate", action=on_off, help="a job on one node, or on whole nodes if larger")
    switches.add_argument(
        "--per-second", action=on_off, help="decide once a second, after its ends and arrivals (whole-second durations)"
    )
    switches.add_argument(
        "--checkpoint-cost",
        type=checkpoint_cost,
        metavar="S",
        help="each preemption costs a restore of S seconds (gpuherd: 3.5, a measured restart), or 'helios': "
        "7 s (1 GPU), 30 s (<= 8), 60 s (more); 0: none",
    )
    switches.add_argument(
        "--no-checkpoint-cost", dest="checkpoint_cost", action="store_const", const="0", help="same as 0"
    )
    s.add_argument("--estimates", help="QSSF: a CSV of job_id,estimate_s to use instead of the duration model")
    s.add_argument(
        "--workers",
        type=int,
        default=0,
        help="policies simulated at a time, each in a process of its own (default: one per core; 1: one by one)",
    )
    s.add_argument("--out", "-o", help="write events.jsonl, jobs.csv, utilization.csv, summary.json per policy here")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=cmd_sim)

    p = sub.add_parser("predict", help="duration prediction accuracy on traces (time-ordered split)")
    p.add_argument("traces", nargs="+", help="trace files (each evaluated on its own)")
    p.add_argument("--kind", help="trace format, when the file name and columns do not tell")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_predict)

    c = sub.add_parser("ces", help="cluster energy saving replayed on a node sequence (time,active,total)")
    c.add_argument(
        "sequence", help="a CSV of time,active,total nodes over time (e.g. the traces' ces/philly_node_sequence.csv)"
    )
    c.add_argument("--params", help='CesParams as JSON, e.g. \'{"buffer_nodes": 20, "seasonal": true}\'')
    c.add_argument("--every", type=float, default=600.0, help="seconds between controller decisions")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.set_defaults(func=cmd_ces)

    for name, func, helptext in (
        ("export", cmd_export, "write a log's (or a trace's) jobs in the Helios cluster_log.csv schema"),
        ("report", cmd_report, "characterization report: HTML page with PNG plots and the tables behind them"),
    ):
        e = sub.add_parser(name, help=helptext)
        e.add_argument("source", nargs="?", help="trace file or log file (.jsonl); default: the live log")
        e.add_argument("--kind", help="trace format, when the file name and columns do not tell")
        e.add_argument("--output", "-o", required=True, help="output file (export) or folder (report)")
        e.add_argument("--nats-url", help="the live log's NATS (default: the cluster file's, or NATS_URL)")
        e.add_argument(
            "--data-dir", default=".gpuherd", help="the local cluster's data folder (where its cluster file is)"
        )
        e.set_defaults(func=func)
