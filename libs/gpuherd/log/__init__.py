"""The event log: one interface, a JetStream and an in-memory implementation."""

from gpuherd.log.base import (
    HERD,
    HERD_INTAKE,
    HERD_TELEMETRY,
    LEASE_BUCKET,
    SNAPSHOT_BUCKET,
    AppendResult,
    Delivery,
    DurableConsumer,
    EventLog,
    Lease,
    Record,
)
from gpuherd.log.memory import MemoryLog

__all__ = [
    "HERD",
    "HERD_INTAKE",
    "HERD_TELEMETRY",
    "LEASE_BUCKET",
    "SNAPSHOT_BUCKET",
    "AppendResult",
    "Delivery",
    "DurableConsumer",
    "EventLog",
    "Lease",
    "MemoryLog",
    "Record",
    "open_log",
]


async def open_log(url: str, *, name: str = "gpuherd", **settings: object) -> EventLog:
    """Open the JetStream log at ``url`` (imported lazily so simulations need no NATS client)."""
    from gpuherd.log.jetstream import JetStreamLog, JetStreamSettings

    return await JetStreamLog.open(url, name=name, settings=JetStreamSettings(**settings))  # type: ignore[arg-type]
