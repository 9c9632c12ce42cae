"""The scheduler's side of elastic jobs: committing proposals, rollbacks and recoveries as new
generations, and the fold that keeps GPUs, quotas and accounting in step."""

from __future__ import annotations

import itertools

from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.decider import replay
from services.elastic.decide import ElasticDecider
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import _spec_problem
from services.scheduler.state import SchedulerState, index_problems
from tests.helpers import node
from tests.unit.test_scheduler_decider import drive

ELASTIC = ev.Elastic(min=1, max=4, global_batch=24, micro_batch=4)  # sizes 1, 2, 3 (not 4)
SPEC = ev.JobSpec(name="cnn", user="ana", gpus=2, command=("python", "train.py"), elastic=ELASTIC)
_ids = itertools.count()


def _e(cls: type[ev.Event], **fields: object) -> ev.Event:
    return cls(id=f"t{next(_ids)}", source="test", **fields)  # type: ignore[call-arg]


def started() -> list[Record]:
    """Two 4-GPU cpu nodes; the elastic job placed on 2 GPUs of n1 and running."""
    log = drive(
        [
            node("n1", 4, executor="cpu", ports=(29500, 29599)),
            node("n2", 4, executor="cpu", ports=(29500, 29599)),
            ev.JobSubmitted(id="s", source="test", job="j", spec=SPEC, intake_source="t"),
        ]
    )
    placed = next(r.event for r in log if isinstance(r.event, ev.JobPlaced))
    assert placed.allocations == (ev.Allocation("n1", (0, 1)),)
    return drive([_e(ev.JobStarted, job="j", attempt=0, node="n1")], log)


_scheduler = SchedulerDecider()


def _state(log: list[Record]) -> SchedulerState:
    state = replay(_scheduler, log)
    assert not index_problems(state)
    return state


def apply(state: SchedulerState, seq: int, event: ev.Event) -> SchedulerState:
    return _scheduler.evolve(state, seq, event)


def _resized(log: list[Record]) -> list[ev.JobResized]:
    return [r.event for r in log if isinstance(r.event, ev.JobResized)]


def _propose(log: list[Record], gpus: int, generation: int = 0) -> list[Record]:
    return drive([_e(ev.RescaleProposed, job="j", attempt=0, generation=generation, gpus=gpus)], log)


def _completed(log: list[Record], generation: int, world: int, before: int, rate: float = 100.0) -> list[Record]:
    done = _e(
        ev.RescaleCompleted,
        job="j",
        attempt=0,
        generation=generation,
        node="n1",
        world=world,
        world_before=before,
        samples_per_s_before=rate,
    )
    return drive([done], log)


def test_a_grow_takes_free_gpus_next_to_the_job_and_starts_a_new_generation() -> None:
    log = _propose(started(), 3)
    (grow,) = _resized(log)
    assert grow.kind == "grow" and grow.generation == 1
    assert grow.allocations == (ev.Allocation("n1", (0, 1, 2)),)  # same node first
    assert grow.joiners == ("n1/2",) and grow.state_from == "n1/0"
    first = next(r.event for r in log if isinstance(r.event, ev.JobPlaced)).rendezvous
    assert grow.rendezvous is not None and first is not None and grow.rendezvous.port != first.port  # a new store
    state = _state(log)
    job = state.jobs["j"]
    assert (job.held, state.vc_used["default"], job.rescale) == (3, 3, "grow")
    assert state.nodes["n1"].gpus[2].job == "j"
    # While it is in flight, nothing else is committed; once done, it is the committed generation.
    assert _resized(_propose(log, 1, generation=1)) == [grow]
    log = _completed(log, 1, 3, 2, rate=200.0)
    job = _state(log).jobs["j"]
    assert job.rescale is None and job.committed == grow.allocations
    assert replay(ElasticDecider(), log).throughput["j"] == {2: 200.0}, "what the elastic service learns"
    assert violations(log) == []


def test_a_shrink_lets_the_newest_workers_go_and_frees_their_gpus_once_it_is_done() -> None:
    log = _completed(_propose(started(), 3), 1, 3, 2)
    log = _propose(log, 1, generation=1)
    shrink = _resized(log)[-1]
    assert shrink.kind == "shrink" and shrink.allocations == (ev.Allocation("n1", (0,)),)
    assert shrink.releasing == (ev.Allocation("n1", (1, 2)),) and shrink.state_from == "n1/0"
    state = _state(log)
    assert state.jobs["j"].held == 3 and state.nodes["n1"].gpus[2].job == "j"  # leaving workers still run
    state = _state(_completed(log, 2, 1, 3))
    assert state.jobs["j"].held == 1 and state.vc_used["default"] == 1
    assert [g.job for g in state.nodes["n1"].gpus] == ["j", None, None, None]


