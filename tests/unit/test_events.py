import importlib
import math
import pkgutil
import sys
from typing import Any, ClassVar

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gpuherd.events
from gpuherd import events as ev
from gpuherd.errors import EventDecodeError

GPU = ev.GpuInfo(index=0, uuid="GPU-1", model="H100", memory_mb=81920, nvlink_peers=(1,))
SPEC = ev.JobSpec(name="train", user="ana", gpus=2, duration_s=5.0)

SAMPLES: list[ev.Event] = [
    ev.NodeRegistered(id="a", at=1.0, source="agent", node="n1", gpus=(GPU,), rack="r1"),
    ev.NodeDrained(id="b", node="n1", reason="maintenance"),
    ev.NodeUndrained(id="c", node="n1"),
    ev.NodeLost(id="d", node="n1", reason="no heartbeat"),
    ev.VcConfigured(id="e", vc="vision", gpu_quota=16),
    ev.JobSubmitted(id="f", job="j1", spec=SPEC, intake_source="cli", intake_seq=3, based_on=2, cause="x"),
    ev.JobRejected(id="g", intake_source="cli", intake_seq=4, reason="bad"),
    ev.JobPlaced(
        id="h",
        job="j1",
        attempt=0,
        allocations=(ev.Allocation("n1", (0, 1)),),
        based_on=9,
        cause="f",
        locality="island",
        rendezvous=ev.Rendezvous("10.0.0.1", 29500),
    ),
    ev.JobStarted(id="i", job="j1", attempt=0, node="n1"),
    ev.JobFinished(id="j", job="j1", attempt=0, outcome="completed", exit_code=0),
    ev.JobCancelRequested(id="k", job="j1"),
    ev.JobRequeued(id="l", job="j1", attempt=0, reason="node lost"),
    ev.ClockTicked(id="m", source="scheduler", last_heard={"n1": 1.0}, lost_after_s=10.0),
    ev.TaskEnded(id="n", job="j1", attempt=0, node="n1", outcome="failed", exit_code=1, output_tail="boom"),
    ev.PolicyConfigured(id="o", policy="las", params={"starvation_factor": 4.0}),
    ev.LeadershipTaken(id="scheduler:leader:a:1", source="scheduler", service="scheduler", instance="a"),
    ev.GpuHealthChanged(id="p", node="n1", index=3, healthy=False, reason="XID 79"),
    ev.JobDurationPredicted(id="q", job="j1", seconds=3600.0, model="gbdt-v1"),
    ev.JobPreempted(id="r", job="j1", attempt=0, reason="priority", by="j2", grace_s=10.0),
    ev.NodePowerDownRequested(id="s", node="n1", reason="forecast needs 3 nodes", based_on=5, cause="m"),
    ev.NodePowerUpRequested(id="t", node="n1", reason="2 jobs wait for 16 GPUs"),
    ev.NodePoweredDown(id="u", node="n1", cause="s"),
    ev.NodePoweredUp(id="w", node="n1", cause="t"),
    ev.ProfileRequested(id="x", job="j1", steps=3),
    ev.ProfileReported(
        id="y", job="j1", attempt=0, node="n1", rank=0, request="x", profile={"model": "M", "layers": [{"name": "fc"}]}
    ),
    ev.RescaleProposed(id="z1", job="j1", attempt=0, generation=0, gpus=3, reason="idle GPUs", based_on=4, cause="i"),
    ev.JobResized(
        id="z2",
        job="j1",
        attempt=0,
        generation=1,
        allocations=(ev.Allocation("n1", (0, 1)), ev.Allocation("n2", (4,))),
        rendezvous=ev.Rendezvous("10.0.0.1", 29501),
        state_from="n1/0",
        joiners=("n2/4",),
        kind="grow",
    ),
    ev.RescaleCompleted(
        id="z3",
        job="j1",
        attempt=0,
        generation=1,
        node="n1",
        world=3,
        world_before=2,
        times={"decided": 1.0, "noticed": 1.1, "quiesced": 2.0, "reformed": 2.1, "restored": 2.2, "first_step": 2.5},
        samples_per_s_before=640.0,
    ),
    ev.RescaleFailed(id="z4", job="j1", attempt=0, generation=1, node="n1", reason="timeout", step=40),
    ev.ElasticConfigured(id="z6", params={"min_interval_s": 30.0}),
    ev.WorkerLost(id="z5", job="j1", attempt=0, node="n2", gpu=4, exit_code=137, reason="killed by SIGKILL"),
    ev.GpuMemoryReported(id="m1", node="n1", used_mb=(1024, 70000)),
    ev.MemoryLeaseRequested(id="m2", lease="L1", job="j1", attempt=0, node="n1", gpu=0, mb=8192, min_mb=1024),
    ev.MemoryLeaseGranted(
        id="m3",
        lease="L1",
        job="j1",
        attempt=0,
        node="n1",
        gpu=0,
        shares=(ev.MemoryShare("nvlink", 4096, 1), ev.MemoryShare("host", 4096)),
        expires_at=600.0,
        based_on=7,
        cause="m2",
    ),
    ev.MemoryLeaseDenied(id="m4", lease="L2", job="j1", reason="job j1 does not run on n1"),
    ev.MemoryLeaseRenewed(id="m5", lease="L1", job="j1"),
    ev.MemoryLeaseRevoked(id="m6", lease="L1", job="j1", gpus=(1,), deadline=30.0, reason="lender needs it"),
    ev.MemoryLeaseReleased(id="m7", lease="L1", job="j1", gpus=(1,), reason="revoked"),
    ev.MemoryLeaseReclaimed(id="m8", lease="L1", job="j1", reason="job finished"),
    ev.MemoryBrokerConfigured(id="m9", params={"lease_term_s": 300.0}),
    ev.NodeWakeRequested(id="w1", node="n1", reason="2 jobs wait for 16 GPUs", based_on=3, cause="f"),
    ev.CommandRefused(id="w2", command="PolicyConfigured", command_id="o", reason="unknown policy", based_on=3),
    ev.ElasticTicked(id="w3", at=5.0, source="elastic"),
    ev.MemoryTicked(id="w4", at=5.0, source="memory"),
    ev.AnalyticsTicked(id="w5", at=5.0, source="analytics"),
    ev.JobTimeLimitReached(id="t1", job="j1", attempt=0, limit_s=600.0, based_on=12, cause="m"),
]


