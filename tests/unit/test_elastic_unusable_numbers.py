"""Numbers the elastic service cannot predict by do not stop it: a declared scaling with a compute
time of 0 (intake accepted it before rules 10), a rescale report of 0 samples/s or of a world beyond
any size, a profile whose step time rounds to 0 per sample. The service divided by zero on its next
tick, or a snapshot could not hold the number, after every restart until the job ended."""

from __future__ import annotations

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.decider import replay
from services.elastic.decide import ElasticDecider
from tests.helpers import node
from tests.unit.test_resize import ELASTIC, started
from tests.unit.test_scheduler_decider import drive


def tick_and_snapshot(log: list[Record]) -> list[ev.Event]:
    decider = ElasticDecider()
    state = replay(decider, log)
    decided = decider.decide(state, ev.ElasticTicked(id="tick", at=5000.0))
    decider.decode_state(decider.encode_state(state))  # (a snapshot holds it)
    return decided


@pytest.mark.parametrize("compute_per_sample_s", [0.0, -1.0, 5e-324 / 2])
def test_a_declared_scaling_that_predicts_nothing_is_taken_as_unknown(compute_per_sample_s: float) -> None:
    spec = ev.JobSpec(
        name="e", user="u", gpus=1, command=("python", "x.py"), elastic=ELASTIC,
        scaling=ev.Scaling(compute_per_sample_s=compute_per_sample_s, grad_bytes=0),
    )  # fmt: skip
    log = drive([node("n1", 4, executor="cpu", ports=(29500, 29599))])
    log = drive([ev.JobSubmitted(id="s", source="test", job="e", spec=spec, intake_source="t")], log)
    log = drive([ev.JobStarted(id="st", source="agent.n1", job="e", attempt=0, node="n1")], log)
    tick_and_snapshot(log)


@pytest.mark.parametrize(("world_before", "rate"), [(2, 0.0), (2, -3.0), (2, float("nan")), (10**23, 5.0), (0, 5.0)])
def test_a_rescale_report_the_policy_cannot_use_is_not_kept(world_before: int, rate: float) -> None:
    report = ev.RescaleCompleted(
        id="rc", source="agent.n1", job="j", attempt=0, generation=0, node="n1",
        world=2, world_before=world_before, samples_per_s_before=rate,
    )  # fmt: skip
    log = drive([report], started())
    assert "j" not in replay(ElasticDecider(), log).throughput
    tick_and_snapshot(log)


@pytest.mark.parametrize(
    "profile",
    [
        {"batch_size": 8, "step_s": 5e-324, "layers": []},  # a step time per sample of 0
        {"batch_size": 10**400, "step_s": 1.0, "layers": []},  # no float divides by it
        {"batch_size": 8, "step_s": float("inf"), "layers": []},
        {"batch_size": 8, "step_s": 1.0, "layers": [{"grad_bytes": 10**30}]},
        {"batch_size": 8, "step_s": 1.0, "layers": [{"grad_bytes": -1}]},
    ],
)
def test_a_profile_the_policy_cannot_use_is_not_kept(profile: dict) -> None:
    report = ev.ProfileReported(id="p", source="agent.n1", job="j", attempt=0, node="n1", rank=0, profile=profile)
    log = drive([report], started())
    assert "j" not in replay(ElasticDecider(), log).models
    tick_and_snapshot(log)


def test_a_usable_report_is_kept_as_before() -> None:
    report = ev.RescaleCompleted(
        id="rc", source="agent.n1", job="j", attempt=0, generation=0, node="n1",
        world=2, world_before=1, samples_per_s_before=120.0,
    )  # fmt: skip
    state = replay(ElasticDecider(), drive([report], started()))
    assert state.throughput["j"] == {1: 120.0}
    assert msgspec.json.decode(msgspec.json.encode(state.throughput)) == {"j": {"1": 120.0}}
