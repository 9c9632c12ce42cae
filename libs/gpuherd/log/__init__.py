"""The event log: narrow interfaces (``interfaces``), a JetStream and an in-memory implementation,
and the log as a file (simulations)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from gpuherd.errors import LogError
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

if TYPE_CHECKING:
    from gpuherd.log.jetstream import JetStreamSettings

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
    "settings_from_env",
]


def settings_from_env(env: Mapping[str, str] | None = None, **settings: object) -> JetStreamSettings:
    """The log's settings as this deployment sets them: ``GPUHERD_LEADERSHIP_TTL`` and
    ``GPUHERD_REPLICAS`` (the lease TTL and stream replicas when the streams are first created; 3
    replicas in the compose cluster), ``GPUHERD_STREAMS`` (``create``, or ``require`` for a user
    without the right to manage streams), ``GPUHERD_INTAKE_STORAGE`` (``file``, or ``memory``: where
    submissions wait for their verdict, ``JetStreamSettings.intake_storage``; unset: as the stream
    is). ``settings`` override them."""
    import os

    from gpuherd.log.jetstream import JetStreamSettings, check_intake_storage

    env = os.environ if env is None else env
    settings.setdefault("leadership_ttl_s", float(env.get("GPUHERD_LEADERSHIP_TTL", "6")))
    settings.setdefault("replicas", int(env.get("GPUHERD_REPLICAS", "1")))
    streams = env.get("GPUHERD_STREAMS", "create")
    if streams not in ("create", "require"):
        raise LogError(f"GPUHERD_STREAMS={streams!r}: set it to create (the default) or require")
    settings.setdefault("streams", streams)
    settings.setdefault("intake_storage", env.get("GPUHERD_INTAKE_STORAGE") or None)
    check_intake_storage(settings["intake_storage"])  # type: ignore[arg-type]
    return JetStreamSettings(**settings)  # type: ignore[arg-type]


async def open_log(url: str, *, name: str = "gpuherd", persistent: bool = True, **settings: object) -> EventLog:
    """Open the JetStream log at ``url`` (imported lazily so simulations need no NATS client), with
    the deployment's settings (``settings_from_env``)."""
    from gpuherd.log.jetstream import JetStreamLog

    return await JetStreamLog.open(
        url,
        name=name,
        settings=settings_from_env(**settings),
        persistent=persistent,  # type: ignore[arg-type]
    )
