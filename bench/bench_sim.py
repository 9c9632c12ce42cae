"""Trace simulation speed and the policy comparison on philly.csv.

For each policy: the whole trace through the live scheduler and analytics deciders on a virtual
clock. Prints simulated jobs/s and peak memory, checks that two runs of one policy give the same
log (determinism), then the FIFO / SJF (oracle) / QSSF (predicted) / SRTF (oracle) table, overall
and per VC, at the trace's own VC capacity (each VC sized to its peak demand) and at a contended
scale. Baseline for speed: FIFO in the same run. The policies run as a sweep, ``--workers`` at a
time (default one per core, each in a forked process, as ``gpuherd sim --policy a,b,...`` runs
them): the table gives each run's wall time and peak RSS (its own process), their sum (the sweep
one by one) and the sweep's own wall time.

``--against REV`` measures an earlier version of gpuherd (a git revision of this repository,
checked out in a temporary worktree) on the same workload in the same run: each run is a fresh
process of either version, alternating, so both see the same machine; the table gives the wall time
of each and their ratio, and whether the results agree.

    python bench/bench_sim.py [--limit N] [--scales 1.0,0.25] [--policies fifo,sjf,qssf,srtf] [--workers N]
    python bench/bench_sim.py --against f7b0f06 --scales 0.5 [--repeats 2] [--json]
    python bench/bench_sim.py --all-traces [--policies ...] [--json]

``--all-traces``: every policy on every real trace beside the project (``shared_traces``; each at
its contended scale), each simulation a fresh process: wall time per trace and policy against
FIFO's on the same input (target: every policy within 3x FIFO). A run that takes more than
``--cap`` x FIFO's time (at least 120 s) is stopped and reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from shared_traces import SHARED, scale_of

from apps.sim.cluster import ClusterSpec
from apps.sim.helios import helios_workload, noisy_estimates, peer_results, peer_summary, write_peer_input
from apps.sim.model import HELIOS, MODELS
from apps.sim.run import simulate
from apps.sim.sweep import cores_each, sweep, workers_for
from services.analytics.jobs import summarize
from services.analytics.traces import job_id_for, load_trace, submissions, vc_peak_demand
from services.scheduler.policy import POLICIES

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "philly" / "philly.csv"
console = Console(width=170)

# One simulation in a fresh process of the gpuherd checked out at ``root`` (its own API, old or new).
DRIVER = """
import json, os, resource, sys, time
root, trace_path, policy, scale, limit = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
sys.path[:0] = [root + "/libs", root]
if os.path.isdir(root + "/apps"):
    from apps.sim.cluster import ClusterSpec
    from apps.sim.run import simulate
else:  # before apps/ existed
    from gpuherd.sim.cluster import ClusterSpec
    from gpuherd.sim.run import simulate
from services.analytics.jobs import job_table, summarize
from services.analytics.traces import load_trace, submissions, vc_peak_demand
trace = load_trace(trace_path)
if limit:
    trace.jobs = trace.jobs.head(limit)
cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=scale)
try:  # runs that keep no log (their job table built as they go), where the version has them
    result = simulate(submissions(trace, start=trace.origin), cluster, policy, start=trace.origin, keep_log=False)
    table = result.table
except TypeError:
    result = simulate(submissions(trace, start=trace.origin), cluster, policy, start=trace.origin)
    table = job_table(result.records)
