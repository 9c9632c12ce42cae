"""Fuzzing what comes from outside: intake payloads, stored bytes, and events whose fields are
valid types but nonsense values. Nothing may raise anything but the documented error, every bad
submission gets a reason, and a poison intake message ends as a dead letter."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.errors import EventDecodeError, LogError
from gpuherd.log import HERD_INTAKE, MAX_DELIVERIES, REPLY_HEADER, InProcessLog
from gpuherd.runtime.runner import DeciderRunner
from services.elastic.decide import ElasticDecider
from services.memory.decide import MemoryDecider
from services.scheduler import service
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission, judge
from services.scheduler.state import SchedulerState
from tests.helpers import node

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
SPEC_KEYS = (
    "name", "user", "vc", "gpus", "nodes", "duration_s", "command", "workdir", "env", "elastic", "memory",
    "intake_id", "priority", "image", "gpu_model",
)  # fmt: skip
spec_like = st.dictionaries(st.sampled_from(SPEC_KEYS) | st.text(max_size=8), json_values, max_size=8)


def cluster() -> SchedulerState:
    decider = SchedulerDecider()
    return decider.evolve(decider.initial_state(), 1, node("n1", 8))


def _judge(data: bytes) -> ev.Event:
    state = cluster()
    verdict = judge(state, Submission(source="fuzz", seq=7, data=data, at=1.0, msg_id=None))
    return verdict.event


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_raw_bytes_at_intake_are_answered(data: bytes) -> None:
    event = _judge(data)
    assert isinstance(event, ev.JobSubmitted | ev.JobRejected)
    if isinstance(event, ev.JobRejected):
        assert event.reason


@settings(max_examples=400, deadline=None)
@given(spec_like)
def test_spec_shaped_payloads_are_judged_with_a_reason(spec: dict[str, Any]) -> None:
    event = _judge(json.dumps(spec, allow_nan=True).encode())
    assert isinstance(event, ev.JobSubmitted | ev.JobRejected)
    if isinstance(event, ev.JobRejected):
        assert event.reason and len(event.reason) < 2000


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_stored_bytes_decode_or_raise_the_decode_error(data: bytes) -> None:
    with contextlib.suppress(EventDecodeError):
        ev.decode(data)


EVENT_TYPES = sorted(ev.EVENT_TYPES.items())


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(EVENT_TYPES), st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_event_tags_with_random_fields_decode_or_raise_the_decode_error(kind: tuple[str, Any], fields: dict) -> None:
    data = json.dumps({**fields, "type": kind[0]}, allow_nan=True).encode()
    with contextlib.suppress(EventDecodeError):
        ev.decode(data)


names = st.sampled_from(["n1", "n2", "j1", "j2", "x"])


def _event_strategy(cls: type[ev.Event]) -> st.SearchStrategy[ev.Event]:
    """Valid events of ``cls`` with small, colliding names, so they refer to each other."""
    overrides = {f: names for f in ("node", "job", "lease", "vc", "worker") if f in cls.__struct_fields__}
    return st.builds(cls, **overrides)


decodable_events = st.one_of(*(_event_strategy(cls) for _, cls in EVENT_TYPES))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(decodable_events, min_size=1, max_size=12))
def test_deciders_survive_valid_events_with_nonsense_values(events: list[ev.Event]) -> None:
    """Any decodable event, in any order, folds and is decided on without raising: a service that
    crashed on one would crash again on every restart."""
    for decider in (SchedulerDecider(), ElasticDecider(), MemoryDecider()):
        state = decider.initial_state()
        state = decider.evolve(state, 1, node("n1", 8))
        for seq, event in enumerate(events, start=2):
            data = ev.encode(event)
            try:
                event = ev.decode(data)  # what a reader would see...
            except EventDecodeError as exc:  # ...e.g. an infinite float, which JSON stores as null
                event = ev.Unreadable(stored_subject="herd.x", reason=str(exc), data=data)
            state = decider.evolve(state, seq, event)
            decider.decide(state, event)


async def test_a_poison_intake_message_ends_as_a_dead_letter() -> None:
    """The log refuses the verdict every time: the message stays unacknowledged and comes back until
    its last delivery, then it is kept as a dead letter with the reason, its submitter told, and
    acknowledged; the scheduler goes on deciding the rest."""

    class RefusingLog(InProcessLog):
        async def append(self, events, **kwargs):  # type: ignore[override]
            if any(isinstance(e, ev.JobSubmitted) and e.spec.name == "poison" for e in events):
                raise LogError("refused: message too large")
            return await super().append(events, **kwargs)

    log = RefusingLog()
    await log.append([node("n1", 4)])
    runner = DeciderRunner(log, SchedulerDecider(), instance="test")
    service.setup(runner, ack_wait_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    poison = msgspec.json.encode({"name": "poison", "user": "u", "gpus": 1, "duration_s": 1})
    fine = msgspec.json.encode({"name": "fine", "user": "u", "gpus": 1, "duration_s": 1})
    try:
        await log.publish_intake("ci", poison, {REPLY_HEADER: "inbox.9"})
        await log.publish_intake("ci", fine, {REPLY_HEADER: "inbox.10"})
        for _ in range(500):
            if await log.dead_letters() and any(to == "inbox.10" for to, _ in log.replies):
                break
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    [letter] = await log.dead_letters()
    assert letter.stream == HERD_INTAKE and letter.seq == 1 and letter.data == poison
    assert f"after {MAX_DELIVERIES} deliveries" in letter.reason and "message too large" in letter.reason
    [reply] = [msgspec.json.decode(r) for to, r in log.replies if to == "inbox.9"]
    assert reply["ok"] is False and "message too large" in reply["error"]
    submitted = [r.event.spec.name for r in await log.read_all() if isinstance(r.event, ev.JobSubmitted)]
    assert submitted == ["fine"], "the rest is decided and stored as usual"
