"""When elastic jobs grow and shrink: the policy, as pure functions of the cluster state.

Two rules, in this order:

1. **Waiting jobs first.** While a job that is not elastic waits for GPUs, running elastic jobs
   above their minimum shrink to free what the first waiting job lacks. The jobs that lose the
   least predicted throughput per GPU given back shrink first.
2. **Idle GPUs are lent.** With nothing waiting, free GPUs go to the elastic jobs that gain the
   most predicted throughput per GPU added, up to their maximum, as long as the new size keeps at
   least ``grow_efficiency`` of the job's per-GPU throughput at its current size.

Hysteresis: a job is resized at most once per ``min_interval_s``, and after shrinking for
waiting jobs it does not grow again for ``hold_after_shrink_s`` (so it is not grown into the GPUs
that just freed and shrunk again at once). With ``grow_after_start_s``, a job is not grown before
it has run that long (its first generation forms and trains first, so that its first grow is a
rescale of a running job, with its throughput measured, rather than a bigger start). Sizes are
only those the job may take (``Elastic.sizes()``: the global batch stays whole).

**Predicted throughput** at ``w`` workers, for a step of global batch ``G``:
``step(w) = compute_per_sample * G / w + allreduce(grad_bytes, w)``, with a ring all-reduce of
``2 (w - 1) / w * grad_bytes / bandwidth + (w - 1) * latency``. ``compute_per_sample`` comes from
the job's measured throughput at the nearest size it ran at (each ``RescaleCompleted`` carries
the throughput before the switch), else from its per-layer profile (``ProfileReported``: step
time per sample, gradient bytes). With neither, throughput is taken as linear in ``w``.
"""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.fold import JobState
from services.elastic.state import ElasticState, JobModel


class ElasticParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    min_interval_s: float = 60.0  # per job, between two of its rescales
    hold_after_shrink_s: float = 300.0  # no grow this soon after a shrink for waiting jobs
    grow_efficiency: float = 0.6  # per-GPU throughput at the new size / at the current size, at least
    retry_s: float = 30.0  # propose again when the scheduler did not act on a proposal
    grow_after_start_s: float = 0.0  # no grow of a job that started less than this ago
    bandwidth_bytes_per_s: float = 5e9  # all-reduce bandwidth per worker (NVLink/IB: more; gloo on CPU: less)
    latency_s: float = 5e-5  # per ring hop


def params_from(values: dict[str, float]) -> ElasticParams:
    """ElasticParams from ``ElasticConfigured.params`` (or ``--params``): unknown names are refused."""
    try:
        return msgspec.convert(values, ElasticParams)
    except msgspec.ValidationError as exc:
        known = ", ".join(ElasticParams.__struct_fields__)
        raise ValueError(f"{exc}; known parameters: {known}") from None


def allreduce_s(grad_bytes: int, workers: int, params: ElasticParams) -> float:
    if workers <= 1 or grad_bytes <= 0:
        return 0.0
    return 2 * (workers - 1) / workers * grad_bytes / params.bandwidth_bytes_per_s + (workers - 1) * params.latency_s


def global_batch(job: JobState, workers: int) -> int:
    elastic = job.spec.elastic
    assert elastic is not None
    if elastic.global_batch is not None and elastic.lr_scaling is None:
        return elastic.global_batch
    return workers * (elastic.micro_batch or 1)  # the batch grows with the workers (an LR-scaling rule)


def predicted_throughput(
    job: JobState, workers: int, model: JobModel | None, params: ElasticParams, measured: dict[int, float]
) -> float:
    """Samples per second at ``workers`` (relative units when nothing was measured or profiled);
    ``measured``: the job's throughput at the sizes it ran at."""
    if workers in measured:
        return measured[workers]
    grad_bytes = model.grad_bytes if model is not None else 0
    per_sample = model.compute_per_sample_s if model is not None else None
    if measured:
        nearest = min(measured, key=lambda w: (abs(w - workers), w))
        batch = global_batch(job, nearest)
        compute = batch / measured[nearest] - allreduce_s(grad_bytes, nearest, params)
        per_sample = max(compute, 1e-12) * nearest / batch
    if per_sample is None:
        return float(workers)  # nothing known: linear
    batch = global_batch(job, workers)
    return batch / (per_sample * batch / workers + allreduce_s(grad_bytes, workers, params))


def _free(state: ElasticState, job: JobState) -> int:
    """Free GPUs on nodes that take work and can run the job (processes for a command)."""
    wants_processes = job.spec.command is not None
    return sum(
        len(n.free_gpus()) for n in state.nodes.values() if n.accepts_work() and n.runs_processes() == wants_processes
    )