summary = summarize(table.jobs)["all"]
print(json.dumps({
    "wall_s": result.wall_s, "events": result.events, "submitted": result.submitted,
    "avg_jct_s": summary["avg_jct_s"], "avg_queue_s": summary["avg_queue_s"],
    "preemptions": summary["preemptions"], "finished": summary["finished"],
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """The repository at ``rev``, checked out in a temporary folder (removed afterwards)."""
    folder = Path(tempfile.mkdtemp(prefix="gpuherd-"))
    path = folder / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True
    )
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def run_in(root: Path, trace: str, policy: str, scale: float, limit: int, timeout: float | None = None) -> dict:
    """One simulation in a fresh process (``subprocess.TimeoutExpired`` after ``timeout`` s: killed)."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(root), trace, policy, str(scale), str(limit)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=False,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise SystemExit(f"the simulation at {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def before_and_after(args: argparse.Namespace) -> None:
    """The same simulations with the version at ``--against`` and with this one, alternating."""
    rows = []
    with worktree(args.against) as old:
        for scale in (float(s) for s in args.scales.split(",")):
            for policy in args.policies.split(","):
                runs: dict[str, list[dict]] = {"before": [], "after": []}
                for _ in range(args.repeats):
                    runs["before"].append(run_in(old, str(Path(args.trace).resolve()), policy, scale, args.limit))
                    runs["after"].append(run_in(ROOT, str(Path(args.trace).resolve()), policy, scale, args.limit))
                before = min(runs["before"], key=lambda r: r["wall_s"])
                after = min(runs["after"], key=lambda r: r["wall_s"])
                rows.append(
                    {
                        "scale": scale,
                        "policy": policy,
                        "before_wall_s": round(before["wall_s"], 2),
                        "after_wall_s": round(after["wall_s"], 2),
                        "speedup": round(before["wall_s"] / after["wall_s"], 2),
                        "before_avg_jct_s": before["avg_jct_s"],
                        "after_avg_jct_s": after["avg_jct_s"],
                        "before_preemptions": before["preemptions"],
                        "after_preemptions": after["preemptions"],
                        "before_peak_rss_mb": round(before["peak_rss_mb"]),
                        "after_peak_rss_mb": round(after["peak_rss_mb"]),
                        "same_results": abs(before["avg_jct_s"] - after["avg_jct_s"]) <= 1e-6 * before["avg_jct_s"]
                        and before["preemptions"] == after["preemptions"],
                    }
                )
    if args.json:
        print(json.dumps({"against": args.against, "runs": rows}))
        return
    table = Table(
        title=f"simulation speed: gpuherd at {args.against} (before) and now (after), best of {args.repeats}",
        title_justify="left",
    )
    for col in ("scale", "policy", "before s", "after s", "after vs before", "avg JCT before / after (s)"):
        table.add_column(col, justify="right")
    table.add_column("preemptions before / after", justify="right")
    table.add_column("peak RSS MB before / after", justify="right")
    for r in rows:
        table.add_row(
            f"{r['scale']}",
            r["policy"],
            f"{r['before_wall_s']:.1f}",
            f"{r['after_wall_s']:.1f}",
            f"{r['speedup']:.2f}x faster" if r["speedup"] >= 1 else f"{1 / r['speedup']:.2f}x slower",
            f"{r['before_avg_jct_s']:,.1f} / {r['after_avg_jct_s']:,.1f}" + ("" if r["same_results"] else " *"),
            f"{r['before_preemptions']:,} / {r['after_preemptions']:,}",
            f"{r['before_peak_rss_mb']:,} / {r['after_peak_rss_mb']:,}",
        )
    console.print(table)
    if not all(r["same_results"] for r in rows):
        console.print("* the results differ (see the closing note of the version for why)")


TARGET_VS_FIFO = 3.0  # every policy's wall time within this x FIFO's on the same input


def all_traces(args: argparse.Namespace) -> None:
    """Wall time of each policy on each shared trace, against FIFO's on the same input, same run."""
    policies = ["fifo", *(p for p in (args.policies or ",".join(POLICIES)).split(",") if p != "fifo")]
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("simulating", total=len(SHARED) * len(policies))
        for name, path in SHARED.items():
            fifo_s = None
            for policy in policies:
                progress.update(task, description=f"{name} {policy}")
                cap = None if fifo_s is None else max(120.0, args.cap * fifo_s)
                row = {"trace": name, "scale": scale_of(name), "policy": policy, "cap_s": cap}
                try:
                    r = run_in(ROOT, str(path), policy, scale_of(name), args.limit, timeout=cap)
                except subprocess.TimeoutExpired:
                    row |= {"finished": False, "wall_s": cap, "vs_fifo": cap / fifo_s}  # type: ignore[operator]
                else:
                    fifo_s = r["wall_s"] if fifo_s is None else fifo_s
                    row |= {
                        "finished": True, "jobs": r["submitted"], "events": r["events"], "wall_s": r["wall_s"],
                        "vs_fifo": r["wall_s"] / fifo_s, "avg_jct_s": r["avg_jct_s"],
                        "preemptions": r["preemptions"], "peak_rss_mb": r["peak_rss_mb"],
                    }  # fmt: skip
                row["met"] = row["finished"] and row["vs_fifo"] <= TARGET_VS_FIFO
                rows.append(row)
                progress.advance(task)
    worst = max(rows, key=lambda r: r["vs_fifo"])
    summary = {"runs": rows, "worst": {k: worst[k] for k in ("trace", "policy", "vs_fifo")}}
    summary["met"] = all(r["met"] for r in rows)
    if args.json:
        print(json.dumps(summary))
        return
    table = Table(title="every policy on every shared trace: simulation wall time against FIFO's", title_justify="left")
    for col in ("trace", "scale", "policy", "jobs", "wall s", "vs fifo", "preemptions", "avg JCT s", "peak RSS MB"):
        table.add_column(col, justify="right")
    for r in rows:
        if not r["finished"]:
            table.add_row(r["trace"], f"{r['scale']}", r["policy"], "", f"> {r['wall_s']:.0f} (stopped)",
                          f"> {r['vs_fifo']:.1f}x", "", "", "")  # fmt: skip
            continue
        table.add_row(
            r["trace"], f"{r['scale']}", r["policy"], f"{r['jobs']:,}", f"{r['wall_s']:.1f}",
            f"{r['vs_fifo']:.2f}x" + ("" if r["met"] else " *"), f"{r['preemptions']:,}",
            f"{r['avg_jct_s']:,.0f}", f"{r['peak_rss_mb']:,.0f}",
        )  # fmt: skip
    console.print(table)
    verdict = "met" if summary["met"] else "not met (*)"
    console.print(f"target: every policy within {TARGET_VS_FIFO:.0f}x FIFO's wall time: {verdict}; worst "
                  f"{worst['trace']} {worst['policy']} {worst['vs_fifo']:.2f}x")  # fmt: skip


def run_peer(peer_dir: Path, data_dir: Path, policy: str, vcs: list[str]) -> tuple[float, dict]:
    """One policy through the Helios simulator (a fresh process in its own folder): wall seconds
    and its summary. Its last step compares all four policies' logs, so a run of one policy fails
    there after its logs are written: only the logs count."""
    log_dir = peer_dir / "log"
    argv = [sys.executable, "simulator.py", "-e", "Philly", "-t", str(data_dir), "-l", str(log_dir), "-s", policy]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=peer_dir, capture_output=True, text=True)
    wall = time.perf_counter() - started
    try:
        return wall, peer_summary(peer_results(log_dir / "Philly", policy, vcs))
    except FileNotFoundError:
        raise SystemExit(f"the peer wrote no {policy} logs (exit {done.returncode}):\n{done.stderr[-2000:]}") from None


def against_peer(args: argparse.Namespace) -> None:
    """The Helios artifact's Philly experiment through its simulator and through ``gpuherd sim``
    with the Helios model, policy by policy, in the same run."""
    trace, cluster = helios_workload(load_trace(args.trace), scale=args.peer_scale, limit=args.limit)
    estimates = noisy_estimates(trace.jobs)
    vcs = list(cluster.vcs)
    Console(stderr=args.json).print(
        f"{trace.describe()}; {len(trace.jobs):,} jobs in the peer's window, {cluster.total_gpus:,} GPUs on "
        f"{cluster.total_nodes} nodes ({len(vcs)} VCs at {args.peer_scale} x their peak demand)"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpuherd-peer-") as tmp:
        peer_dir = Path(tmp) / "peer"
        shutil.copytree(args.peer, peer_dir, ignore=shutil.ignore_patterns("data", "log", "__pycache__"))
        data_dir = write_peer_input(trace, cluster, estimates, peer_dir)
        given = {job_id_for(j): s for j, s in estimates.items()}
        for policy in args.policies.split(","):
            peer_wall, peer = run_peer(peer_dir, data_dir, policy, vcs)
            start = trace.origin
            result = simulate(
                submissions(trace, start=start), cluster, policy, start=start, model=HELIOS,
                estimates=given if policy == "qssf" else None, keep_log=False,
            )  # fmt: skip
            ours = summarize(result.table.jobs)
            rows.append(
                {
                    "policy": policy,
                    "jobs": len(trace.jobs),
                    "peer_jct": peer["all"]["avg_jct_s"],
                    "gpuherd_jct": ours["all"]["avg_jct_s"],
                    "peer_queue": peer["all"]["avg_queue_s"],
                    "gpuherd_queue": ours["all"]["avg_queue_s"],
                    "peer_wall_s": peer_wall,
                    "gpuherd_wall_s": result.wall_s,
                    "per_vc": {
                        vc: {
                            "peer_jct": peer[vc]["avg_jct_s"], "gpuherd_jct": ours[vc]["avg_jct_s"],
                            "peer_queue": peer[vc]["avg_queue_s"], "gpuherd_queue": ours[vc]["avg_queue_s"],
                        }
                        for vc in vcs if vc in peer and vc in ours
                    },
                }
            )  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return
    table = Table(title="the Helios simulator (peer) and gpuherd sim --model helios, same input", title_justify="left")
    for col in ("policy", "peer JCT / queue (s)", "gpuherd JCT / queue (s)", "ratio JCT / queue", "worst VC JCT",
                "wall: peer / gpuherd (s)", "gpuherd x faster"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        worst = max(r["per_vc"].items(), key=lambda kv: abs(kv[1]["gpuherd_jct"] / kv[1]["peer_jct"] - 1))
        table.add_row(
            r["policy"],
            f"{r['peer_jct']:,.0f} / {r['peer_queue']:,.0f}",
            f"{r['gpuherd_jct']:,.0f} / {r['gpuherd_queue']:,.0f}",
            f"{r['gpuherd_jct'] / r['peer_jct']:.4f} / {r['gpuherd_queue'] / max(r['peer_queue'], 1e-9):.4f}",
            f"{worst[0]}: {worst[1]['gpuherd_jct'] / worst[1]['peer_jct']:.3f}",
            f"{r['peer_wall_s']:.1f} / {r['gpuherd_wall_s']:.1f}",
            f"{r['peer_wall_s'] / r['gpuherd_wall_s']:.1f}x",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--scales", default="1.0,0.25")
    parser.add_argument("--policies", help="comma-separated (default fifo,sjf,qssf,srtf; --all-traces: all)")
    parser.add_argument("--all-traces", action="store_true", help="wall time of each policy on each shared trace")
    parser.add_argument("--cap", type=float, default=10.0, help="--all-traces: stop a run after this x FIFO's time")
    parser.add_argument("--determinism", action="store_true", help="run FIFO twice and compare the logs")
    parser.add_argument("--against", help="also run gpuherd at this git revision on the same workload (before/after)")
    parser.add_argument("--repeats", type=int, default=1, help="--against: runs of each version (the best counts)")
    parser.add_argument("--json", action="store_true", help="--against/--peer: print the figures as JSON")
    parser.add_argument("--workers", type=int, default=0, help="policies simulated at a time (default: one per core)")
    parser.add_argument("--model", default="gpuherd", choices=sorted(MODELS), help="how the cluster is modelled")
    parser.add_argument("--peer", help="the Helios simulator's folder (../shared/peers/helios-qssf): side by side")
    parser.add_argument("--peer-scale", type=float, default=0.5, help="--peer: each VC at this x its peak demand")
    args = parser.parse_args()
    if args.all_traces:
        all_traces(args)
        return
    args.policies = args.policies or "fifo,sjf,qssf,srtf"
    if args.peer:
        against_peer(args)
        return
    if args.against:
        before_and_after(args)
        return
    trace = load_trace(args.trace)
    if args.limit:
        trace.jobs = trace.jobs.head(args.limit)
    console.print(trace.describe())
    policies = args.policies.split(",")
    model = MODELS[args.model]
    at_once = workers_for(len(policies), args.workers)
    for scale in (float(s) for s in args.scales.split(",")):
        cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=scale)
        speed = Table(
            title=f"scale {scale}: {cluster.total_gpus} GPUs on {cluster.total_nodes} nodes", title_justify="left"
        )
        for col in ("policy", "jobs", "events", "wall s", "jobs/s", "vs fifo", "peak RSS MB", "preemptions"):
            speed.add_column(col, justify="right")

        def run_policy(policy: str, _: object, cluster: ClusterSpec = cluster) -> dict:
            # Keep what the tables need, not the run: no log, and only figures cross back.
            result = simulate(
                submissions(trace, start=trace.origin), cluster, policy, start=trace.origin, model=model,
                keep_log=False, digest=True, workers=cores_each(at_once),
            )  # fmt: skip
            jobs = result.table.jobs
            return {
                "wall_s": result.wall_s, "digest": result.digest, "summary": summarize(jobs),
                "preemptions": int(jobs["preemptions"].sum()), "submitted": result.submitted,
                "events": result.events, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }  # fmt: skip

        began = time.perf_counter()
        runs = dict(sweep(policies, run_policy, workers=at_once))
        elapsed = time.perf_counter() - began
        walls = {policy: runs[policy]["wall_s"] for policy in policies}
        digests = {policy: runs[policy]["digest"] for policy in policies}
        summaries = {policy: runs[policy]["summary"] for policy in policies}
        for policy in policies:
            r = runs[policy]
            speed.add_row(
                policy,
                f"{r['submitted']:,}",
                f"{r['events']:,}",
                f"{r['wall_s']:.1f}",
                f"{r['submitted'] / r['wall_s']:,.0f}",
                f"{r['wall_s'] / walls[policies[0]]:.2f}x",
                f"{r['peak_rss_mb']:,.0f}",
                f"{r['preemptions']:,}",
            )
        speed.add_row("all, one by one", "", "", f"{sum(walls.values()):.1f}", "", "", "", "")
        speed.add_row(f"the sweep ({at_once} at a time)", "", "", f"{elapsed:.1f}", "", "", "", "")
        console.print(speed)
        if args.determinism:
            t0 = time.perf_counter()
            again = simulate(
                submissions(trace, start=trace.origin), cluster, policies[0], start=trace.origin,
                model=MODELS[args.model], keep_log=False, digest=True,
            )  # fmt: skip
            same = again.digest == digests[policies[0]]
            console.print(
                f"determinism: {policies[0]} run twice -> identical logs: {same} ({time.perf_counter() - t0:.1f}s)"
            )
        table = Table(title=f"scale {scale}: average JCT / average queueing (s)", title_justify="left")
        table.add_column("VC")
        for policy in policies:
            table.add_column(f"{policy} JCT", justify="right")
            table.add_column(f"{policy} queue", justify="right")
        vcs = [
            "all",
            *sorted(
                (k for k in summaries[policies[0]] if k != "all"), key=lambda v: -summaries[policies[0]][v]["jobs"]
            ),
        ]
        for vc in vcs:
            row = [vc]
            for policy in policies:
                s = summaries[policy].get(vc, {})
                row += [f"{s.get('avg_jct_s', float('nan')):,.0f}", f"{s.get('avg_queue_s', float('nan')):,.0f}"]
            table.add_row(*row)
        console.print(table)


if __name__ == "__main__":
    main()
