"""Every event in one tagged union (the JSON field ``type`` names the class), so a single typed
decoder reads the whole log; old shapes go through the upcasters."""

from __future__ import annotations

from typing import Any

import msgspec

from gpuherd.errors import EventDecodeError
from gpuherd.events.base import UPCASTERS, Event
from gpuherd.events.cluster import (
    AnalyticsTicked,
    ClockTicked,
    CommandRefused,
    ElasticTicked,
    LeadershipTaken,
    MemoryTicked,
    PolicyConfigured,
    VcConfigured,
)
from gpuherd.events.elastic import (
    ElasticConfigured,
    JobResized,
    RescaleCompleted,
    RescaleFailed,
    RescaleProposed,
    WorkerLost,
)
from gpuherd.events.jobs import (
    JobCancelRequested,
    JobDurationPredicted,
    JobFinished,
    JobPlaced,
    JobPreempted,
    JobRejected,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    ProfileReported,
    ProfileRequested,
    TaskEnded,
)
from gpuherd.events.leases import (
    MemoryBrokerConfigured,
    MemoryLeaseDenied,
    MemoryLeaseGranted,
    MemoryLeaseReclaimed,
    MemoryLeaseReleased,
    MemoryLeaseRenewed,
    MemoryLeaseRequested,
    MemoryLeaseRevoked,
)
from gpuherd.events.nodes import (
    GpuHealthChanged,
    GpuMemoryReported,
    NodeDrained,
    NodeLost,
    NodePowerDownRequested,
    NodePoweredDown,
    NodePoweredUp,
    NodePowerUpRequested,
    NodeRegistered,
    NodeUndrained,
    NodeWakeRequested,
)

AnyEvent = (
    NodeRegistered
    | NodeDrained
    | NodeUndrained
    | NodeLost
    | NodePowerDownRequested
    | NodePowerUpRequested
    | NodeWakeRequested
    | NodePoweredDown
    | NodePoweredUp
    | GpuHealthChanged
    | GpuMemoryReported
    | ClockTicked
    | ElasticTicked
    | MemoryTicked
    | AnalyticsTicked
    | VcConfigured
    | PolicyConfigured
    | CommandRefused
    | JobSubmitted
    | JobRejected
    | JobPlaced
    | JobStarted
    | JobFinished
    | TaskEnded
    | JobCancelRequested
    | JobDurationPredicted
    | JobPreempted
    | JobRequeued
    | ProfileRequested
    | ProfileReported
    | RescaleProposed
    | JobResized
    | RescaleCompleted
    | RescaleFailed
    | WorkerLost
    | ElasticConfigured
    | MemoryLeaseRequested
    | MemoryLeaseGranted
    | MemoryLeaseDenied
    | MemoryLeaseRenewed
    | MemoryLeaseRevoked
    | MemoryLeaseReleased
    | MemoryLeaseReclaimed
    | MemoryBrokerConfigured
    | LeadershipTaken
)

EVENT_TYPES: dict[str, type[Event]] = {cls.__name__: cls for cls in AnyEvent.__args__}  # type: ignore[attr-defined]


def upcast(raw: dict[str, Any]) -> dict[str, Any]:
    """Bring a raw event dict up to its class's current version (following a rename, if any)."""
    while True:
        type_name = raw.get("type")
        cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
        if cls is None:
            raise EventDecodeError(f"unknown event type {type_name!r}")
        version = int(raw.get("v", 1))
        if version >= cls.VERSION:
            return raw
        step = UPCASTERS.get((cls.__name__, version))
        if step is None:
            raise EventDecodeError(f"no upcaster for {cls.__name__} v{version} -> v{version + 1}")
        raw = step(dict(raw))
        if raw.get("type") == type_name and int(raw.get("v", version + 1)) <= version:
            raise EventDecodeError(f"the upcaster of {cls.__name__} v{version} did not raise the version")


class Unreadable(Event, kw_only=True, frozen=True):
    """A stored message that does not decode as an event. Readers make it (it is never written):
    deciders fold it as nothing, and their shell reports it as a dead letter, so one bad message
    neither stops every reader of the log nor vanishes."""

    stored_subject: str
    reason: str
    data: bytes = b""

    def subject(self) -> str:
        return self.stored_subject


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)
_raw_decoder = msgspec.json.Decoder(dict[str, Any])


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> Event:
    """Decode one stored event; old versions go through the upcasters."""
    try:
        event = _decoder.decode(data)
    except msgspec.ValidationError:
        event = None  # possibly an older shape: take the slow path
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not an event: {exc}") from exc
    if event is not None and event.v == type(event).VERSION:
        return event
    try:
        raw = _raw_decoder.decode(data)
        return msgspec.convert(upcast(raw), AnyEvent)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"invalid event: {exc}") from exc
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a field an upcaster needs is unusable
        raise EventDecodeError(f"invalid event: {type(exc).__name__}: {exc}") from exc
