"""Elastic runtime: the global sample order, the constant global batch, and exact state handoff."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpuherd.train.elastic import ElasticSampler, ElasticState, GlobalBatchError, accumulation_steps, ledger

GLOBAL_BATCH, MICRO = 24, 2
WORLDS = [w for w in range(1, 13) if GLOBAL_BATCH % (w * MICRO) == 0]  # 1, 2, 3, 4, 6, 12


def test_accumulation_keeps_the_global_batch_or_says_which_sizes_work() -> None:
    assert accumulation_steps(24, 2, 2) == 6
    assert accumulation_steps(24, 3, 4) == 2
    with pytest.raises(GlobalBatchError, match=r"works at world sizes \[1, 2, 3, 4, 6, 12\]"):
        accumulation_steps(24, 5, 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(WORLDS), min_size=1, max_size=40), st.integers(0, 5))
def test_any_sequence_of_world_sizes_uses_each_sample_once_per_epoch(worlds: list[int], seed: int) -> None:
    sampler = ElasticSampler(100, GLOBAL_BATCH, seed=seed)  # 4 steps an epoch, 4 samples dropped
    used = ledger(sampler, iter(worlds), MICRO)
    for epoch, indices in used.items():
        assert len(indices) == len(set(indices)), f"epoch {epoch} saw a sample twice"
        complete = epoch < sampler.epoch
        if complete:
            assert len(indices) == sampler.steps_per_epoch * GLOBAL_BATCH
        first_steps = ElasticSampler(100, GLOBAL_BATCH, seed=seed)
        first_steps.epoch = epoch
        assert set(indices) <= set(first_steps.order()[: sampler.steps_per_epoch * GLOBAL_BATCH].tolist())


def test_the_order_depends_on_seed_and_epoch_only() -> None:
    a, b = ElasticSampler(50, 10, seed=1), ElasticSampler(50, 10, seed=1)
    assert torch.equal(a.order(), b.order())
    for _ in range(5):
        a.advance()
    assert a.epoch == 1 and not torch.equal(a.order(), b.order())
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.step_indices(), b.step_indices())
    with pytest.raises(GlobalBatchError):
        ElasticSampler(50, 5).load_state_dict(a.state_dict())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _setup(seed: int = 0) -> tuple[ElasticState, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.randn(96, 8, generator=torch.Generator().manual_seed(7))
    labels = torch.randint(0, 3, (96,), generator=torch.Generator().manual_seed(8))
    state = ElasticState(model, optimizer, sampler=ElasticSampler(96, GLOBAL_BATCH), scheduler=scheduler)
    return state, data, labels


def _train(state: ElasticState, data: torch.Tensor, labels: torch.Tensor, steps: int, world: int = 1) -> None:
    """Steps at a given world size, one process standing in for all ranks: every rank's
    micro-batches, loss scaled by 1/accumulation, gradients averaged over ranks as DDP does."""
    rounds = accumulation_steps(GLOBAL_BATCH, world, MICRO)
    for _ in range(steps):
        state.optimizer.zero_grad()
        for rank in range(world):
            for micro in state.sampler.micro_batches(rank, world, MICRO):
                loss = F.cross_entropy(state.model(data[micro]), labels[micro]) / rounds / world
                loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.sampler.advance()
        state.step += 1


def test_restoring_a_snapshot_continues_exactly_as_if_nothing_happened() -> None:
    straight, data, labels = _setup()
    _train(straight, data, labels, 6)
    stream_after = torch.get_rng_state()

    resumed, _, _ = _setup()
    _train(resumed, data, labels, 3)
    committed = resumed.capture()
    _train(resumed, data, labels, 2)  # a rescale that failed midway: this progress is rolled back
    torch.randn(5)  # ... and the random streams moved on
    resumed.restore(committed)
    _train(resumed, data, labels, 3)

    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # bit-identical: the same operations in the same order
    assert (
        straight.optimizer.state_dict()["param_groups"][0]["lr"]
        == resumed.optimizer.state_dict()["param_groups"][0]["lr"]
    )
    assert (straight.step, straight.sampler.epoch, straight.sampler.cursor) == (
        resumed.step,
        resumed.sampler.epoch,
        resumed.sampler.cursor,
    )
    assert torch.equal(torch.get_rng_state(), stream_after)  # dropout drew the same numbers in both runs


def test_a_constant_global_batch_gives_the_same_step_at_any_world_size() -> None:
    # Without dropout the step is a function of the global batch alone; only the summation order
    # differs between sizes, so parameters agree to float32 rounding (stated tolerance 1e-6).
    results = []
    for world in (1, 2, 3, 4):
        state, data, labels = _setup()
        state.model.body[3].p = 0.0
        _train(state, data, labels, 4, world=world)
        results.append(torch.cat([p.detach().flatten() for p in state.model.parameters()]))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-6, atol=1e-6)


# -- the snapshot broadcast, over gloo between processes ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank: int, port: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state, data, labels = _setup(seed=rank)  # the joining rank starts from other weights
    snapshot = None
    if rank == 0:
        _train(state, data, labels, 3)
        snapshot = state.capture()
    state.broadcast(snapshot, src=0)
    _train(state, data, labels, 2)  # both continue from the same state and the same random streams
    # Plain bytes: tensors would travel as shared memory, which dies with this process.
    params = [p.detach().numpy().tobytes() for p in state.model.parameters()]
    out.put((rank, params, state.step, state.sampler.cursor))
    dist.barrier()
    dist.destroy_process_group()


def test_broadcast_hands_the_whole_state_to_a_joining_rank() -> None:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_broadcast_worker, args=(rank, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=120) for _ in procs))
    for proc in procs:
        proc.join(30)
    (params0, step0, cursor0), (params1, step1, cursor1) = results[0], results[1]
    assert (step0, cursor0) == (step1, cursor1) == (5, 5 * GLOBAL_BATCH % 96)
    assert params0 == params1  # bit-identical