def _may_rescale(job: JobState, now: float, params: ElasticParams) -> bool:
    return job.rescaled_at is None or now - job.rescaled_at >= params.min_interval_s


def resizable(state: ElasticState) -> list[JobState]:
    """Running elastic jobs with no rescale in flight and no dead worker to recover from."""
    return [
        j
        for j in state.active_jobs()
        if j.spec.elastic is not None and j.status == "running" and j.rescale is None and not j.lost_workers
    ]


def decide(state: ElasticState, params: ElasticParams) -> list[ev.RescaleProposed]:
    """The proposals for this state (at most one per job)."""
    now, proposed = state.now, state.proposed
    jobs = [
        j
        for j in resizable(state)
        if _may_rescale(j, now, params)
        and not (proposed.get(j.job, (-1, 0.0))[0] == j.generation and now - proposed[j.job][1] < params.retry_s)
    ]
    if not jobs:
        return []
    waiting = [
        state.jobs[j] for j in state.queue if state.jobs[j].spec.elastic is None and not state.jobs[j].cancel_requested
    ]
    if waiting:
        return _shrink_for(state, waiting[0], jobs, params)
    return _grow_into_idle(state, jobs, params)


def _shrink_for(
    state: ElasticState, head: JobState, jobs: list[JobState], params: ElasticParams
) -> list[ev.RescaleProposed]:
    wants_processes = head.spec.command is not None
    need = head.spec.gpus - _free(state, head)
    if need <= 0:
        return []  # it waits for something a shrink cannot give (quota, shape, a reservation)
    vc = state.vcs.get(head.spec.vc)
    quota_bound = vc is not None and vc.gpu_quota is not None and not vc.can_borrow
    options = []
    for job in jobs:
        if (job.spec.command is not None) != wants_processes or (quota_bound and job.spec.vc != head.spec.vc):
            continue
        size = len(job.workers)
        smaller = [s for s in job.spec.elastic.sizes() if s < size]  # type: ignore[union-attr]
        if not smaller:
            continue
        enough = [s for s in smaller if s <= size - need]
        target = max(enough) if enough else min(smaller)  # all it can give, if it cannot give all that is needed
        model, measured = state.models.get(job.job), state.throughput.get(job.job, {})
        rate_now = predicted_throughput(job, size, model, params, measured)
        lost = rate_now - predicted_throughput(job, target, model, params, measured)
        per_gpu_now = rate_now / size
        options.append((lost / (size - target) / max(per_gpu_now, 1e-12), job.job, job, target))
    out = []
    for _, _, job, target in sorted(options):
        if need <= 0:
            break
        size = len(job.workers)
        out.append(_proposal(job, target, f"shrink {size} -> {target} GPUs: {head.job} waits for {head.spec.gpus}"))
        need -= size - target
    return out


def _grow_into_idle(state: ElasticState, jobs: list[JobState], params: ElasticParams) -> list[ev.RescaleProposed]:
    options = []
    for job in jobs:
        if state.now - state.shrunk_at.get(job.job, -1e18) < params.hold_after_shrink_s:
            continue
        if job.started_at is not None and state.now - job.started_at < params.grow_after_start_s:
            continue
        size = len(job.workers)
        free = _free(state, job)
        larger = [s for s in job.spec.elastic.sizes() if size < s <= size + free]  # type: ignore[union-attr]
        model, measured = state.models.get(job.job), state.throughput.get(job.job, {})
        now_rate = predicted_throughput(job, size, model, params, measured)
        best = None
        for target in sorted(larger, reverse=True):
            rate = predicted_throughput(job, target, model, params, measured)
            if rate / target >= params.grow_efficiency * now_rate / size and rate > now_rate:
                best = (target, rate)
                break
        if best is not None:
            target, rate = best
            gain_per_gpu = (rate - now_rate) / (target - size) / max(now_rate / size, 1e-12)
            options.append((-gain_per_gpu, job.job, job, target, rate))
    out = []
    taken = 0
    for _, _, job, target, rate in sorted(options):
        size = len(job.workers)
        if target - size > _free(state, job) - taken:
            continue
        taken += target - size
        reason = f"grow {size} -> {target} GPUs into idle GPUs (predicted {rate:.0f} samples/s)"
        out.append(_proposal(job, target, reason, expected=rate))
    return out


def _proposal(job: JobState, gpus: int, reason: str, expected: float | None = None) -> ev.RescaleProposed:
    return ev.RescaleProposed(
        job=job.job,
        attempt=job.attempt,
        generation=job.generation,
        gpus=gpus,
        reason=reason,
        expected_samples_per_s=expected,
    )
