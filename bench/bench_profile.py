"""Layer profiler: its overhead, the example CNN's profile, and the data-parallel prediction
checked against measured throughput.

1. Overhead: a plain training step (forward, loss, backward) against the same step with the
   profiler's hooks, and the whole ``profile_layers`` call (warm-up, timed steps, the counting
   pass) in plain steps. Baseline: the plain step, measured in the same run.
2. The profile of ``examples/train_cnn.py``'s SmallResNet (and a transformer block) on this
   device, per layer: time, FLOPs, bytes, intensity, roofline verdict.
3. Data parallelism: the CNN profiled with one thread per worker, gloo all-reduce measured
   among 2 and 4 local processes, the predicted throughput at 1, 2, 4 and 8 workers, and the
   measured throughput of ``examples/train_cnn.py`` run as 1, 2 and 4 CPU workers (one thread
   each) on this machine; the error of the prediction.

    python bench/bench_profile.py [--device cuda] [--skip-ddp]
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from train_cnn import SmallResNet  # noqa: E402
from transformer import SmallTransformerBlock, TransformerBlock  # noqa: E402

from apps.cli.profile import profile_table, scaling_tables  # noqa: E402
from gpuherd.train.dataparallel import measure_allreduce, measure_core_sharing, predict_scaling  # noqa: E402
from gpuherd.train.profile import profile_layers  # noqa: E402

console = Console(width=200)


def plain_step_s(model: torch.nn.Module, x: torch.Tensor, repeats: int, cuda: bool) -> float:
    times = []
    for i in range(repeats + 3):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        model(x).float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def overhead(models: dict[str, tuple[torch.nn.Module, torch.Tensor]], cuda: bool) -> None:
    table = Table(title="profiler overhead (median of 10 steps; baseline: the plain step)", title_justify="left")
    for column in (
        "model",
        "layers",
        "plain step ms",
        "hooked step ms",
        "hooks vs plain",
        "rows sum ms",
        "rows vs plain",
        "profile call s",
        "in plain steps",
    ):
        table.add_column(column, justify="right")
    for name, (model, x) in models.items():
        plain = plain_step_s(model, x, 10, cuda)
        started = time.perf_counter()
        profile = profile_layers(model, x, warmup=3, repeats=10)
        call = time.perf_counter() - started
        table.add_row(
            name,
            str(len(profile.layers)),
            f"{plain * 1e3:.2f}",
            f"{profile.profiled_step_s * 1e3:.2f}",
            f"{profile.profiled_step_s / plain:.2f}x",
            f"{profile.layer_sum_s * 1e3:.2f}",
            f"{profile.layer_sum_s / plain:.2f}x",
            f"{call:.2f}",
            f"{call / plain:.0f}",
        )
        console.print(profile_table(profile, blocks=False))
    console.print(table)
    console.print(
        "rows vs plain: the per-layer rows' sum over the unhooked step. The rows time the GPU between hooks; "
        "where the step is launch-bound (the GPU waits on Python) the hooks' own CPU time shows in them."
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured_throughput(workers: int, steps: int, batch: int, warmup: int = 20) -> float:
    """samples/s of examples/train_cnn.py as ``workers`` local gloo processes, one thread each."""
    port = _free_port()
    procs = []
    for rank in range(workers):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(workers),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(workers),
        )
        command = [sys.executable, "examples/train_cnn.py", "--steps", str(steps), "--batch-size", str(batch)]
        procs.append(
            subprocess.Popen(
                [*command, "--log-every", str(warmup)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    # The script prints the cumulative rate since its start; the steady rate is taken between the
    # first report after warm-up (DDP's first steps build buckets and connections) and the last.
    marks = [(int(a), float(b)) for a, b in re.findall(r"step (\d+) loss \S+ samples/s (\d+)", outputs[0])]
    marks = [(step, rate) for step, rate in marks if step >= warmup]
    if len(marks) < 2:
        raise RuntimeError(f"no throughput in the output of {workers} workers:\n{outputs[0][-2000:]}")
    (first, first_rate), (last, last_rate) = marks[0], marks[-1]
    samples = batch * workers
    elapsed = last * samples / last_rate - first * samples / first_rate
    return (last - first) * samples / elapsed


def extra_step_s(model: torch.nn.Module, batch: int) -> float:
    """What train_cnn.py's step does besides forward and backward: batch indexing, optimizer."""
    inputs = torch.randn(4096, 3, 32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(inputs[:batch]).sum().backward()
    times = []
    for _ in range(20):
        started = time.perf_counter()
        index = torch.randint(0, len(inputs), (batch,))
        _ = inputs[index]
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def data_parallel(batch: int, steps: int) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = SmallResNet()
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    profile = profile_layers(model, x, loss_fn=lambda out: F.cross_entropy(out, y), warmup=3, repeats=10)
    extra = extra_step_s(model, batch)
    torch.set_num_threads(threads)
    costs = {w: measure_allreduce(w, busy=True) for w in (2, 4)}
    for w, cost in costs.items():
        console.print(
            f"gloo all-reduce among {w}: {cost.latency_s * 1e6:.0f} us + bytes / {cost.bytes_per_s / 1e9:.2f} GB/s"
        )
    cores = os.cpu_count() or 1
    sharing = measure_core_sharing((2, 4, 8))
    independent = ", ".join(f"{n}: {max(1.0, n / cores):.2f}x" for n in sharing)
    console.print(
        "compute slowdown of n single-thread workers here (measured): "
        + ", ".join(f"{n}: {x:.2f}x" for n, x in sharing.items())
        + f"; {cores} independent cores would give {independent}"
    )
    detail, points = predict_scaling(profile, costs, workers=(1, 2, 4, 8), extra_s=extra, slowdown=sharing)
    for table in scaling_tables(detail, points):
        console.print(table)
    check = Table(
        title=f"predicted vs measured (steady state): examples/train_cnn.py, batch {batch}/worker, 1 thread/worker",
        title_justify="left",
    )
    for column in ("workers", "predicted samples/s", "measured samples/s", "error"):
        check.add_column(column, justify="right")
    for point in points:
        if point.workers > 4:
            check.add_row(str(point.workers), f"{point.samples_per_s:,.0f}", "(not run on 2 cores)", "")
            continue
        measured = measured_throughput(point.workers, steps, batch)
        error = (point.samples_per_s - measured) / measured
        check.add_row(str(point.workers), f"{point.samples_per_s:,.0f}", f"{measured:,.0f}", f"{100 * error:+.0f}%")
    console.print(check)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--steps", type=int, default=120, help="train_cnn.py steps per measured run")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        models = {
            "SmallResNet b256": (SmallResNet().to(device), torch.randn(256, 3, 32, 32, device=device)),
            "TransformerBlock 1024w b8x512 bf16": (
                TransformerBlock().to(device, torch.bfloat16),
                torch.randn(8, 512, 1024, device=device, dtype=torch.bfloat16),
            ),
            # The same block with 8x the tokens: the GPU, not the launches, sets the step's pace.
            "TransformerBlock 1024w b64x512 bf16": (
                TransformerBlock().to(device, torch.bfloat16),
                torch.randn(64, 512, 1024, device=device, dtype=torch.bfloat16),
            ),
        }
    else:
        models = {
            "SmallResNet b32": (SmallResNet(), torch.randn(args.batch, 3, 32, 32)),
            "SmallTransformerBlock b8x128": (SmallTransformerBlock(), torch.randn(8, 128, 256)),
        }
    overhead(models, cuda)
    if not args.skip_ddp and not cuda:
        data_parallel(args.batch, args.steps)


if __name__ == "__main__":
    main()