def test_catalogue_covers_every_sample() -> None:
    assert {type(e).__name__ for e in SAMPLES} == set(ev.EVENT_TYPES)


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_event_class_is_in_the_catalogue_unless_it_says_it_is_not() -> None:
    """Every Event subclass of every module of gpuherd.events (and any other imported so far) is in
    the catalogue, the codec's union and ``gpuherd.events``, or declares ``CATALOGUED = False``."""
    for module in pkgutil.iter_modules(gpuherd.events.__path__):
        importlib.import_module(f"gpuherd.events.{module.name}")
    union = set(ev.any_event().__args__)
    for cls in _subclasses(ev.Event):
        if cls.__module__ not in sys.modules:
            continue  # a plugin's module, unloaded (and its types uncatalogued) by its test
        if not cls.__dict__.get("CATALOGUED", True):
            assert cls not in union, cls
            continue
        assert ev.EVENT_TYPES[cls.__name__] is cls, f"{cls.__name__} is not in the catalogue"
        assert cls in union, f"{cls.__name__} is not in the codec's union"
        if cls.__module__.startswith("gpuherd.events."):
            assert getattr(ev, cls.__name__) is cls and cls.__name__ in ev.__all__


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


@pytest.mark.parametrize("kind", sorted(ev.EVENT_TYPES))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_every_catalogued_event_type_round_trips_through_the_codec(kind: str, data: st.DataObject) -> None:
    """Drawn from the class's own fields, so a new event is tested the moment it is defined."""
    event = data.draw(st.builds(ev.EVENT_TYPES[kind]))
    assume(_finite(msgspec.to_builtins(event)))  # (JSON has no NaN: no writer stores one)
    assert ev.decode(ev.encode(event)) == event


def test_an_event_defined_later_joins_the_union_and_two_classes_may_not_share_a_name() -> None:
    class PluginThingHappened(ev.Event, kw_only=True, frozen=True):
        """(A plugin service's own event, defined after the codec was first used.)"""

        thing: str

        def subject(self) -> str:
            return f"herd.plugin.{self.thing}"

    try:
        event = PluginThingHappened(id="p1", thing="t")
        assert ev.decode(ev.encode(event)) == event
        with pytest.raises(TypeError, match="two event types named JobPlaced"):

            class JobPlaced(ev.Event, kw_only=True, frozen=True):
                CATALOGUED: ClassVar[bool] = True

        assert ev.EVENT_TYPES["JobPlaced"] is ev.JobPlaced
    finally:
        ev.EVENT_TYPES.pop("PluginThingHappened", None)


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_roundtrip(event: ev.Event) -> None:
    data = ev.encode(event)
    assert msgspec.json.decode(data)["type"] == type(event).__name__
    assert ev.decode(data) == event


