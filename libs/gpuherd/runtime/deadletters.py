"""Dead letters: what no consumer could handle is kept (HERD_DEAD) with the reason, never dropped."""

from __future__ import annotations

import asyncio
import time

from gpuherd import events as ev
from gpuherd.aio import patiently
from gpuherd.errors import LogUnavailable
from gpuherd.log import HERD, DeadLetter, DeadLetters, Record
from gpuherd.metrics import ServiceMetrics
from gpuherd.obs import get_logger

log = get_logger("gpuherd.runtime")


async def report_unreadable(log_: DeadLetters, record: Record, consumer: str, metrics: ServiceMetrics | None) -> None:
    """Keep an event that does not decode as a dead letter (one per stored message, whoever finds it);
    the reader folds it as nothing and goes on."""
    event = record.event
    assert isinstance(event, ev.Unreadable)
    log.error("unreadable event in the log; kept as a dead letter", seq=record.seq, reason=event.reason)
    if metrics is not None:
        metrics.dead_letters.inc()
    letter = DeadLetter(
        stream=HERD,
        seq=record.seq,
        subject=event.stored_subject,
        consumer=consumer,
        reason=event.reason,
        at=time.time(),
        data=event.data,
    )
    await keep_dead_letter(log_, letter, give_up_after=10.0)


async def keep_dead_letter(log_: DeadLetters, letter: DeadLetter, *, give_up_after: float = 3600.0) -> bool:
    """Store a dead letter, retrying through NATS outages; False if it could not be stored (a role
    without the right, a long outage: the error log still says it)."""
    try:
        await patiently(
            lambda: asyncio.wait_for(log_.dead_letter(letter), 10.0), what="dead letter", patience_s=give_up_after
        )
    except LogUnavailable as exc:
        log.warning("dead letter not stored", seq=letter.seq, stream=letter.stream, error=str(exc))
        return False
    return True
