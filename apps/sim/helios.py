"""The Helios artifact's Philly experiment, as input for both simulators.

The published Helios simulator (HeliosArtifact, "QSSF Service") runs the Philly trace's jobs
submitted from 2017-10-01 to 2017-11-30 23:59, each VC alone on a number of 8-GPU nodes. This
module makes that workload from a normalized trace (``philly.csv``), once, for both sides:

- ``helios_workload``: the jobs it can run (in the window, integer durations of at least 1 s, no
  job larger than its VC: the peer loops forever on either) and the cluster (each VC at ``scale``
  x its peak demand, rounded up to whole nodes);
- ``noisy_estimates``: the peer's QSSF estimates, made as its ``philly_estimate.py`` makes them
  (the true duration with its error distribution), seeded;
- ``write_peer_input``: the peer's input files (``cluster_log.csv``, ``vc_dict_homo.pkl``, and
  its estimator's ``Philly_lgb.csv``); ``peer_results``: its per-job logs, read back.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pandas as pd

from apps.sim.cluster import ClusterSpec
from services.analytics.traces import Trace, vc_peak_demand

WINDOW = ("2017-10-01 00:00:00", "2017-11-30 23:59:00")  # the peer's Philly experiment (UTC)
GPUS_PER_NODE = 8  # the peer's consolidating placer knows only 8-GPU nodes


def helios_workload(
    trace: Trace, *, scale: float = 0.5, vcs: list[str] | None = None, limit: int = 0
) -> tuple[Trace, ClusterSpec]:
    """The jobs both simulators can run and the cluster they run on (see the module's doc)."""
    jobs = trace.jobs
    if trace.absolute_time:
        first, last = (pd.Timestamp(t, tz="UTC").timestamp() for t in WINDOW)
        jobs = jobs[(jobs["submit_time"] >= first) & (jobs["submit_time"] <= last)]
    jobs = jobs[jobs["gpus"] > 0].copy()
    if vcs is not None:
        jobs = jobs[jobs["vc"].isin(vcs)]
    if limit:
        jobs = jobs.head(limit)
    jobs["submit_time"] = jobs["submit_time"].round()
    jobs["duration"] = jobs["duration"].map(lambda d: float(max(1, math.ceil(d))))
    sized = Trace(name=trace.name, jobs=jobs.reset_index(drop=True), rows_read=trace.rows_read, absolute_time=True)
    peaks = vc_peak_demand(sized)
    cluster = ClusterSpec.from_peaks(peaks, scale=scale, gpus_per_node=GPUS_PER_NODE)
    fits = jobs["gpus"] <= jobs["vc"].map(lambda vc: cluster.vc_gpus(str(vc)))
    sized.jobs = jobs[fits].reset_index(drop=True)
    dropped = int((~fits).sum())
    if dropped:
        sized.rejected = {**trace.rejected, "larger than their VC": dropped}
    return sized, cluster


def noisy_estimates(jobs: pd.DataFrame, seed: int = 6) -> dict[str, float]:
    """Each job's duration estimate (job id -> seconds) with the peer's error distribution: within
    10% for 10% of jobs, 10-50% for 40%, 50-100% for 20%, 1-10x for 20%, 10-100x for 10%."""
    rng = random.Random(seed)

    def noisy(x: float) -> float:
        level = rng.uniform(0, 1)
        if level <= 0.1:
            return x + x * rng.uniform(-1, 1) * 0.1
        low, high = (0.1, 0.5) if level <= 0.5 else (0.5, 1) if level <= 0.7 else (1, 10) if level <= 0.9 else (10, 100)
        return x + x * rng.uniform(low, high) * rng.choice((-1, 1))

    # The peer keeps the integer part (and a negative estimate ranks first, as it does there).
    return {str(j): float(int(noisy(float(d)))) for j, d in zip(jobs["job_id"], jobs["duration"], strict=True)}


def write_peer_input(trace: Trace, cluster: ClusterSpec, estimates: dict[str, float], peer_dir: Path) -> Path:
    """The peer's input in ``peer_dir`` (a copy of the peer's code): ``data/cluster_log.csv``,
    ``data/vc_dict_homo.pkl`` and ``estimators/Philly_lgb.csv``; returns the data folder."""
    data = peer_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    jobs = trace.jobs
    log = pd.DataFrame(
        {
            "user": jobs["user"],
            "vc": jobs["vc"],
            "jobname": jobs["job_id"],
            "gpu_num": jobs["gpus"].astype(int),
            "state": "Pass",
            "submit_time": pd.to_datetime(jobs["submit_time"], unit="s").dt.strftime("%Y-%m-%d %H:%M:%S"),
            "duration": jobs["duration"].astype(int),
        }
    )
    log.to_csv(data / "cluster_log.csv", index=False)
    pd.to_pickle({vc: spec.nodes for vc, spec in cluster.vcs.items()}, data / "vc_dict_homo.pkl")
    priorities = pd.DataFrame({"jobname": list(estimates), "priority": [int(s) for s in estimates.values()]})
    (peer_dir / "estimators").mkdir(exist_ok=True)
    priorities.to_csv(peer_dir / "estimators" / "Philly_lgb.csv", index=False)
    return data


def peer_results(log_dir: Path, policy: str, vcs: list[str]) -> pd.DataFrame:
    """The peer's per-job results of a run: one row per job with ``vc``, ``jct`` and ``queue``."""
    frames = [pd.read_csv(log_dir / vc / f"{policy}_consolidate_{vc}_log.csv") for vc in vcs]
    return pd.concat(frames, ignore_index=True)


def peer_summary(jobs: pd.DataFrame) -> dict[str, dict[str, float]]:
    """The peer's average JCT and queueing, overall (``all``) and per VC (named as ``summarize`` names them)."""

    def stats(group: pd.DataFrame) -> dict[str, float]:
        return {"jobs": len(group), "avg_jct_s": group["jct"].mean(), "avg_queue_s": group["queue"].mean()}

    return {"all": stats(jobs), **{str(vc): stats(group) for vc, group in jobs.groupby("vc")}}
