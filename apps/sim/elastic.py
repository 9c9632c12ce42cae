"""Elastic jobs in a replayed trace: any trace can be replayed with a seeded share of its jobs
elastic (``gpuherd sim --elastic-share 0.3``), so a cluster with elasticity on is compared with
the same cluster and jobs with it off.

A job made elastic keeps its trace duration as the time it takes at the GPUs it asked for; it may run
on ``min`` to ``max`` GPUs (the range, clipped so the asked size lies within it), and how its
throughput scales is drawn for it: its per-worker throughput at 8 workers is ``efficiency`` of one
worker's (drawn from a range; data-parallel training of real models spans it, from comm-bound
ones to compute-bound ones), as a ring all-reduce of its gradients after its compute
(``gpuherd.scaling``). The job declares that scaling (``JobSpec.scaling``), as a profiled job would,
and the simulated agents run it by it: its work is a number of samples, done faster on more GPUs.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import msgspec

from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.fold import JobState
from gpuherd.scaling import throughput, with_efficiency

STEP_S = 0.1  # one worker's compute per step (only ratios matter: the work is scaled to the trace's duration)


class ElasticWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Which jobs of a trace are elastic, and how they may scale."""

    share: float = 0.3  # of the jobs, drawn by the seed
    min_gpus: int = 1  # the range of sizes, clipped around each job's asked GPUs
    max_gpus: int = 8
    efficiency: tuple[float, float] = (0.55, 0.95)  # per-worker throughput at 8 workers vs 1: drawn from
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ElasticWorkloadError(f"--elastic-share must lie within 0..1, got {self.share}")
        if not 1 <= self.min_gpus <= self.max_gpus:
            raise ElasticWorkloadError(f"--elastic-range wants 1 <= MIN <= MAX, got {self.min_gpus}-{self.max_gpus}")
        low, high = self.efficiency
        if not 0.0 < low <= high <= 1.0:
            raise ElasticWorkloadError(f"efficiency range must lie within (0, 1], got {low}-{high}")


class ElasticWorkloadError(GpuherdError, ValueError):
    """A share or range of elastic jobs that cannot be used."""


def parse_range(text: str) -> tuple[int, int]:
    """``"1-8"`` -> (1, 8)."""
    low, _, high = text.partition("-")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ElasticWorkloadError(f"--elastic-range wants MIN-MAX (e.g. 1-8), got {text!r}") from None


def make_elastic(jobs: Iterable[ev.JobSubmitted], workload: ElasticWorkload) -> Iterator[ev.JobSubmitted]:
    """The trace's jobs, a seeded ``share`` of them elastic. The draw of each job depends on the seed
    and its place in the trace only, so elasticity on and off replay the same jobs."""
    draw = random.Random(workload.seed)
    for job in jobs:
        elastic, efficiency = draw.random() < workload.share, draw.uniform(*workload.efficiency)
        spec = job.spec
        if not elastic or spec.nodes is not None or spec.procs_per_node is not None:
            yield job
            continue
        low, high = min(workload.min_gpus, spec.gpus), max(workload.max_gpus, spec.gpus)
        scaling = with_efficiency(efficiency, 8, 1, STEP_S)
        made = msgspec.structs.replace(spec, elastic=ev.Elastic(min=low, max=high), scaling=scaling)
        yield msgspec.structs.replace(job, spec=made)


# -- running them -----------------------------------------------------------------------------------


class RescaleCosts(msgspec.Struct, frozen=True, kw_only=True):
    """What a rescale costs a running job, as ``bench/bench_elastic.py`` measures it on the example
    CNN (median of 3, this repository's README): from the decision to the first step at the new size
    (the job trains at its old size meanwhile, but for ``pause_s`` when it stands still), for a
    grow onto warm workers (the task's standby, or a node's warm pool), onto cold ones (a new
    interpreter imports torch), and a shrink. A node's warm pool refills ``warm_refill_s`` after a
    worker was taken (the pool waits 2 s, then an interpreter imports torch)."""

    grow_warm_s: float = 0.34
    grow_cold_s: float = 3.49
    shrink_s: float = 0.20
    pause_s: float = 0.06
    warm_refill_s: float = 5.5
    warm_workers: int = 1  # per node (a cpu or nvml agent's default pool)


