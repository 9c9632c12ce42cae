"""Elastic runtime: the global sample order, the constant global batch, and exact state handoff."""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gpuherd.jobenv import ElasticPlan
from gpuherd.train.elastic import (
    ElasticSampler,
    ElasticState,
    GlobalBatchError,
    Membership,
    accumulation_steps,
    ledger,
)

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


def _free_ports(count: int) -> list[int]:
    """Distinct free ports (held open together, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


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


# -- rescaling examples/train_cnn.py's model while it trains, in real processes over gloo ---------------

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SAMPLES, CNN_BATCH, CNN_MICRO, CNN_STEPS = 96, 24, 4, 16  # 4 steps an epoch, 4 epochs


class StepPlans:
    """The test's scheduler and agent: generation n shows once this worker reaches step ``at[n]``
    and is in generation n - 1 (a new worker sees its own at once); the rollback plan once this
    worker reported a failed switch."""

    def __init__(
        self,
        timeline: list[tuple[int, ElasticPlan]],
        step: Callable[[], int],
        current: Callable[[], int | None],
        not_before: int,
    ) -> None:
        self.timeline, self.step, self.current, self.not_before = timeline, step, current, not_before
        self.rollback: ElasticPlan | None = None
        self.failed = False
        self.shown: dict[int, float] = {}

    def latest(self) -> ElasticPlan | None:
        step = max(self.step(), self.not_before)
        visible = [plan for at, plan in self.timeline if at <= step]
        if (current := self.current()) is not None:
            visible = [plan for plan in visible if plan.generation <= current + 1]
        if self.failed and self.rollback is not None:
            visible.append(self.rollback)
        if not visible:
            return None
        plan = max(visible, key=lambda p: p.generation)
        return dataclasses.replace(plan, decided_at=self.shown.setdefault(plan.generation, time.time()))


class LedgerState(ElasticState):
    """Records which samples this worker trained on, per epoch, once each step is done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.used: dict[int, list[int]] = {}
        self._pending: list[int] = []

    def micro_batches(self):  # type: ignore[no-untyped-def]
        self._pending = []
        for indices, last in super().micro_batches():
            self._pending.extend(int(i) for i in indices)
            yield indices, last

    def finish_step(self) -> None:
        self.used.setdefault(self.sampler.epoch, []).extend(self._pending)
        super().finish_step()


def _cnn_worker(
    worker: str,
    timeline: list[tuple[int, ElasticPlan]],
    rollback: ElasticPlan | None,
    not_before: int,
    doomed: bool,
    out: mp.Queue,
) -> None:
    sys.path.insert(0, str(EXAMPLES))
    from synthetic import elastic_steps, make_dataset
    from train_cnn import SmallResNet

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    inputs, labels = make_dataset(SAMPLES, (3, 16, 16), 10, seed=0)
    model = SmallResNet(width=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    state = LedgerState(
        model, optimizer, sampler=ElasticSampler(SAMPLES, CNN_BATCH, seed=3), scheduler=scheduler, micro_batch=CNN_MICRO
    )
    membership: Membership | None = None
    plans = StepPlans(
        timeline,
        lambda: state.step,
        lambda: membership.current.generation if membership and membership.current else None,
        not_before,
    )
    plans.rollback = rollback
    reports: list[dict] = []

    def reporter(message: dict) -> None:
        reports.append(message)
        plans.failed = plans.failed or message["event"] == "failed"

    membership = Membership(
        worker, plans, reform_timeout_s=5.0, join_timeout_s=120.0, recover_timeout_s=60.0, reporter=reporter
    )
    state.membership = membership
    if doomed:  # killed during re-formation: after it told the others it is ready, before it joins
        dist.init_process_group = lambda *a, **k: os._exit(9)
    # A step takes at least 0.2 s, as real ones do: new workers start while the old ones train.
    losses = elastic_steps(state, inputs, labels, CNN_STEPS, on_step=lambda *_: time.sleep(0.2))
    finished = state.step == CNN_STEPS and not state.membership.left
    params = [p.detach().numpy().tobytes() for p in model.parameters()] if finished else None
    state.membership.close()
    out.put((worker, state.used, losses, params, reports))


def _plan(generation: int, workers: str, port: int, source: str, joiners: str = "") -> ElasticPlan:
    return ElasticPlan(generation, tuple(workers), "127.0.0.1", port, source, joiners=tuple(joiners))


def _run_cnn(
    timeline: list[tuple[int, ElasticPlan]],
    *,
    rollback: ElasticPlan | None = None,
    doomed: str = "",
    expect: int | None = None,
) -> dict[str, tuple]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    plans = [plan for _, plan in timeline] + ([rollback] if rollback else [])
    workers = sorted({w for plan in plans for w in plan.workers})
    first_seen = {w: next(at for at, plan in timeline if w in plan.workers) for w in workers}
    procs = [
        context.Process(target=_cnn_worker, args=(w, timeline, rollback, first_seen[w], w == doomed, queue))
        for w in workers
    ]
    for proc in procs:
        proc.start()
    results = {}
    for _ in range(expect if expect is not None else len(procs)):
        worker, *rest = queue.get(timeout=240)
        results[worker] = rest
    for proc in procs:  # every result is in; a worker slow to exit (gloo, store threads) is not waited for
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    return results


def _params(result: tuple) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(result[2])), dtype=torch.float32)


