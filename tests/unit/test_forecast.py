"""Start-time forecasts: the scheduler's passes run forward on a copy of its state."""

from __future__ import annotations

import pytest

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.forecast import forecast_starts
from services.scheduler.policy import make_policy
from services.scheduler.state import SchedulerState


class Cluster:
    def __init__(self, gpus: int, *, policy: str = "fifo", backfill: bool = False, executor: str = "sim") -> None:
        self.decider = SchedulerDecider()
        self.state: SchedulerState = self.decider.initial_state()
        self.seq = 0
        node = ev.NodeRegistered(
            id="n1", node="n1", gpus=tuple(ev.declared_gpus("n1", gpus, island=0, model="SIM", memory_mb=1)),
            executor=executor,
        )  # fmt: skip
        self.fold(node, ev.PolicyConfigured(id="p", policy=policy, backfill=backfill))

    def fold(self, *events: ev.Event) -> None:
        for e in events:
            self.seq += 1
            self.decider.evolve(self.state, self.seq, e)

    def submit(self, job: str, gpus: int, duration_s: float | None, at: float, command: tuple[str, ...] = ()) -> None:
        spec = ev.JobSpec(name=job, user="u", gpus=gpus, duration_s=duration_s, command=command)
        self.fold(ev.JobSubmitted(id=f"s-{job}", at=at, job=job, spec=spec, intake_source="t"))

    def run_pass(self, at: float) -> None:
        for placed in self.decider.plan(self.state).placed:
            started = ev.JobStarted(id=f"st-{placed.job}", at=at, job=placed.job, attempt=0, node="n1")
            self.fold(placed, started)


def test_waiting_jobs_start_as_the_jobs_ahead_of_them_end() -> None:
    c = Cluster(2)
    c.submit("a", 2, 100.0, at=0.0)
    c.run_pass(at=0.0)
    c.submit("b", 2, 50.0, at=10.0)
    c.submit("c", 1, 20.0, at=11.0)
    before = c.decider.encode_state(c.state)
    assert forecast_starts(c.state, make_policy("fifo")) == {"b": 100.0, "c": 150.0}
    assert c.decider.encode_state(c.state) == before, "the state itself is not touched"
    assert forecast_starts(c.state, make_policy("fifo"), ["c"]) == {"c": 150.0}


def test_the_policy_in_force_decides_the_order() -> None:
    c = Cluster(2, policy="sjf")
    c.submit("a", 2, 100.0, at=0.0)
    c.run_pass(at=0.0)
    c.submit("long", 2, 500.0, at=10.0)
    c.submit("short", 2, 5.0, at=11.0)
    assert forecast_starts(c.state, make_policy("sjf")) == {"short": 100.0, "long": 105.0}


def test_a_job_behind_one_of_unknown_duration_has_no_forecast() -> None:
    c = Cluster(1, executor="cpu")
    c.submit("forever", 1, None, at=0.0, command=("python", "train.py"))
    c.run_pass(at=0.0)
    assert c.state.jobs["forever"].status == "running"
    c.submit("next", 1, 10.0, at=1.0, command=("python", "train.py"))
    assert forecast_starts(c.state, make_policy("fifo")) == {}


@pytest.mark.parametrize("backfill", [False, True])
def test_backfill_as_the_policy_records_it(backfill: bool) -> None:
    c = Cluster(2, backfill=backfill)
    c.submit("a", 1, 100.0, at=0.0)
    c.run_pass(at=0.0)
    c.submit("big", 2, 10.0, at=1.0)  # waits for a
    c.submit("small", 1, 50.0, at=2.0)  # ends before a: backfilled at once, if backfill is on
    starts = forecast_starts(c.state, make_policy("fifo"))
    assert starts["big"] == 100.0
    assert starts["small"] == (2.0 if backfill else 110.0)


def test_a_job_placed_but_not_started_yet_is_expected_to_end_its_duration_from_now() -> None:
    """A placed job has no start yet (its node agent is starting it): as far as a forecast can tell it
    starts now, and ends its declared duration later; it is not a job of unknown duration."""
    c = Cluster(2)
    c.submit("big", 2, 100.0, at=0.0)
    for placed in c.decider.plan(c.state).placed:
        c.fold(placed)
    assert c.state.jobs["big"].status == "placed"
    c.submit("small", 1, 10.0, at=3.0)
    assert forecast_starts(c.state, make_policy("fifo")) == {"small": 103.0}
    c.fold(ev.JobStarted(id="st-big", at=3.0, job="big", attempt=0, node="n1"))
    assert forecast_starts(c.state, make_policy("fifo")) == {"small": 103.0}
