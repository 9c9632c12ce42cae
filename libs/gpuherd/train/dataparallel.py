"""How a data-parallel (DDP) job scales: per-layer compute next to its gradients' all-reduce.

DDP broadcasts the model's buffers before each forward, and all-reduces gradients in buckets (the
first about 1 MiB, then ``bucket_bytes``) filled in backward order, starting a bucket's
all-reduce as soon as its last gradient is ready, so the communication of late layers hides
behind the backward of earlier ones. ``predict_scaling``
replays that on a measured ``StepProfile``: backward layer by layer, buckets launched as they
fill, one all-reduce at a time, with the cost of each from ``AllReduceCost`` (latency plus bytes
over bandwidth, fitted to all-reduces measured with ``measure_allreduce``: gloo on CPU, NCCL on
GPU). What is left of the communication after the backward ends is exposed and lengthens the
step.

When workers share CPU cores (CPU training on one machine) each one's compute slows down: by
``workers x threads / cores`` if the cores are real and independent, or by the slowdown
``measure_core_sharing`` measures (logical CPUs may be hyperthreads of fewer cores, and workers
share caches and memory bandwidth). On GPUs every worker has its own device and it does not.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuherd.train.profile import OUTSIDE, StepProfile

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket is small so the first all-reduce starts early
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


class AllReduceError(RuntimeError):
    """The all-reduce measurement could not run (a worker failed to start or join)."""


@dataclass(frozen=True)
class AllReduceCost:
    """Seconds to all-reduce ``n`` bytes among ``workers``: ``latency_s + n / bytes_per_s``."""

    backend: str
    workers: int
    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: int) -> float:
        if self.workers <= 1 or nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bytes_per_s

    def ring(self, workers: int) -> AllReduceCost:
        """This cost carried to another worker count by the ring algorithm: 2(W-1) latency steps
        and 2(W-1)/W of the buffer through each link."""
        if workers <= 1:
            return AllReduceCost(self.backend, workers, 0.0, float("inf"))
        if self.workers <= 1:
            raise ValueError("a one-worker cost says nothing about the network; measure with 2 or more")
        steps, measured_steps = 2 * (workers - 1), 2 * (self.workers - 1)
        share, measured_share = steps / workers, measured_steps / self.workers
        return AllReduceCost(
            self.backend,
            workers,
            self.latency_s * steps / measured_steps,
            self.bytes_per_s * measured_share / share,
        )


def fit_cost(backend: str, workers: int, points: Sequence[tuple[int, float]]) -> AllReduceCost:
    """Least-squares line through (bytes, seconds)."""
    xs = [float(b) for b, _ in points]
    ys = [s for _, s in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(slope, 1e-15)
    return AllReduceCost(backend, workers, max(0.0, mean_y - slope * mean_x), 1.0 / slope)


# -- measuring all-reduce ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(
    rank: int, workers: int, port: int, backend: str, sizes: list[int], repeats: int, busy: bool, out: mp.Queue
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=workers)
    stop = threading.Event()
    if busy:  # the worker's own training keeps its core busy while its gradients are reduced

        def compute() -> None:
            a = torch.randn(256, 256)
            while not stop.is_set():
                torch.mm(a, a)  # releases the GIL: a second thread, as DDP's backward is

        threading.Thread(target=compute, daemon=True).start()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = []
    for size in sizes:
        buffer = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buffer)  # warm-up: connections, buffers
        times = []
        for _ in range(repeats):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            dist.all_reduce(buffer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        results.append((buffer.numel() * 4, statistics.median(times)))
    stop.set()
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def measure_allreduce(
    workers: int,
    sizes: Sequence[int] = (1 << 16, 1 << 20, 4 << 20, 16 << 20),
    *,
    backend: str = "gloo",
    repeats: int = 5,
    busy: bool = False,
) -> AllReduceCost:
    """All-reduce buffers of ``sizes`` bytes among ``workers`` local processes and fit the cost.
    ``busy``: each process computes on another thread meanwhile, as a training worker does (on a
    CPU whose cores all train, the all-reduce then competes with compute for them)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [
        context.Process(
            target=_allreduce_worker, args=(rank, workers, port, backend, list(sizes), repeats, busy, queue)
        )
        for rank in range(workers)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 600
    try:
        while True:
            try:
                points = queue.get(timeout=1.0)
                break
            except queue_module.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise AllReduceError(
                        f"all-reduce measurement among {workers} {backend} workers failed "
                        f"(exit codes {failed or 'none: timed out'})"
                    ) from None
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    return fit_cost(backend, workers, points)


def _busy_worker(start: mp.Event, seconds: float, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    torch.mm(a, a)
    start.wait()
    done, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        torch.mm(a, a)
        done += 1
    out.put(done / (time.perf_counter() - began))


def measure_core_sharing(workers: Sequence[int], *, seconds: float = 1.0) -> dict[int, float]:
    """How much slower one single-thread worker computes when ``n`` run at once on this machine
    (matmuls in ``n`` processes against one alone): the compute slowdown of ``n`` CPU workers."""
    context = mp.get_context("spawn")
    rates: dict[int, float] = {}
    for count in sorted({1, *workers}):
        queue, start = context.Queue(), context.Event()
        procs = [context.Process(target=_busy_worker, args=(start, seconds, queue)) for _ in range(count)]
        for proc in procs:
            proc.start()
        time.sleep(0.5 + 0.2 * count)  # let every process import torch before the clock starts
        start.set()
        rates[count] = statistics.fmean(queue.get(timeout=120) for _ in range(count))
        for proc in procs:
            proc.join(30)
    return {count: rates[1] / rate for count, rate in rates.items()}


# -- the prediction ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerComm:
    name: str
    backward_s: float  # its backward, on one worker
    grad_bytes: int
    bucket: int  # the DDP bucket its gradients travel in
    allreduce_s: float  # its share of its bucket's all-reduce
    hidden: bool  # the bucket's all-reduce ends before the backward does


@dataclass(frozen=True)
class ScalingPoint:
    workers: int
    compute_s: float  # forward + backward (+ extra), slowed by shared cores
    comm_s: float  # all the step's all-reduces, back to back
    exposed_s: float  # the part not hidden behind backward
    step_s: float
    samples_per_s: float
    efficiency: float  # throughput over workers x one worker's


def predict_scaling(
    profile: StepProfile,
    costs: dict[int, AllReduceCost],
    *,
    workers: Sequence[int] = (1, 2, 4, 8),
    extra_s: float = 0.0,
    cores: int | None = None,
    slowdown: dict[int, float] | None = None,
    threads_per_worker: int = 1,
    bucket_bytes: int = BUCKET_BYTES,
    broadcast_buffers: bool = True,
) -> tuple[list[LayerComm], list[ScalingPoint]]:
    """Per-layer communication (at the largest worker count) and the predicted step and
    throughput at each worker count. ``costs``: all-reduce cost per worker count (a missing count
    is carried from the largest measured one by the ring model). ``extra_s``: per-step time the
    profile does not hold (optimizer, data loading). ``cores``: CPU cores the workers share;
    ``slowdown``: measured compute slowdown per worker count (wins over ``cores``).
    ``broadcast_buffers``: DDP's default, a broadcast of the model's buffers before every
    forward, which nothing overlaps."""
    if not costs:
        raise ValueError("predict_scaling needs at least one measured all-reduce cost")

    def slow(count: int) -> float:
        if slowdown and count in slowdown:
            return max(1.0, slowdown[count])
        return max(1.0, count * threads_per_worker / cores) if cores else 1.0

    model = _Replay(profile, extra_s, slow, bucket_bytes, broadcast_buffers)
    single, _ = model.run(1, costs[max(costs)].ring(1))
    points, detail = [], []
    for count in workers:
        point, detail = model.run(count, costs.get(count) or costs[max(costs)].ring(count))
        points.append(
            ScalingPoint(**{**point, "efficiency": point["samples_per_s"] / (count * single["samples_per_s"])})
        )
    return detail, points


class _Replay:
    """One DDP step replayed on the profile for a worker count."""

    def __init__(
        self,
        profile: StepProfile,
        extra_s: float,
        slow: Callable[[int], float],
        bucket_bytes: int,
        broadcast_buffers: bool,
    ) -> None:
        self.profile = profile
        self.layers = [layer for layer in profile.layers if layer.name != OUTSIDE]
        self.outside_s = sum(layer.backward_s for layer in profile.layers if layer.name == OUTSIDE)
        self.forward_s = sum(layer.forward_s for layer in profile.layers)
        self.extra_s = extra_s
        self.slow = slow
        self.broadcast_buffers = broadcast_buffers
        self.bucket_bytes = bucket_bytes

    def run(self, count: int, cost: AllReduceCost) -> tuple[dict[str, float], list[LayerComm]]:
        slow = self.slow(count)
        sync = cost.time(self.profile.buffer_bytes) if self.broadcast_buffers else 0.0
        t = sync + self.forward_s * slow
        comm_free, comm_total = 0.0, sync
        buckets: list[tuple[list[int], float]] = []  # (layer indexes, when its all-reduce ends)
        members: list[int] = []
        filled, cap = 0, FIRST_BUCKET_BYTES

        def launch(ready_at: float) -> None:
            nonlocal comm_free, comm_total, members, filled, cap
            took = cost.time(filled)
            comm_free = max(ready_at, comm_free) + took
            comm_total += took
            buckets.append((members, comm_free))
            members, filled, cap = [], 0, self.bucket_bytes

        for index in range(len(self.layers) - 1, -1, -1):  # backward runs the layers in reverse
            layer = self.layers[index]
            t += layer.backward_s * slow
            if layer.grad_bytes:
                members.append(index)
                filled += layer.grad_bytes
                if filled >= cap:
                    launch(t)
        backward_end = t + self.outside_s * slow
        if members:
            launch(backward_end)
        end = max(backward_end, comm_free)
        step = end + self.extra_s * slow
        point = {
            "workers": count,
            "compute_s": backward_end - sync + self.extra_s * slow,
            "comm_s": comm_total,
            "exposed_s": end - backward_end + sync,
            "step_s": step,
            "samples_per_s": count * self.profile.batch_size / step,
        }
        detail = []
        for number, (indexes, finish) in enumerate(buckets):
            total = sum(self.layers[i].grad_bytes for i in indexes)
            for i in indexes:
                layer = self.layers[i]
                detail.append(
                    LayerComm(
                        name=layer.name,
                        backward_s=layer.backward_s,
                        grad_bytes=layer.grad_bytes,
                        bucket=number,
                        allreduce_s=cost.time(total) * layer.grad_bytes / total,
                        hidden=finish <= backward_end,
                    )
                )
        return point, detail