def _each_sample_once(results: dict[str, tuple]) -> None:
    epochs: dict[int, list[int]] = {}
    for used, *_ in results.values():
        for epoch, indices in used.items():
            epochs.setdefault(epoch, []).extend(indices)
    assert sorted(epochs) == [0, 1, 2, 3]
    for indices in epochs.values():
        assert len(indices) == len(set(indices)) == SAMPLES  # 4 steps x 24: the whole epoch, once


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.long
def test_train_cnn_rescaled_2_3_1_2_ends_like_a_fixed_2_worker_run() -> None:
    p = _free_ports(5)
    elastic = [
        (0, _plan(0, "ab", p[0], "a")),
        (4, _plan(1, "abc", p[1], "a", joiners="c")),
        (8, _plan(2, "b", p[2], "b")),  # a (the old rank 0) and c leave; b is the oldest survivor
        (12, _plan(3, "bd", p[3], "b", joiners="d")),
    ]
    resized = _run_cnn(elastic)
    fixed = _run_cnn([(0, _plan(0, "ab", p[4], "a"))])

    # Not bit for bit: at 3 and 1 workers the gradient sums run in another order. Stated
    # tolerance after 16 steps: 1e-5 relative, 1e-6 absolute.
    torch.testing.assert_close(_params(resized["b"]), _params(fixed["a"]), rtol=1e-5, atol=1e-6)
    ran_by_a = len(resized["a"][1])  # a left at generation 2; b ran every step
    assert resized["b"][1][:ran_by_a] == resized["a"][1]
    torch.testing.assert_close(torch.tensor(resized["b"][1]), torch.tensor(fixed["a"][1]), rtol=1e-5, atol=1e-6)
    _each_sample_once(resized)
    _each_sample_once({"a": fixed["a"], "b": fixed["b"]})
    assert resized["a"][2] is None and resized["c"][2] is None  # they left at generation 2
    completed = [r for r in resized["b"][3] if r["event"] == "completed"]
    assert [r["generation"] for r in completed] == [2, 3]  # reported by the new rank 0 (b); gen 1 by a
    assert [r["generation"] for r in resized["a"][3] if r["event"] == "completed"] == [1]
    for report in completed:
        t = report["times"]
        assert t["decided"] <= t["noticed"] <= t["quiesced"] <= t["reformed"] <= t["restored"] <= t["first_step"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.long
def test_a_worker_killed_during_re_formation_rolls_back_and_trains_bit_identically() -> None:
    p = _free_ports(5)
    elastic = [
        (0, _plan(0, "ab", p[0], "a")),
        (3, _plan(1, "abc", p[1], "a", joiners="c")),  # c dies after saying it is ready
        (9, _plan(3, "bd", p[3], "b", joiners="d")),  # later a handoff at the same size: a leaves, d joins
    ]
    rollback = _plan(2, "ab", p[2], "a")  # what the scheduler commits on RescaleFailed
    resized = _run_cnn(elastic, rollback=rollback, doomed="c", expect=3)  # c never reports
    fixed = _run_cnn([(0, _plan(0, "ab", p[4], "a"))])

    # The world size is 2 throughout, so the arithmetic is the fixed run's: bit-identical.
    assert resized["b"][2] == fixed["a"][2]
    assert resized["b"][1] == fixed["a"][1]
    _each_sample_once({k: v for k, v in resized.items()})
    failed = {w: [(r["generation"], r["step"]) for r in resized[w][3] if r["event"] == "failed"] for w in "ab"}
    (generation, step), *more = failed["a"]
    assert not more and failed["b"] == failed["a"]  # both rolled back once, to the same step
    assert generation == 1 and step >= 3  # the first boundary from step 3 on where c said it was ready
    assert [r["generation"] for r in resized["a"][3] if r["event"] == "completed"] == [2]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_with_linear_lr_scaling_the_batch_follows_the_world_and_no_sample_repeats(worlds: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    sampler = ElasticSampler(100, 4, seed=1, fixed_batch=False)
    state = ElasticState(model, optimizer, sampler=sampler, scheduler=scheduler, micro_batch=4, lr_scaling="linear")
    used: dict[int, list[int]] = {}
    before = 0
    for world in worlds:
        lr = optimizer.param_groups[0]["lr"]
        state.adapt(world, before)
        expected = lr if before in (0, world) else lr * world / before
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        assert sampler.global_batch == 4 * world and state.accumulation == 1
        epoch = sampler.epoch
        for rank in range(world):
            for micro in sampler.micro_batches(rank, world, 4):
                used.setdefault(epoch, []).extend(int(i) for i in micro)
        optimizer.step()
        state.finish_step()
        before = world
    for indices in used.values():
        assert len(indices) == len(set(indices))


def test_an_lr_scaling_rule_needs_a_sampler_whose_batch_may_change() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GlobalBatchError, match="fixed_batch=False"):
        ElasticState(model, optimizer, sampler=ElasticSampler(10, 2), lr_scaling="linear")
    with pytest.raises(GlobalBatchError, match="keeps its global batch"):
        ElasticSampler(10, 2).resize(4)


def test_a_plan_file_gives_the_newest_whole_plan_the_agent_wrote(tmp_path: Path) -> None:
    from gpuherd.train.elastic import PlanFile

    path = tmp_path / "elastic-plan.json"
    plans = PlanFile(path)
    assert plans.latest() is None  # nothing written yet
    for generation in (0, 1):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(_plan(generation, "ab", 29500 + generation, "a").to_json())
        os.replace(tmp, path)  # as the agent writes it: same size each time, a new inode
        latest = plans.latest()
        assert latest is not None and latest.generation == generation
    path.write_text('{"generation": 2, "work')  # a torn write is never taken
    assert plans.latest() is not None and plans.latest().generation == 1
    path.write_text(_plan(0, "ab", 29500, "a").to_json())  # an older plan does not replace a newer one
    assert plans.latest().generation == 1


class _Plans:
    """Plans handed over by the test, newest last."""

    def __init__(self, *plans: ElasticPlan) -> None:
        self.plans = list(plans)

    def latest(self) -> ElasticPlan | None:
        return self.plans[-1] if self.plans else None


def _one_worker(port: int) -> tuple[nn.Module, torch.optim.Optimizer, _Plans, list[dict], Membership]:
    """A one-worker group's parts at generation 0 on ``port``: model, optimizer, plans, the reports
    its membership sends, and the membership."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plans = _Plans(ElasticPlan(0, ("a",), "127.0.0.1", port, "a"))
    reports: list[dict] = []
    membership = Membership("a", plans, reform_timeout_s=30.0, reporter=reports.append)
    return model, optimizer, plans, reports, membership


def _in_a_process(target: Callable[[list[int], mp.Queue], None]) -> Any:
    """What ``target(two free ports, queue)`` puts on the queue, run in a fresh process (stopped after)."""
    context = mp.get_context("spawn")
    out = context.Queue()
    proc = context.Process(target=target, args=(_free_ports(2), out))
    proc.start()
    try:
        return out.get(timeout=90)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _switch_while_the_port_is_held(ports: list[int], out: mp.Queue) -> None:
    """One worker: generation 0, then generation 1 at a port another process still listens on for a second."""
    import threading

    model, optimizer, plans, reports, membership = _one_worker(ports[0])
    state = ElasticState(model, optimizer, sampler=ElasticSampler(8, 4), membership=membership)
    assert state.sync()
    state.finish_step()
    held = socket.socket()
    held.bind(("0.0.0.0", ports[1]))
    held.listen()
    plans.plans.append(ElasticPlan(1, ("a",), "127.0.0.1", ports[1], "a", decided_at=time.time()))
    threading.Timer(1.0, held.close).start()  # the port's last holder goes away a second later
    switched = state.sync()
    state.finish_step()
    assert state.sync()  # the first step at the new generation is done: its rank 0 reports it
    generation = membership.current.generation if membership.current is not None else -1
    membership.close()
    out.put((switched, generation, reports))


@pytest.mark.timeout(120)
def test_a_generation_s_store_opens_once_its_port_is_free_instead_of_failing_the_switch() -> None:
    """A port still held (by a process that is ending, in TIME_WAIT) delays the switch; it does not
    fail it: the host tries again, bounded, and the rescale completes."""
    switched, generation, reports = _in_a_process(_switch_while_the_port_is_held)
    assert switched and generation == 1
    assert [r["event"] for r in reports] == ["completed"]  # no "failed": no rollback was needed
    assert set(reports[0]["times"]) == {"decided", "noticed", "quiesced", "reformed", "restored", "first_step"}
    assert all(reports[0]["times"].values())


def _lr_scaled_steps_then_switch(ports: list[int], out: mp.Queue) -> None:
    """One worker under linear LR scaling, its sampler made with a global batch of 96: at world 1 a
    step is 1 x 8 samples. Six steps of at least 50 ms, then a switch to generation 1."""
    model, optimizer, plans, reports, membership = _one_worker(ports[0])
    sampler = ElasticSampler(960, 96, fixed_batch=False)
    state = ElasticState(model, optimizer, sampler=sampler, micro_batch=8, membership=membership, lr_scaling="linear")
    for _ in range(6):
        assert state.sync()
        time.sleep(0.05)
        state.finish_step()
    plans.plans.append(ElasticPlan(1, ("a",), "127.0.0.1", ports[1], "a", decided_at=time.time()))
    assert state.sync()
    state.finish_step()
    assert state.sync()  # the first step at generation 1 is done: its rank 0 reports the rescale
    membership.close()
    out.put((sampler.global_batch, reports))


@pytest.mark.timeout(120)
def test_the_throughput_reported_at_a_rescale_counts_the_batch_the_steps_ran_under_lr_scaling() -> None:
    """Under an LR-scaling rule the batch follows the world: the samples per second a rescale
    reports (the elastic service's measured throughput) are those of the batch the steps ran."""
    batch, reports = _in_a_process(_lr_scaled_steps_then_switch)
    assert batch == 8
    (completed,) = [r for r in reports if r["event"] == "completed"]
    assert 0 < completed["samples_per_s_before"] <= 8 / 0.05  # 8 samples a step, each step 50 ms or more
