"""The event log: narrow interfaces (``interfaces``), a JetStream and an in-memory implementation,
and the log as a file (simulations)."""

from gpuherd.log.inprocess import InProcessLog
from gpuherd.log.interfaces import (
    Connection,
    DeadLetters,
    DurableConsumer,
    EventLog,
    EventStore,
    IntakeQueue,
    KeyValue,
    Leadership,
    Leaderships,
    RequestHandler,
    Requests,
    TelemetryBus,
)
from gpuherd.log.records import AppendResult, DeadLetter, Delivery, Record
from gpuherd.log.streams import (
    CONTROL_PREFIX,
    DEAD_LETTER_PREFIX,
    HERD,
    HERD_DEAD,
    HERD_INTAKE,
    HERD_SUBJECTS,
    HERD_TELEMETRY,
    INTAKE_PREFIX,
    LEADERSHIP_BUCKET,
    MAX_DELIVERIES,
    REPLY_HEADER,
    SNAPSHOT_BUCKET,
    STATUS_BUCKET,
    TELEMETRY_PREFIX,
    TRACEPARENT,
    reply_inboxes,
)

__all__ = [
    "CONTROL_PREFIX",
    "DEAD_LETTER_PREFIX",
    "HERD",
    "HERD_DEAD",
    "HERD_INTAKE",
    "HERD_SUBJECTS",
    "HERD_TELEMETRY",
    "INTAKE_PREFIX",
    "LEADERSHIP_BUCKET",
    "MAX_DELIVERIES",
    "REPLY_HEADER",
    "SNAPSHOT_BUCKET",
    "STATUS_BUCKET",
    "TELEMETRY_PREFIX",
    "TRACEPARENT",
    "AppendResult",
    "Connection",
    "DeadLetter",
    "DeadLetters",
    "Delivery",
    "DurableConsumer",
    "EventLog",
    "EventStore",
    "InProcessLog",
    "IntakeQueue",
    "KeyValue",
    "Leadership",
    "Leaderships",
    "Record",
    "RequestHandler",
    "Requests",
    "TelemetryBus",
    "open_log",
    "reply_inboxes",
]


async def open_log(url: str, *, name: str = "gpuherd", persistent: bool = True, **settings: object) -> EventLog:
    """Open the JetStream log at ``url`` (imported lazily so simulations need no NATS client).

    ``GPUHERD_LEADERSHIP_TTL`` and ``GPUHERD_REPLICAS`` set the lease TTL and stream replicas
    when the streams are first created (3 replicas in the compose cluster)."""
    import os

    from gpuherd.log.jetstream import JetStreamLog, JetStreamSettings

    settings.setdefault("leadership_ttl_s", float(os.environ.get("GPUHERD_LEADERSHIP_TTL", "6")))
    settings.setdefault("replicas", int(os.environ.get("GPUHERD_REPLICAS", "1")))
    settings.setdefault("streams", os.environ.get("GPUHERD_STREAMS", "create"))
    return await JetStreamLog.open(
        url,
        name=name,
        settings=JetStreamSettings(**settings),
        persistent=persistent,  # type: ignore[arg-type]
    )
