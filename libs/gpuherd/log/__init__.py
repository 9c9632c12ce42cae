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


async def open_log(url: str, *, name: str = "gpuherd", persistent: bool = True, **settings: object) -> EventLog:
    """Open the JetStream log at ``url`` (imported lazily so simulations need no NATS client).

    ``GPUHERD_LEASE_TTL`` and ``GPUHERD_REPLICAS`` set the lease TTL and stream replicas
    when the streams are first created (3 replicas in the compose cluster)."""
    import os

    from gpuherd.log.jetstream import JetStreamLog, JetStreamSettings

    settings.setdefault("lease_ttl_s", float(os.environ.get("GPUHERD_LEASE_TTL", "6")))
    settings.setdefault("replicas", int(os.environ.get("GPUHERD_REPLICAS", "1")))
    settings.setdefault("streams", os.environ.get("GPUHERD_STREAMS", "create"))
    return await JetStreamLog.open(
        url,
        name=name,
        settings=JetStreamSettings(**settings),
        persistent=persistent,  # type: ignore[arg-type]
    )
