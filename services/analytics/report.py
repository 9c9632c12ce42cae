"""The characterization report: one HTML page, PNG plots, and the CSV tables behind them.

Works on any normalized job table: a public trace or gpuherd's own log
(``jobs.job_table``). Sections appear only when the table has what they
need (no queueing plot for a trace without start times, no time-of-day
pattern for a trace with relative times), and the page says what is missing.
"""

from __future__ import annotations

import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from services.analytics.jobs import NO_VC, gpu_time, utilization
from services.analytics.traces import Trace

SIZE_BINS = [(1, 1, "1"), (2, 4, "2-4"), (5, 8, "5-8"), (9, 32, "9-32"), (33, 10**9, ">32")]
DAYS = ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]


def _cdf(ax: plt.Axes, values: np.ndarray, label: str, *, log: bool = True) -> None:
    values = np.sort(values[np.isfinite(values)])
    if not len(values):
        return
    ax.plot(np.maximum(values, 1e-3) if log else values, np.arange(1, len(values) + 1) / len(values), label=label)
    if log:
        ax.set_xscale("log")
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3)


def _save(fig: plt.Figure, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def size_share(jobs: pd.DataFrame) -> pd.DataFrame:
    """Jobs and GPU-time by job size (GPUs)."""
    held = gpu_time(jobs)
    rows = []
    for lo, hi, label in SIZE_BINS:
        mask = (jobs["gpus"] >= lo) & (jobs["gpus"] <= hi)
        rows.append(
            {
                "gpus": label,
                "jobs": int(mask.sum()),
                "job_share": float(mask.mean()) if len(jobs) else 0.0,
                "gpu_time_share": float(held[mask].sum() / max(held.sum(), 1e-9)),
            }
        )
    return pd.DataFrame(rows)


def user_concentration(jobs: pd.DataFrame) -> pd.DataFrame | None:
    """GPU-time share of the top users (None when the table has no users)."""
    if jobs["user"].isna().all():
        return None
    by_user = gpu_time(jobs).groupby(jobs["user"]).sum().sort_values(ascending=False)
    share = by_user / by_user.sum()
    return pd.DataFrame({"user": share.index, "gpu_time_share": share.values, "cumulative": share.cumsum().values})


def write_report(trace: Trace, out_dir: str | Path, *, capacity: dict[str, int] | None = None) -> Path:
    """Write ``index.html``, PNGs and CSVs into ``out_dir``; returns the page's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = trace.jobs
    sections: list[str] = []
    missing: list[str] = []

    def table_html(df: pd.DataFrame, name: str) -> str:
        df.to_csv(out / f"{name}.csv", index=False)
        return df.to_html(index=False, float_format=lambda v: f"{v:,.3f}", border=0, classes="t") + (
            f'<p class="src"><a href="{name}.csv">{name}.csv</a></p>'
        )

    def section(title: str, body: str) -> None:
        sections.append(f"<h2>{html.escape(title)}</h2>\n{body}")

    # overview
    overview = pd.DataFrame(
        [
            {"": "jobs used", "value": f"{len(jobs):,}"},
            {"": "rows read", "value": f"{trace.rows_read:,}"},
            *({"": f"not used: {why}", "value": f"{n:,}"} for why, n in sorted(trace.rejected.items())),
            *({"": f"changed: {how}", "value": f"{n:,}"} for how, n in sorted(trace.changed.items())),
            {"": "GPU-hours", "value": f"{gpu_time(jobs).sum() / 3600:,.0f}"},
            {"": "VCs", "value": f"{jobs['vc'].nunique():,}"},
            {"": "users", "value": f"{jobs['user'].nunique():,}" if jobs["user"].notna().any() else "not in the data"},
            {"": "single-GPU jobs", "value": f"{(jobs['gpus'] == 1).mean():.1%}"},
        ]
    )
    section("Overview", table_html(overview, "overview"))

    # CDFs
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    _cdf(axes[0], jobs["duration"].to_numpy(dtype="float64"), "duration")
    axes[0].set_xlabel("run time (s)")
    _cdf(axes[1], jobs["gpus"].to_numpy(dtype="float64"), "GPUs")
    axes[1].set_xlabel("GPUs per job")
    queue = jobs["queue"].to_numpy(dtype="float64")
    if np.isfinite(queue).any():
        _cdf(axes[2], queue + 1.0, "queueing")
        axes[2].set_xlabel("queueing delay + 1 (s)")
    else:
        axes[2].text(0.5, 0.5, "no queueing in this data", ha="center", va="center")
        missing.append("queueing delay (the data has no start times)")
    png = _save(fig, out, "cdfs.png")
    levels = [0.25, 0.5, 0.75, 0.95, 0.99]
    quantiles = pd.DataFrame(
        {
            "quantile": ["p25", "p50", "p75", "p95", "p99"],
            "duration_s": jobs["duration"].quantile(levels).to_numpy(),
            "gpus": jobs["gpus"].quantile(levels).to_numpy(),
        }
    )
    if np.isfinite(queue).any():  # (else a column of NaN beside "not shown: queueing delay")
        quantiles["queue_s"] = jobs["queue"].quantile(levels).to_numpy()
    section("Duration, GPU demand and queueing (CDFs)", f'<img src="{png}">' + table_html(quantiles, "quantiles"))

    # GPU-time by size
    shares = size_share(jobs)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    x = np.arange(len(shares))
    ax.bar(x - 0.2, shares["job_share"], 0.4, label="jobs")
    ax.bar(x + 0.2, shares["gpu_time_share"], 0.4, label="GPU time")
    ax.set_xticks(x, shares["gpus"])
    ax.set_xlabel("GPUs per job")
    ax.set_ylabel("share")
    ax.legend()
    section(
        "GPU-time share by job size",
        f'<img src="{_save(fig, out, "size_share.png")}">' + table_html(shares, "size_share"),
    )

    # utilization per VC
    started = jobs[jobs["start_time"].notna()]
    if started.empty:
        started = jobs.assign(start_time=jobs["submit_time"], end_time=jobs["submit_time"] + jobs["duration"])
        note = "<p>No start times in the data: jobs are drawn as if they started on submission (demand, not usage).</p>"
    else:
        note = ""
    vc_capacity = capacity or {}
    # capacity 1 per VC: the "utilization" is then the number of busy GPUs (and ``all``, a share of
    # one GPU per VC, is made the cluster's busy GPUs again)
    unit = {str(vc): 1 for vc in started["vc"].fillna(NO_VC).unique()}
    demand = utilization(started, vc_capacity or unit, log_end=trace.log_end)
    if not vc_capacity and len(demand):
        demand["all"] *= len(unit)
    if len(demand):
        fig, ax = plt.subplots(figsize=(13, 3.8))
        top = started.groupby(started["vc"].fillna(NO_VC))["duration"].sum().sort_values(ascending=False).index[:8]
        when = pd.to_datetime(demand["time"], unit="s") if trace.absolute_time else demand["time"] / 86400.0
        for vc in top:
            if str(vc) in demand:
                ax.plot(when, demand[str(vc)], label=str(vc), lw=0.8)
        ax.set_ylabel("busy GPUs" if not vc_capacity else "utilization")
        ax.set_xlabel("time" if trace.absolute_time else "days from trace start")
        ax.legend(ncol=4, fontsize=7)
        demand.to_csv(out / "vc_usage.csv", index=False)
        title = "Busy GPUs per VC over time (largest 8 VCs)" if not vc_capacity else "Utilization per VC over time"
        section(
            title,
            note
            + f'<img src="{_save(fig, out, "vc_usage.png")}">'
            + '<p class="src"><a href="vc_usage.csv">vc_usage.csv</a></p>',
        )

    # diurnal and weekly
    if trace.absolute_time:
        submit = pd.to_datetime(jobs["submit_time"], unit="s", utc=True)
        hourly = submit.dt.hour.value_counts().reindex(range(24), fill_value=0)
        daily = submit.dt.day_of_week.value_counts().reindex(range(7), fill_value=0)
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.4))
        axes[0].bar(hourly.index, hourly.values)
        axes[0].set_xlabel("hour of day (UTC)")
        axes[0].set_ylabel("submissions")
        axes[1].bar(DAYS, daily.values)
        axes[1].set_ylabel("submissions")
        patterns = pd.DataFrame({"hour": hourly.index, "submissions": hourly.values})
        weekly = pd.DataFrame({"day": DAYS, "submissions": daily.values})
        section(
            "Diurnal and weekly submission patterns",
            f'<img src="{_save(fig, out, "patterns.png")}">'
            + table_html(patterns, "hourly")
            + table_html(weekly, "weekly"),
        )
    else:
        missing.append("time-of-day and weekday patterns (the data has relative times only)")

    # users
    users = user_concentration(jobs)
    if users is not None:
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        ax.plot(np.arange(1, len(users) + 1) / len(users), users["cumulative"])
        ax.set_xlabel("share of users (heaviest first)")
        ax.set_ylabel("share of GPU time")
        ax.grid(alpha=0.3)
        section(
            "Per-user concentration",
            f'<img src="{_save(fig, out, "users.png")}">' + table_html(users.head(20), "top_users"),
        )
    else:
        missing.append("per-user concentration (the data has no users)")

    # final status
    if jobs["state"].notna().any():
        status = jobs["state"].fillna("unknown").value_counts()
        by_state = gpu_time(jobs).groupby(jobs["state"].fillna("unknown")).sum()
        breakdown = pd.DataFrame(
            {
                "state": status.index,
                "jobs": status.values,
                "job_share": status.values / status.sum(),
                "gpu_time_share": (by_state.reindex(status.index) / by_state.sum()).values,
            }
        )
        fig, ax = plt.subplots(figsize=(6.5, 3.4))
        ax.bar(breakdown["state"], breakdown["job_share"])
        ax.set_ylabel("share of jobs")
        section("Final status", f'<img src="{_save(fig, out, "status.png")}">' + table_html(breakdown, "status"))
    else:
        missing.append("final status (the data does not record it)")

    gaps = "".join(f"<li>{html.escape(m)}</li>" for m in missing)
    page = out / "index.html"
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>gpuherd report: {html.escape(trace.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1300px;margin:2em auto}img{max-width:100%}"
        "table.t{border-collapse:collapse;margin:.5em 0}table.t td,table.t th{padding:2px 10px;"
        "border-bottom:1px solid #ddd;text-align:right}.src{font-size:small}</style></head><body>"
        f"<h1>Workload characterization: {html.escape(trace.name)}</h1>"
        f"<p>{html.escape(trace.describe())}</p>"
        + (f"<p>Not shown, because the data lacks it:</p><ul>{gaps}</ul>" if gaps else "")
        + "\n".join(sections)
        + "</body></html>"
    )
    return page
