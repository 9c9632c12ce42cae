"""An ordered reader of a JetStream stream: every sequence once, in order, across server restarts.

nats-py's ``fetch`` hands back roughly one message per call under load and
waits on each message with ``wait_for``; replaying a long log that way costs
more in the client than in the server. This reader keeps one subscription
with a callback, issues pull requests of ``PULL`` messages at a time to an
ephemeral consumer (no acks, memory storage), reads each message's stream
sequence from its ack subject, and recreates the consumer from the next
expected sequence whenever it sees a gap, the consumer disappears, or the
server goes quiet (no message, status or heartbeat) for a while.

A follower that no decision waits on may *linger* (``linger_s``): once events flow it lets them
gather for that long and then takes all of them in one no-wait pull, instead of being woken by each
as it is stored. Its process is woken once per pull rather than once per event, which on a busy
host frees CPU for the readers decisions do wait on; when a pull finds nothing it goes back to one
waiting request, so an idle follower costs nothing and the first event after a pause still wakes
it at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gpuherd.errors import LogError
from gpuherd.obs import get_logger

log = get_logger("gpuherd.log")

PULL = 1000
# Messages handed on before the reader lets the event loop run its other tasks: a reader that
# drains a full buffer without a pause would starve the reader's process of its timers, its
# decisions and its signal handlers (a SIGTERM waits until the buffer is empty).
YIELD_EVERY = 200
EXPIRES_S = 5.0
HEARTBEAT_S = 1.0
SILENCE_S = 4.0  # no heartbeat for this long: the consumer (or the server) is gone
# The consumer a reader leaves is deleted within this, or left to the server: a reader ends as its
# process stops, which must not wait out a request timeout (seconds) with NATS gone.
CLEANUP_TIMEOUT_S = 0.1
# The server deletes a consumer nobody pulls from for this long, so one whose deletion was skipped
# goes too (checked with nats-server 2.15: a reader's, its connection closed with a pull request
# open, was gone 31 s later); a memory-stored one also goes with a server restart.
INACTIVE_THRESHOLD_S = 30.0


def stored_position(reply: str) -> tuple[int, float]:
    """The stream sequence and the stored timestamp (Unix seconds) in a JetStream ack subject (v1: 9
    tokens, v2 with domain and hash: 12), read with one split: a reader hands on both of each message."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7]) / 1e9
    return int(tokens[7]), int(tokens[9]) / 1e9


async def ordered_messages(
    nc: Any,
    js: Any,
    stream: str,
    start: int,
    *,
    stop: int | None,
    follow: bool,
    filter_subject: str | None = None,
    linger_s: float = 0.0,
) -> AsyncIterator[tuple[int, float, Any]]:
    """Yield (stream sequence, stored time in Unix seconds, message) from ``start``: up to ``stop``, or
    forever with ``follow`` (lingering ``linger_s`` between pulls while events flow: see the module's doc)."""
    buffer: collections.deque[Any] = collections.deque()
    arrived = asyncio.Event()

    async def on_message(msg: Any) -> None:
        buffer.append(msg)
        arrived.set()

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_message, pending_msgs_limit=4 * PULL)
    next_seq = start
    consumer: str | None = None
    remaining = 0  # messages the open pull request may still deliver
    handed = 0
    lingering = follow and linger_s > 0
    # A lingering follower waits for one message (its first after a pause), then polls.
    waiting_batch = 1 if lingering else PULL
    waiting_request = msgspec.json.encode(
        {"batch": waiting_batch, "expires": int(EXPIRES_S * 1e9), "idle_heartbeat": int(HEARTBEAT_S * 1e9)}
    )
    poll_request = msgspec.json.encode({"batch": PULL, "no_wait": True})
    got = 0  # messages the open (or last) request handed on
    try:
        while True:
            if consumer is None:
                consumer = await _create_consumer(js, stream, next_seq, filter_subject)
                buffer.clear()
                remaining = 0
            if remaining == 0:
                request = waiting_request
                if lingering and got:
                    if got < PULL:  # events flow: let what follows gather (a full batch asks again at once)
                        await asyncio.sleep(linger_s)
                    request = poll_request
                await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}", request, reply=inbox)
                remaining = waiting_batch if request is waiting_request else PULL
                got = 0
            if not buffer:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), SILENCE_S)
                except TimeoutError:
                    log.info("replay consumer silent; recreating", stream=stream, next_seq=next_seq)
                    consumer = await _drop_consumer(js, stream, consumer)
                continue
            while buffer:
                msg = buffer.popleft()
                if not msg.data and msg.headers and "Status" in msg.headers:
                    status = msg.headers["Status"]
                    if status == "100":
                        continue  # idle heartbeat: the request is alive
                    if status in ("404", "408"):
                        remaining = 0  # the request ended; ask again
                        if not follow and stop is None:
                            return
                        continue
                    consumer = await _drop_consumer(js, stream, consumer)  # 409 and friends: start over
                    break
                seq, stored_at = stored_position(msg.reply)
                remaining -= 1
                got += 1
                if seq < next_seq:
                    continue  # seen before a reset
                if seq > next_seq and filter_subject is None:
                    consumer = await _drop_consumer(js, stream, consumer)  # a gap: not the ordered view any more
                    break
                yield seq, stored_at, msg
                next_seq = seq + 1
                if stop is not None and seq >= stop:
                    return
                handed += 1
                if handed % YIELD_EVERY == 0:
                    await asyncio.sleep(0)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if consumer is not None and nc.is_connected:  # (disconnected, a request would wait it out)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(js._jsm.delete_consumer(stream, consumer), CLEANUP_TIMEOUT_S)


async def _create_consumer(js: Any, stream: str, start: int, filter_subject: str | None) -> str:
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        ack_policy=AckPolicy.NONE,
        mem_storage=True,
        num_replicas=1,
        inactive_threshold=INACTIVE_THRESHOLD_S,
        filter_subject=filter_subject,
    )
    for attempt in range(10_000):
        try:
            info = await js._jsm.add_consumer(stream, config=config)
            return str(info.name)
        except (nats.errors.Error, nats.js.errors.Error, ConnectionError, TimeoutError) as exc:
            if attempt % 20 == 0:
                log.warning("cannot open replay consumer yet; retrying", stream=stream, error=repr(exc))
            await asyncio.sleep(min(0.1 * (attempt + 1), 1.0))
    raise LogError(f"cannot open a consumer on {stream}")


async def _drop_consumer(js: Any, stream: str, consumer: str | None) -> None:
    if consumer is not None:
        with contextlib.suppress(Exception):
            await js._jsm.delete_consumer(stream, consumer)
    return None