class Progress(msgspec.Struct, kw_only=True):
    """An elastic job's training, in samples: ``left`` to do, at ``rate`` samples/s from ``since``
    (None: not running), and the rate it ran at before its last rescale."""

    left: float
    rate: float = 0.0
    since: float | None = None


class ElasticRuns:
    """Every simulated elastic job's progress, and the cost of each rescale (its time from decision to
    first step, warm or cold). What it says the agents make of it: when a job's tasks end, when its
    rescale completes and what it measured."""

    def __init__(self, costs: RescaleCosts, bandwidth: float, latency: float) -> None:
        self.costs = costs
        self.bandwidth, self.latency = bandwidth, latency
        self.jobs: dict[tuple[str, int], Progress] = {}  # (job, attempt of its progress) -> progress
        self.by_job: dict[str, Progress] = {}  # carried across attempts: a preempted job checkpoints
        self.pool_taken: dict[str, list[float]] = {}  # node -> when its warm workers were taken
        self.standby_taken: dict[tuple[str, str], float] = {}  # (job, node) -> when its standby was taken

    def rate(self, spec: ev.JobSpec, workers: int) -> float:
        assert spec.scaling is not None
        return throughput(spec.scaling, max(1, workers), max(1, workers), self.bandwidth, self.latency)

    def models(self, job: JobState) -> bool:
        return job.spec.scaling is not None and job.spec.elastic is not None and job.spec.duration_s is not None

    def start(self, job: JobState, now: float) -> float:
        """The job runs from ``now`` at its current size: when it ends."""
        progress = self.by_job.get(job.job)
        if progress is None:  # its work: what its trace duration is at the GPUs it asked for
            left = (job.spec.duration_s or 0.0) * self.rate(job.spec, job.spec.gpus)
            progress = self.by_job[job.job] = Progress(left=left)
        if progress.since is None:
            progress.rate, progress.since = self.rate(job.spec, len(job.workers)), now
        return self.end(progress)

    def stop(self, job_id: str, now: float) -> None:
        """Its attempt stopped at ``now`` (preempted, requeued): its work so far is kept."""
        progress = self.by_job.get(job_id)
        if progress is not None and progress.since is not None:
            progress.left = max(0.0, progress.left - progress.rate * max(0.0, now - progress.since))
            progress.since = None

    def forget(self, job_id: str) -> None:
        self.by_job.pop(job_id, None)

    @staticmethod
    def end(progress: Progress) -> float:
        assert progress.since is not None
        return progress.since + (progress.left / progress.rate if progress.rate > 0 else 0.0)

    def rescale(self, job: JobState, now: float) -> tuple[float, float, float]:
        """The job's new generation, decided at ``now``: (when its first step at the new size is, the
        rate it ran at before, when it ends). It trains at its old size until then, but for the
        pause."""
        progress = self.by_job[job.job]
        before = progress.rate
        first_step = now + self._delay(job, now)
        done_old = before * max(0.0, first_step - self.costs.pause_s - (progress.since or now))
        if done_old >= progress.left:  # it ends before the switch
            return first_step, before, (progress.since or now) + progress.left / before
        progress.left -= done_old
        progress.rate, progress.since = self.rate(job.spec, len(job.workers)), first_step
        return first_step, before, self.end(progress)

    def _delay(self, job: JobState, now: float) -> float:
        """From the decision to the first step: a shrink's, or a grow's, cold if any new worker found
        neither the task's standby nor a warm worker in its node's pool."""
        if job.rescale == "shrink" or not job.joiners:
            return self.costs.shrink_s
        ran_on = {w.split("/", 1)[0] for w in ev.workers_of(job.committed)}
        cold = False
        for worker in job.joiners:
            node = worker.split("/", 1)[0]
            standby = (job.job, node)
            if node in ran_on and now - self.standby_taken.get(standby, -1e18) >= self.costs.warm_refill_s:
                self.standby_taken[standby] = now
                continue
            taken = [t for t in self.pool_taken.get(node, []) if now - t < self.costs.warm_refill_s]
            if len(taken) < self.costs.warm_workers:
                self.pool_taken[node] = [*taken, now]
                continue
            cold = True
        return self.costs.grow_cold_s if cold else self.costs.grow_warm_s
