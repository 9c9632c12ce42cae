"""The JetStream log waits out a server failing over where a decider asks it something it cannot
act without (the log's head, the last event on its leadership subject), instead of failing."""

from __future__ import annotations

import types

import nats.errors
import pytest
from nats.aio.client import Client as NatsClient

from gpuherd.errors import LogUnavailable
from gpuherd.log.jetstream import JetStreamLog, JetStreamSettings


class FailingOver:
    """``get_last_msg`` times out ``failures`` times (a server killed, the stream's leader elected
    again), then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def get_last_msg(self, stream: str, subject: str) -> types.SimpleNamespace:
        self.calls += 1
        if self.calls <= self.failures:
            raise nats.errors.TimeoutError
        return types.SimpleNamespace(seq=42, headers=None)


def log_with(js: FailingOver, patience_s: float) -> JetStreamLog:
    log = JetStreamLog(NatsClient(), JetStreamSettings(outage_patience_s=patience_s))
    log.js = js  # type: ignore[assignment]
    log._slots = 1  # positions = sequences (a log from before pages): the fake has no stream to ask
    return log


async def test_the_last_event_on_a_subject_is_read_through_a_failover() -> None:
    js = FailingOver(failures=2)
    assert await log_with(js, patience_s=30.0).subject_last_seq("herd.cluster.leader.memory") == 42
    assert js.calls == 3


async def test_an_outage_longer_than_the_patience_is_reported_by_name() -> None:
    with pytest.raises(LogUnavailable, match=r"herd\.cluster\.leader\.memory"):
        await log_with(FailingOver(failures=1000), patience_s=0.0).subject_last_seq("herd.cluster.leader.memory")
