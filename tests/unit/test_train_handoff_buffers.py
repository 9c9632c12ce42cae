"""A handoff whose source is not the old rank 0 hands over the buffers DDP would train on next (the
old rank 0's, which DDP broadcasts at every forward), so BatchNorm statistics end as in a run
without rescale, bit for bit, like the parameters."""

from __future__ import annotations

import multiprocessing
import sys
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from gpuherd.jobenv import ElasticPlan
from gpuherd.train.elastic import ElasticSampler, ElasticState, Membership
from tests.unit.test_elastic import EXAMPLES, StepPlans, _free_ports, _plan

SAMPLES, BATCH, MICRO, STEPS = 96, 24, 4, 6
HANDOFF_AT = 2  # the plan shows at this step; the new worker is ready soon after (it started with the others)


def _worker(
    run: str, worker: str, timeline: list[tuple[int, ElasticPlan]], not_before: int, out: multiprocessing.Queue
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
    state = ElasticState(model, optimizer, sampler=ElasticSampler(SAMPLES, BATCH, seed=3), micro_batch=MICRO)
    membership: Membership | None = None
    plans = StepPlans(
        timeline,
        lambda: state.step,
        lambda: membership.current.generation if membership and membership.current else None,
        not_before,
    )
    reports: list[dict] = []
    membership = Membership(worker, plans, reform_timeout_s=5.0, join_timeout_s=60.0, reporter=reports.append)
    state.membership = membership
    losses = elastic_steps(state, inputs, labels, STEPS, on_step=lambda *_: time.sleep(0.15))
    finished = state.step == STEPS and not membership.left
    module = getattr(model, "module", model)
    params = [p.detach().numpy().tobytes() for p in module.parameters()] if finished else None
    buffers = {k: v.numpy().tobytes() for k, v in module.named_buffers()} if finished else None
    membership.close()
    out.put((run, worker, {"losses": losses, "params": params, "buffers": buffers, "reports": reports}))


def _run(runs: dict[str, list[tuple[int, ElasticPlan]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Every run's workers at once (real processes, gloo); each run's results by worker. Every
    process is stopped at the end, also when a result does not come."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = []
    for name, timeline in runs.items():
        for worker in sorted({w for _, plan in timeline for w in plan.workers}):
            first_seen = next(at for at, plan in timeline if worker in plan.workers)
            proc = context.Process(target=_worker, args=(name, worker, timeline, first_seen, queue))
            procs.append((name, worker, proc))
    try:
        for _, _, proc in procs:
            proc.start()
        results: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in runs}
        for _ in procs:
            name, worker, result = queue.get(timeout=90)
            results[name][worker] = result
        return results
    finally:
        for _, _, proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_handoff_from_a_worker_that_is_not_rank_0_keeps_rank_0_s_batchnorm_statistics() -> None:
    p = _free_ports(3)
    results = _run(
        {
            "fixed": [(0, _plan(0, "ab", p[0], "a"))],
            # a (the old rank 0) leaves, d joins; the source is b, the first committed worker still there
            "handoff": [(0, _plan(0, "ab", p[1], "a")), (HANDOFF_AT, _plan(1, "bd", p[2], "b", joiners="d"))],
        }
    )
    fixed, handoff = results["fixed"]["a"], results["handoff"]["b"]  # each run's rank 0 at the end
    assert [r["generation"] for r in handoff["reports"] if r["event"] == "completed"] == [1]  # it happened
    assert handoff["params"] == fixed["params"]  # bit-identical
    assert handoff["losses"] == fixed["losses"]
    differing = [name for name in fixed["buffers"] if handoff["buffers"][name] != fixed["buffers"][name]]
    assert not differing  # buffers (running_mean, running_var, num_batches_tracked): bit-identical too
