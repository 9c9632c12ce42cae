"""Train a CNN whose saved activations and Adam state live in leased memory (gpuherd.train.MemoryTiers).

The job declares ``memory`` (see train_offload.json); the broker leases it spare memory of
neighbor GPUs and pinned host memory; the agent hands the leases to this process. Every step
starts with ``tiers.poll()``: new shares open, revoked ones move to host and are given back.

python examples/train_offload.py --steps 50 --host-mb 256   # by hand: a host pool of its own
gpuherd submit examples/train_offload.json                  # through gpuherd: leased tiers
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from gpuherd import train
from gpuherd.train.memory import MemoryTiers


def make_model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(width * 16 * 16, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--min-seconds", type=float, default=0.0, help="keep training at least this long")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--host-mb", type=float, default=0.0, help="a host pool of this size when no lease is given")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = make_model(args.width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tiers = MemoryTiers.from_job(device, min_bytes=64 * 1024)
    for line in tiers.poll():
        print(f"start: {line}", flush=True)
    if args.host_mb and not tiers.pools:
        tiers.add_host(args.host_mb)
    tiers.offload_optimizer(optimizer)
    started = time.monotonic()
    step = 0
    while step < args.steps or time.monotonic() - started < args.min_seconds:
        for line in tiers.poll():
            print(f"step {step}: {line}", flush=True)
        x = torch.randn(args.batch, 3, 32, 32, device=device)
        y = torch.randint(0, 10, (args.batch,), device=device)
        with tiers.saved_tensors(model):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 25 == 0:
            train.report(step, loss=loss.item(), offloaded_mb=tiers.stats.offloaded_bytes / 2**20)
            pools = ", ".join(f"{p.name}={p.used / 2**20:.1f}MiB" for p in tiers.pools) or "no pools"
            print(
                f"step {step} loss {loss.item():.4f} offloaded {tiers.stats.offloaded_bytes / 2**20:.1f} MiB; {pools}"
            )
    train.report(step, loss=loss.item())
    print(f"done: {step} steps; by tier {tiers.stats.by_tier}", flush=True)


if __name__ == "__main__":
    main()