def test_a_proposal_for_a_job_cancelled_since_is_not_committed() -> None:
    # The elastic service proposed a grow; the job was cancelled before the scheduler decided it.
    log = drive([_e(ev.JobCancelRequested, job="j", reason="enough")], started())
    assert _state(log).jobs["j"].stopping()
    assert _resized(_propose(log, 3)) == [], "no workers start for a job that is going away"
    old_rules = drive([_e(ev.PolicyConfigured, policy="fifo", rules=7)], log)
    assert [r.kind for r in _resized(_propose(old_rules, 3))] == ["grow"], "the rules before committed it"


def test_only_sizes_that_keep_the_global_batch_and_current_proposals_are_committed() -> None:
    log = started()
    assert _resized(_propose(log, 4)) == []  # 24 is not 4 workers x whole micro-batches of 4
    assert _resized(_propose(log, 3, generation=5)) == []  # stale: based on another generation
    bad = ev.JobSpec(name="x", user="u", gpus=4, command=("x",), elastic=ELASTIC)
    problem = _spec_problem(bad, _state(log))
    assert problem is not None and "at 4 GPUs" in problem and "that work: 1, 2, 3" in problem
    linear = ev.JobSpec(name="x", user="u", gpus=4, command=("x",), elastic=ev.Elastic(1, 4, 24, 4, "linear"))
    assert _spec_problem(linear, _state(log)) is None  # an explicit LR-scaling rule takes any size


def test_a_failed_switch_rolls_back_to_the_committed_workers_and_the_joiners_leave() -> None:
    log = _propose(started(), 3)
    log = drive([_e(ev.RescaleFailed, job="j", attempt=0, generation=1, node="n1", reason="timeout", step=7)], log)
    rollback = _resized(log)[-1]
    assert rollback.kind == "rollback" and rollback.generation == 2
    assert rollback.allocations == (ev.Allocation("n1", (0, 1)),) and rollback.joiners == ()
    assert rollback.releasing == (ev.Allocation("n1", (2,)),) and rollback.state_from == "n1/0"
    # The other worker's report of the same failure changes nothing more.
    again = drive([_e(ev.RescaleFailed, job="j", attempt=0, generation=1, node="n1", reason="timeout")], log)
    assert _resized(again) == _resized(log)
    state = _state(_completed(log, 2, 2, 2))
    assert state.jobs["j"].held == 2 and state.nodes["n1"].gpus[2].job is None
    assert violations(log) == []


def test_a_dead_worker_shrinks_the_job_to_the_survivors_and_its_part_does_not_fail_the_job() -> None:
    log = _completed(_propose(started(), 3), 1, 3, 2)
    lost = _e(ev.WorkerLost, job="j", attempt=0, node="n1", gpu=1, exit_code=137, reason="killed by SIGKILL")
    log = drive([lost], log)
    recover = _resized(log)[-1]
    assert recover.kind == "recover" and recover.allocations == (ev.Allocation("n1", (0, 2)),)
    assert recover.state_from == "n1/0" and recover.joiners == ()
    state = _state(log)
    assert state.jobs["j"].held == 2 and state.nodes["n1"].gpus[1].job is None and not state.jobs["j"].lost_workers


def test_below_the_minimum_a_dead_worker_fails_the_attempt_as_usual() -> None:
    log = started()
    for gpu in (0, 1):
        log = drive([_e(ev.WorkerLost, job="j", attempt=0, node="n1", gpu=gpu, exit_code=1)], log)
    assert len(_resized(log)) == 1  # after the first: one survivor (min 1); after the second: none
    log = drive([_e(ev.TaskEnded, job="j", attempt=0, node="n1", outcome="failed", exit_code=1)], log)
    finished = [r.event for r in log if isinstance(r.event, ev.JobFinished)]
    assert finished and finished[0].outcome == "failed"


def test_a_part_that_failed_with_its_workers_reported_lost_is_ignored_while_the_job_can_go_on() -> None:
    state = _state(_completed(_propose(started(), 3), 1, 3, 2))
    seq = state.seq
    apply(state, seq + 1, _e(ev.WorkerLost, job="j", attempt=0, node="n1", gpu=2, exit_code=1))
    # n1 still has live workers: its task has not ended; a failed end of the whole node would count.
    apply(state, seq + 2, _e(ev.TaskEnded, job="j", attempt=0, node="n1", outcome="failed"))
    assert "n1" in state.jobs["j"].parts_ended


def test_an_elastic_range_without_bounds_lists_the_sizes_a_job_can_take() -> None:
    """Intake accepts any max at or above the job's GPUs, and an event may carry any range: the
    sizes listed start at one GPU and stop at ``MAX_ELASTIC_WORLD`` (a max of 10**12 took the
    memory of every decider that listed them)."""
    assert ev.Elastic(min=2, max=4).sizes() == [2, 3, 4]
    assert ev.Elastic(min=2, max=12, global_batch=48, micro_batch=2).sizes() == [2, 3, 4, 6, 8, 12]
    assert ev.Elastic(min=-70_197_882_383, max=3).sizes() == [1, 2, 3]
    huge = ev.Elastic(min=1, max=10**12).sizes()
    assert (huge[0], huge[-1], len(huge)) == (1, ev.MAX_ELASTIC_WORLD, ev.MAX_ELASTIC_WORLD)
