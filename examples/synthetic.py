"""What the example scripts share: a learnable synthetic dataset, a DDP training loop, and an
elastic one (when the job is elastic: it grows and shrinks at step boundaries, with one global
sample order and a constant global batch, so it trains as if it had never been resized).

Each class has a fixed random template; a sample is its class's template under
heavy noise, so the loss really falls as the model learns. Every rank builds the same dataset from
one seed and trains on its own shard (rank::world_size), the way a
DistributedSampler splits a real dataset.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpuherd import train
from gpuherd.train.elastic import ElasticSampler, ElasticState


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=4096, help="dataset size (all ranks together)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=96, help="elastic jobs: samples per step, at any size")
    parser.add_argument("--micro-batch", type=int, default=8, help="elastic jobs: samples per forward pass")
    parser.add_argument(
        "--lr-scaling",
        choices=["linear"],
        default=None,
        help="elastic jobs: the batch is world x micro-batch and the LR scales with the world (--lr is for the first)",
    )
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
    if ctx.elastic:
        return run_elastic(ctx, args, make_model, input_shape, classes)
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


def elastic_steps(
    state: ElasticState,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    steps: int,
    on_step: Callable[[ElasticState, float], None] | None = None,
) -> list[float]:
    """Train until ``steps`` (or until this worker leaves at a rescale); the global mean loss of
    each step this worker ran."""
    losses = []
    while state.step < steps and state.sync():
        with state.guard():
            model = state.ddp()
            state.optimizer.zero_grad()
            step_loss = torch.zeros(1, device=inputs.device)
            for indices, last in state.micro_batches():
                with nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(inputs[indices]), labels[indices]) / state.accumulation
                    loss.backward()
                step_loss += loss.detach()
            dist.all_reduce(step_loss)  # before the optimizer step: inside the guard's rollback
            state.optimizer.step()
            state.finish_step()
        losses.append(float(step_loss) / state.world)
        if on_step is not None:
            on_step(state, losses[-1])
    return losses


def run_elastic(
    ctx: train.JobContext,
    args: argparse.Namespace,
    make_model: Callable[[], nn.Module],
    input_shape: tuple[int, ...],
    classes: int,
) -> float:
    torch.manual_seed(args.seed)
    inputs, labels = make_dataset(args.samples, input_shape, classes, args.seed)
    inputs, labels = inputs.to(ctx.device), labels.to(ctx.device)
    model = make_model().to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ElasticSampler(args.samples, args.global_batch, seed=args.seed, fixed_batch=args.lr_scaling is None)
    state = ElasticState(
        model,
        optimizer,
        sampler=sampler,
        micro_batch=args.micro_batch,
        membership=ctx.membership(),
        lr_scaling=args.lr_scaling,
    )
    print(f"job {ctx.job_id} attempt {ctx.attempt}: elastic worker {ctx.elastic_worker} on {ctx.device}", flush=True)
    started, at_start = time.perf_counter(), 0

    def log(state: ElasticState, loss: float) -> None:
        nonlocal started, at_start
        if state.step == 1 or state.step % args.log_every == 0 or state.step == args.steps:
            rate = (state.step - at_start) * state.sampler.global_batch / max(1e-9, time.perf_counter() - started)
            started, at_start = time.perf_counter(), state.step
            if state.rank == 0:
                print(f"step {state.step} loss {loss:.4f} world {state.world} samples/s {rate:.0f}", flush=True)
                train.report(state.step, loss=loss, samples_per_s=rate, world=state.world)

    losses = elastic_steps(state, inputs, labels, args.steps, on_step=log)
    assert state.membership is not None
    if state.membership.left:
        print(f"worker {ctx.elastic_worker} left the job at step {state.step}", flush=True)
    else:
        print(f"final loss {losses[-1]:.4f}", flush=True)
    state.membership.close()
    return losses[-1] if losses else float("nan")