def test_every_event_has_provenance_fields() -> None:
    for event in SAMPLES:
        assert {"id", "at", "source", "v"} <= set(event.__struct_fields__)
    for cls in (ev.JobSubmitted, ev.JobRejected, ev.JobPlaced, ev.JobRequeued):
        assert {"based_on", "cause"} <= set(cls.__struct_fields__)


def test_subjects_are_per_aggregate() -> None:
    assert SAMPLES[0].subject() == "herd.node.n1"
    assert SAMPLES[7].subject() == "herd.job.j1"
    assert SAMPLES[4].subject() == "herd.vc.vision"


# A NodeRegistered exactly as v1 agents wrote it (homogeneous GPUs, no UUIDs).
V1_NODE_REGISTERED = (
    b'{"type":"NodeRegistered","id":"agent.n7:register:1f2e","at":1700000000.5,"source":"agent.n7",'
    b'"v":1,"node":"n7","gpu_count":4,"gpu_model":"V100-SXM2-32GB","gpu_memory_mb":32768,"rack":"r2",'
    b'"executor":"sim","boot_id":"1f2e"}'
)


def test_upcaster_reads_v1_payload() -> None:
    event = ev.decode(V1_NODE_REGISTERED)
    assert isinstance(event, ev.NodeRegistered)
    assert event.v == ev.NodeRegistered.VERSION == 2
    assert [g.index for g in event.gpus] == [0, 1, 2, 3]
    assert {g.model for g in event.gpus} == {"V100-SXM2-32GB"}
    assert {g.memory_mb for g in event.gpus} == {32768}
    assert event.gpus[2].uuid == "n7-gpu2"
    assert event.rack == "r2" and event.node == "n7"
    # Re-encoding writes the current version, which decodes on the fast path.
    assert ev.decode(ev.encode(event)) == event


def test_unknown_type_and_garbage_are_specific_errors() -> None:
    with pytest.raises(EventDecodeError, match="unknown event type"):
        ev.decode(b'{"type":"Nope","id":"x"}')
    with pytest.raises(EventDecodeError, match="not an event"):
        ev.decode(b"\xff not json")
    with pytest.raises(EventDecodeError, match="invalid event"):
        ev.decode(b'{"type":"JobStarted","id":"x","v":1,"job":3,"attempt":0,"node":"n"}')


def test_missing_upcaster_is_reported() -> None:
    payload = b'{"type":"NodeRegistered","id":"x","v":0,"node":"n"}'
    with pytest.raises(EventDecodeError, match="no upcaster for NodeRegistered v0"):
        ev.decode(payload)


def test_stable_id_is_deterministic_and_subject_safe() -> None:
    a = ev.stable_id("cli", "job-1")
    assert a == ev.stable_id("cli", "job-1")
    assert a != ev.stable_id("cli", "job-2")
    assert a.isalnum()


def _v1(kind: str, source: str, **fields: object) -> bytes:
    return msgspec.json.encode({"type": kind, "id": f"{source}:x:1", "at": 7.0, "source": source, "v": 1, **fields})


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("scheduler", ev.ClockTicked),
        ("sim", ev.ClockTicked),
        ("elastic", ev.ElasticTicked),
        ("memory", ev.MemoryTicked),
        ("analytics", ev.AnalyticsTicked),
    ],
)
def test_a_v1_tick_becomes_the_tick_of_the_service_that_wrote_it(source: str, kind: type[ev.Tick]) -> None:
    event = ev.decode(_v1("ClockTicked", source, last_heard={}, lost_after_s=1e15))
    assert type(event) is kind and event.source == source and event.at == 7.0 and event.id == f"{source}:x:1"
    assert ev.decode(ev.encode(event)) == event


def test_a_scheduler_power_up_of_v1_is_a_wake_request_and_an_analytics_one_stays() -> None:
    woken = ev.decode(_v1("NodePowerUpRequested", "scheduler", node="n1", reason="jobs wait", based_on=3, cause="c"))
    assert isinstance(woken, ev.NodeWakeRequested) and woken.node == "n1" and woken.based_on == 3
    forecast = ev.decode(_v1("NodePowerUpRequested", "analytics", node="n1", reason="forecast"))
    assert isinstance(forecast, ev.NodePowerUpRequested) and forecast.v == 2


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        ("VcConfigured", {"vc": "a", "gpu_quota": -1}),
        ("PolicyConfigured", {"policy": "nonsense"}),
        ("NodeDrained", {"node": "n1"}),
        ("NodeUndrained", {"node": "n1"}),
        ("JobCancelRequested", {"job": "j1"}),
        ("ElasticConfigured", {"params": {"min_interval_s": 5.0}}),
        ("MemoryBrokerConfigured", {"params": {"lease_term_s": 5.0}}),
    ],
)
def test_commands_recorded_before_they_were_checked_are_marked_unchecked(kind: str, fields: dict) -> None:
    event = ev.decode(_v1(kind, "cli", **fields))
    assert isinstance(event, ev.Command) and event.unchecked and event.v == type(event).VERSION
    fresh = msgspec.structs.replace(event, unchecked=False)
    assert not ev.decode(ev.encode(fresh)).unchecked
    # A writer cannot exempt a command of today from the checks by setting the flag itself.
    assert not ev.decode(ev.encode(event)).unchecked
    forged_v2 = _v1(kind, "cli", **fields).replace(b'"v":1', b'"v":2').replace(b"{", b'{"unchecked":true,', 1)
    assert not ev.decode(forged_v2).unchecked


