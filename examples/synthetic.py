"""What the example scripts share: a learnable synthetic dataset and a DDP training loop.

Each class has a fixed random template; a sample is its class's template under
heavy noise, so the loss really falls as the model learns. Every rank builds the same dataset from
one seed and trains on its own shard (rank::world_size), the way a
DistributedSampler splits a real dataset.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from gpuherd import train


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=4096, help="dataset size (all ranks together)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-at-step", type=int, default=None, help="exit with code 3 there (to test failures)")
    return parser


def make_dataset(samples: int, shape: tuple[int, ...], classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, *shape, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    inputs = 0.5 * templates[labels] + torch.randn(samples, *shape, generator=generator)
    return inputs, labels


def run(
    args: argparse.Namespace,
    make_model: Callable[[], nn.Module],
    input_shape: tuple[int, ...],
    classes: int,
) -> float:
    ctx = train.init()
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts them)
    inputs, labels = make_dataset(args.samples, input_shape, classes, args.seed)
    inputs, labels = inputs[ctx.rank :: ctx.world_size], labels[ctx.rank :: ctx.world_size]

    model = ctx.wrap(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    where = f"rank {ctx.rank}/{ctx.world_size} on {ctx.device}" + (f" ({ctx.backend})" if ctx.backend else "")
    print(f"job {ctx.job_id} attempt {ctx.attempt}: {where}", flush=True)

    loss_value = float("nan")
    started = time.perf_counter()
    seen = 0
    for step in range(1, args.steps + 1):
        if args.fail_at_step is not None and step == args.fail_at_step and ctx.is_leader:
            raise SystemExit(f"failing on purpose at step {step}")  # exit code 1 with a message on stderr
        index = torch.randint(0, len(inputs), (args.batch_size,))
        x, y = inputs[index].to(ctx.device), labels[index].to(ctx.device)
        ctx.maybe_profile(model, x, loss_fn=lambda out, y=y: F.cross_entropy(out, y))  # on `gpuherd profile --job`
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += args.batch_size
        loss_value = loss.item()
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            rate = seen * ctx.world_size / (time.perf_counter() - started)
            print(f"step {step} loss {loss_value:.4f} samples/s {rate:.0f}", flush=True)
            train.report(step, loss=loss_value, samples_per_s=rate)
    print(f"final loss {loss_value:.4f}", flush=True)
    ctx.close()
    return loss_value
