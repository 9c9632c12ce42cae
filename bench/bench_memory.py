"""Memory tiers: copy bandwidth of each tier, and training beyond a GPU memory cap.

1. Copy bandwidth (GiB/s) of what a tier costs per byte: device -> pinned host and back, device
   -> each neighbor GPU and back (with 2+ GPUs; P2P access reported), against a copy within the
   device (the baseline, measured in the same run).
2. Training under a cap: an MLP stack whose saved activations dominate its memory.
   ``torch.cuda.set_per_process_memory_fraction`` caps the GPU at what the model needs at a
   batch that fits (plus a little); the batch ``--factor`` times larger then runs out of memory
   as it is, and trains with saved activations (and Adam's state) in pinned host memory and, with
   2+ GPUs, on a neighbor. Step time, samples/s and peak device memory of each, next to the batch
   that fits without offload (the baseline); the throughput ratio neighbor / host. The host tier
   runs again keeping the step's newest activations on the device (``keep_mb``), in what the cap
   leaves spare over the last run's forward and backward, so fewer bytes cross the link; the last
   of those runs once more with Adam's state brought back at ``step()``, not during backward.

Without CUDA both parts run on CPU (no cap: every tier is host memory), which measures the
runtime's bookkeeping and copy cost, not a GPU's.

    python bench/bench_memory.py [--repeats 5] [--factor 4] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from gpuherd.train.memory import MemoryTiers, MiB

console = Console(width=160)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_gib_s(src: torch.Tensor, dst: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        sync(src.device)
        sync(dst.device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(src.device)
        sync(dst.device)
        times.append(time.perf_counter() - start)
    return src.numel() * src.element_size() / statistics.median(times[1:]) / 2**30


def bandwidths(device: torch.device, size_mb: int, repeats: int) -> list[tuple[str, float]]:
    """(path, GiB/s) of each copy a tier makes, the in-device copy (the baseline) first."""
    n = size_mb * MiB
    local = torch.ones(n, dtype=torch.uint8, device=device)
    base = copy_gib_s(local, torch.empty_like(local), repeats)
    rows = [("in-device copy (baseline)", base)]
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    rows.append(("device -> pinned host", copy_gib_s(local, pinned, repeats)))
    rows.append(("pinned host -> device", copy_gib_s(pinned, local, repeats)))
    if device.type == "cuda":
        pageable = torch.empty(n, dtype=torch.uint8)
        rows.append(("device -> pageable host", copy_gib_s(local, pageable, repeats)))
        for peer_index in range(torch.cuda.device_count()):
            if peer_index == device.index:
                continue
            peer = torch.device("cuda", peer_index)
            p2p = torch.cuda.can_device_access_peer(device.index, peer_index)
            remote = torch.empty(n, dtype=torch.uint8, device=peer)
            rows.append(
                (f"device -> GPU {peer_index} (P2P {'yes' if p2p else 'no'})", copy_gib_s(local, remote, repeats))
            )
            rows.append((f"GPU {peer_index} -> device", copy_gib_s(remote, local, repeats)))
    return rows


def bandwidth_table(rows: list[tuple[str, float]], size_mb: int, repeats: int) -> Table:
    table = Table(title=f"copy bandwidth, {size_mb} MiB blocks (median of {repeats})")
    for col in ("path", "GiB/s", "vs in-device copy"):
        table.add_column(col, justify="right" if col != "path" else "left")
    base = rows[0][1]
    for name, gib_s in rows:
        table.add_row(name, f"{gib_s:.1f}", f"{gib_s / base:.2f}x")
    return table


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class Run:
    def __init__(
        self,
        name: str,
        batch: int,
        step_s: float | None,
        peak_mb: float | None,
        offloaded_mb: float,
        backward_peak_mb: float | None = None,
    ) -> None:
        self.name, self.batch, self.step_s, self.peak_mb, self.offloaded_mb = name, batch, step_s, peak_mb, offloaded_mb
        self.backward_peak_mb = backward_peak_mb  # the peak over forward and backward (not the optimizer step)

    @property
    def samples_per_s(self) -> float | None:
        return None if self.step_s is None else self.batch / self.step_s


def train(
    device: torch.device, width: int, depth: int, batch: int, repeats: int, tiers: MemoryTiers | None, name: str
) -> Run:
    model = mlp(width, depth).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if tiers is not None:
        tiers.offload_optimizer(opt)
    x = torch.randn(batch, width, device=device)
    times = []
    cuda = device.type == "cuda"
    peak = backward_peak = 0
    try:
        for _ in range(repeats + 2):
            sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            if tiers is None:
                loss = model(x).square().mean()
            else:
                with tiers.saved_tensors(model):
                    loss = model(x).square().mean()
            loss.backward()
            if cuda:  # the allocator's own count, kept as it allocates: no sync needed
                backward_peak = max(backward_peak, torch.cuda.max_memory_allocated(device))
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(device)
            times.append(time.perf_counter() - start)
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated(device))
    except torch.OutOfMemoryError:
        return Run(name, batch, None, None, 0.0)
    offloaded = tiers.stats.offloaded_bytes / MiB if tiers is not None else 0.0
    return Run(
        name,
        batch,
        statistics.median(times[2:]),
        peak / MiB if cuda else None,
        offloaded,
        backward_peak / MiB if cuda else None,
    )


def training_table(runs: list[Run], title: str) -> Table:
    table = Table(title=title)
    columns = ("run", "batch", "step ms", "samples/s", "vs fitting batch", "peak device MiB", "fwd+bwd peak MiB")
    for col in (*columns, "offloaded MiB/step"):
        table.add_column(col, justify="right" if col != "run" else "left")
    base = runs[0].samples_per_s or 1.0
    for r in runs:
        sps = r.samples_per_s
        table.add_row(
            r.name,
            str(r.batch),
            "OOM" if r.step_s is None else f"{r.step_s * 1e3:.1f}",
            "-" if sps is None else f"{sps:,.0f}",
            "-" if sps is None else f"{sps / base:.2f}x",
            "-" if r.peak_mb is None else f"{r.peak_mb:,.0f}",
            "-" if r.backward_peak_mb is None else f"{r.backward_peak_mb:,.0f}",
            f"{r.offloaded_mb:,.0f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--factor", type=int, default=4, help="the large batch, in fitting batches")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures instead of tables")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    device_name = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA: every tier is host memory)"
    width, depth, batch = (4096, 24, 4096) if cuda else (512, 8, 256)
    size_mb = 256 if cuda else 64
    copies = bandwidths(device, size_mb, args.repeats)
    if not args.json:
        console.print(f"device: {device_name}")
        console.print(bandwidth_table(copies, size_mb, args.repeats))

    fits = train(device, width, depth, batch, args.repeats, None, "fitting batch, no offload (baseline)")
    big = batch * args.factor
    cap = 0.0
    if cuda:
        # The cap: what the fitting batch needed, plus a margin; the large batch cannot fit in it.
        cap = (fits.peak_mb or 0) * 1.25 * MiB
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
        torch.cuda.empty_cache()
        if not args.json:
            console.print(f"cap: {cap / MiB:,.0f} MiB of {total / MiB:,.0f} MiB")
    runs = [fits, train(device, width, depth, big, args.repeats, None, "large batch, no offload")]
    saved_mb = 4 * big * width * depth * 4 * 1.2 / MiB  # ~4 saved tensors of batch x width per block, fp32
    host = MemoryTiers(device)
    host.add_host(saved_mb)
    host_run = train(device, width, depth, big, args.repeats, host, "large batch, host tier")
    runs.append(host_run)
    del host
    gc.collect()  # (nothing should hold its pinned pool now; the next one needs the room)
    # What the cap leaves spare over forward and backward can hold the step's newest activations:
    # they are alive at the end of forward and go first in backward, so they raise that peak by at
    # most their size (less: backward frees them as it goes). Each round keeps three quarters of
    # what the last one left spare (the allocator's blocks round up), at most 3 rounds, until the
    # spare is small; an OOM ends it. The optimizer step's own peak does not count: the activations
    # are gone by then. Without a cap (CPU), one round of a quarter of what the tier moved.
    last, keep_mb = host_run, 0.0
    for _ in range(3 if cuda else 1):
        if cuda:
            assert last.backward_peak_mb is not None
            more = (cap / MiB - last.backward_peak_mb) * 0.75
            if more < 256:
                break
            keep_mb += more
        else:
            keep_mb = host_run.offloaded_mb / 4
        kept = MemoryTiers(device, keep_mb=keep_mb)
        kept.add_host(saved_mb)
        name = f"large batch, host tier, newest {keep_mb:,.0f} MiB kept"
        last = train(device, width, depth, big, args.repeats, kept, name)
        runs.append(last)
        del kept
        gc.collect()  # (nothing should hold its pinned pool now; the next one needs the room)
        if last.step_s is None:
            break
    # The same, with the optimizer's state brought back at step() rather than during backward: what
    # bringing it back beside backward's reloads saves (same run, same keep).
    if last.step_s is not None and last is not host_run:
        late = MemoryTiers(device, keep_mb=keep_mb, state_in_backward=False)
        late.add_host(saved_mb)
        runs.append(train(device, width, depth, big, args.repeats, late, f"{last.name}, state back at step()"))
        del late
        gc.collect()  # (nothing should hold its pinned pool now; the next one needs the room)
    neighbor_run = None
    if cuda and torch.cuda.device_count() > 1:
        peer = MemoryTiers(device)
        peer.add_peer(1, saved_mb, tier="nvlink" if torch.cuda.can_device_access_peer(0, 1) else "pcie")
        neighbor_run = train(device, width, depth, big, args.repeats, peer, "large batch, neighbor tier (GPU 1)")
        runs.append(neighbor_run)
    ratio = None
    if neighbor_run is not None and neighbor_run.samples_per_s and host_run.samples_per_s:
        ratio = neighbor_run.samples_per_s / host_run.samples_per_s
    if args.json:
        print(
            json.dumps(
                {
                    "device": device_name,
                    "cap_mb": cap / MiB if cuda else None,
                    "copy_gib_s": dict(copies),
                    "runs": [
                        {
                            "run": r.name,
                            "batch": r.batch,
                            "step_ms": None if r.step_s is None else r.step_s * 1e3,
                            "samples_per_s": r.samples_per_s,
                            "vs_fitting_batch": None if r.samples_per_s is None else r.samples_per_s / fits_sps,
                            "peak_mb": r.peak_mb,
                            "forward_backward_peak_mb": r.backward_peak_mb,
                            "offloaded_mb": r.offloaded_mb,
                        }
                        for r in runs
                        for fits_sps in [fits.samples_per_s or 1.0]
                    ],
                    "neighbor_over_host": ratio,
                }
            )
        )
    else:
        title = f"training an MLP ({depth} blocks x {width}) beyond {'the cap' if cuda else 'nothing (CPU)'}"
        console.print(training_table(runs, title))
        if ratio is not None:
            console.print(f"throughput neighbor / host: {ratio:.2f}x")
        elif cuda:
            console.print("one GPU: no neighbor tier to measure (a multi-GPU machine adds the peer rows and the ratio)")
    if cuda and host_run.step_s is None:
        console.print("[red]the host tier did not train the large batch under the cap[/red]")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