def test_policies_recorded_before_the_pass_had_versioned_rules_keep_the_first_rules() -> None:
    for version in (1, 2):
        old = ev.decode(_v1("PolicyConfigured", "cli", policy="fifo").replace(b'"v":1', f'"v":{version}'.encode()))
        assert isinstance(old, ev.PolicyConfigured) and old.rules == 1 and old.v == 3
    assert ev.PolicyConfigured(policy="fifo").rules == ev.SCHEDULING_RULES >= 13


def test_verdicts_of_v1_were_judged_by_the_first_intake_rules() -> None:
    spec = {"name": "a", "user": "b", "gpus": 1, "duration_s": 1.0}
    submitted = ev.decode(_v1("JobSubmitted", "scheduler", job="j", spec=spec, intake_source="cli"))
    assert isinstance(submitted, ev.JobSubmitted) and submitted.intake_rules == 1
    rejected = ev.decode(_v1("JobRejected", "scheduler", intake_source="cli", intake_seq=1, reason="bad"))
    assert isinstance(rejected, ev.JobRejected) and rejected.intake_rules == 1 and rejected.payload_size == 0
    assert ev.JobSubmitted(job="j", spec=ev.JobSpec(**spec), intake_source="cli").intake_rules == ev.INTAKE_RULES


def test_a_rescale_record_of_v1_gets_every_phase_a_missing_one_taking_the_next_one_s_stamp() -> None:
    simulated = (
        b'{"type":"RescaleCompleted","id":"r1","at":10.5,"source":"agent.n1","v":1,"job":"j","attempt":0,'
        b'"generation":1,"node":"n1","world":8,"world_before":2,"times":{"decided":10.0,"first_step":10.5}}'
    )
    event = ev.decode(simulated)
    assert isinstance(event, ev.RescaleCompleted) and event.v == ev.RescaleCompleted.VERSION == 2
    assert list(event.times) == list(ev.RESCALE_PHASES)
    # A simulated switch is instantaneous: everything after the decision happens at its first step.
    assert event.durations()["notice_s"] == 0.5 and event.durations()["pause_s"] == 0.0
    # A job grown before its first generation formed reported no quiesce: it stood still from re-forming on.
    unformed = simulated.replace(
        b'"times":{"decided":10.0,"first_step":10.5}',
        b'"times":{"decided":10.0,"noticed":11.0,"reformed":12.0,"restored":12.5,"first_step":13.0}',
    )
    times = ev.decode(unformed).times  # type: ignore[attr-defined]
    assert times["quiesced"] == times["reformed"] == 12.0
    assert ev.decode(unformed).durations()["pause_s"] == 1.0  # type: ignore[attr-defined]
    assert ev.decode(ev.encode(ev.decode(unformed))) == ev.decode(unformed)


def test_complete_phase_times_fills_forward_from_the_next_known_and_falls_back_at_the_end() -> None:
    assert ev.complete_phase_times({}, fallback=7.0) == dict.fromkeys(ev.RESCALE_PHASES, 7.0)
    out = ev.complete_phase_times({"noticed": 2.0, "restored": 4.0, "first_step": None})
    assert out == {"decided": 2.0, "noticed": 2.0, "quiesced": 4.0, "reformed": 4.0, "restored": 4.0, "first_step": 4.0}


def test_a_duration_prediction_of_v1_reads_as_a_point_estimate_of_an_unversioned_model() -> None:
    raw = b'{"type":"JobDurationPredicted","id":"p","at":5.0,"v":1,"job":"j1","seconds":600.0,"model":"backoff-median"}'
    event = ev.decode(raw)
    assert isinstance(event, ev.JobDurationPredicted) and event.v == 2
    assert (event.seconds, event.sigma, event.user_history, event.version, event.features) == (600.0, 0.0, 0, 0, "")
