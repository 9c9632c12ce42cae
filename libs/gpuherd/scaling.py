"""How a data-parallel job's throughput scales with its workers: compute per sample plus a ring
all-reduce of its gradients every step. The elastic service predicts with it (``services/elastic``)
and the simulator runs jobs by it (``apps/sim``); ``gpuherd profile --ddp`` measures the same two
numbers of a real model.

For a step of global batch ``B`` on ``w`` workers:
``step(w) = compute_per_sample * B / w + allreduce(grad_bytes, w)``, with a ring all-reduce of
``2 (w - 1) / w * grad_bytes / bandwidth + (w - 1) * latency``; throughput is ``B / step(w)``.
"""

from __future__ import annotations

from gpuherd.events.values import Scaling

DEFAULT_BANDWIDTH_BYTES_PER_S = 5e9  # all-reduce bandwidth per worker (NVLink/IB: more; gloo on CPU: less)
DEFAULT_LATENCY_S = 5e-5  # per ring hop


def allreduce_s(
    grad_bytes: int, workers: int, bandwidth: float = DEFAULT_BANDWIDTH_BYTES_PER_S, latency: float = DEFAULT_LATENCY_S
) -> float:
    """One ring all-reduce of ``grad_bytes`` over ``workers``."""
    if workers <= 1 or grad_bytes <= 0:
        return 0.0
    return 2 * (workers - 1) / workers * grad_bytes / bandwidth + (workers - 1) * latency


def throughput(
    scaling: Scaling,
    workers: int,
    batch: int,
    bandwidth: float = DEFAULT_BANDWIDTH_BYTES_PER_S,
    latency: float = DEFAULT_LATENCY_S,
) -> float:
    """Samples per second at ``workers``, each step ``batch`` samples."""
    step = scaling.compute_per_sample_s * batch / workers + allreduce_s(scaling.grad_bytes, workers, bandwidth, latency)
    return batch / step if step > 0 else float("inf")


def with_efficiency(efficiency: float, workers: int, batch_per_worker: int, compute_per_sample_s: float) -> Scaling:
    """The scaling whose per-worker throughput at ``workers`` (each ``batch_per_worker`` samples a
    step, the batch growing with the workers) is ``efficiency`` of one worker's, at the default
    bandwidth: a model of a job known only by how well it scales."""
    if not 0 < efficiency <= 1 or workers < 2:
        return Scaling(compute_per_sample_s=compute_per_sample_s, grad_bytes=0)
    compute = compute_per_sample_s * batch_per_worker  # a step's compute, any size
    comm = compute * (1 / efficiency - 1)  # what the all-reduce at ``workers`` must cost
    moved = max(0.0, comm - (workers - 1) * DEFAULT_LATENCY_S) * DEFAULT_BANDWIDTH_BYTES_PER_S
    return Scaling(compute_per_sample_s=compute_per_sample_s, grad_bytes=int(moved * workers / (2 * (workers - 1))))
