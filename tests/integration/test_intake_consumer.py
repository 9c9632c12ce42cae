"""The durable intake consumer on a real nats-server: its one open pull request is asked again
when the server restarts under it or the consumer is deleted, and nothing stored is missed."""

from __future__ import annotations

import asyncio
import uuid

from gpuherd.log import HERD_INTAKE, open_log
from gpuherd.natsd import NatsServer


async def fetch_until(consumer, subject: str, wanted: set[bytes], within_s: float = 30.0) -> set[bytes]:
    """Fetch (acknowledging) until every one of ``wanted`` on ``subject`` came; what came on it."""
    got: set[bytes] = set()
    async with asyncio.timeout(within_s):
        while not wanted <= got:
            for delivery in await consumer.fetch(64, timeout=0.5):
                await consumer.ack(delivery)
                if delivery.subject == subject:
                    got.add(delivery.data)
    return got


async def test_the_consumer_asks_again_after_the_server_restarts(local_nats: NatsServer, tmp_path) -> None:
    log_ = await open_log(local_nats.url, name="intake-consumer", persistent=True)
    source = f"s{uuid.uuid4().hex[:8]}"
    subject = f"herd.intake.{source}"
    consumer = log_.intake_consumer(f"c-{uuid.uuid4().hex[:8]}", ack_wait=2.0)
    server = local_nats
    try:
        await consumer.open()
        await log_.publish_intake(source, b"before")
        assert await fetch_until(consumer, subject, {b"before"}) == {b"before"}
        server.kill()  # the open pull request dies with it
        server = NatsServer(tmp_path / "nats", port=server.port).start()
        async with asyncio.timeout(30):
            while not log_.is_connected():
                await asyncio.sleep(0.1)
            for n in range(3):
                while True:  # (the first flush after a reconnect may time out while JetStream recovers)
                    try:
                        await log_.publish_intake(source, f"after-{n}".encode())
                        break
                    except TimeoutError:
                        await asyncio.sleep(0.2)
        after = {b"after-0", b"after-1", b"after-2"}
        # (at least once: "before" may come again, its acknowledgement lost with the server)
        assert await fetch_until(consumer, subject, after) - {b"before"} == after
    finally:
        await consumer.close()
        await log_.close()
        server.stop()


async def test_a_deleted_consumer_is_added_again_and_delivers(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="intake-consumer")
    source = f"s{uuid.uuid4().hex[:8]}"
    subject = f"herd.intake.{source}"
    name = f"c-{uuid.uuid4().hex[:8]}"
    consumer = log_.intake_consumer(name, ack_wait=2.0)
    try:
        await consumer.fetch(1000, timeout=0.3)  # opens it (and skips what other tests left)
        for delivery in await consumer.fetch(1000, timeout=0.3):
            await consumer.ack(delivery)
        await log_.js._jsm.delete_consumer(HERD_INTAKE, name)
        await log_.publish_intake(source, b"m")
        assert await fetch_until(consumer, subject, {b"m"}) == {b"m"}
    finally:
        await consumer.close()
        await log_.close()


async def test_a_fetch_hands_on_what_arrives_while_it_waits_and_more_than_its_pull_holds(nats_url: str) -> None:
    """One pull open across fetches: a message stored while a fetch waits is handed on then, not
    when the wait ends; a fetch never hands on more than it asked for, and what else arrived is
    handed on by the next fetches, each message once."""
    log_ = await open_log(nats_url, name="intake-consumer")
    source = f"s{uuid.uuid4().hex[:8]}"
    subject = f"herd.intake.{source}"
    consumer = log_.intake_consumer(f"c-{uuid.uuid4().hex[:8]}", ack_wait=30.0)
    try:
        for delivery in await consumer.fetch(1000, timeout=0.3):  # (what other tests left)
            await consumer.ack(delivery)

        async def later() -> None:
            await asyncio.sleep(0.3)
            await log_.publish_intake(source, b"late")

        publisher = asyncio.create_task(later())
        started = asyncio.get_running_loop().time()
        got = [d for d in await consumer.fetch(10, timeout=20.0) if d.subject == subject]
        waited = asyncio.get_running_loop().time() - started
        await publisher
        assert [d.data for d in got] == [b"late"] and waited < 10.0, (got, waited)
        for delivery in got:
            await consumer.ack(delivery)
        sent = [f"m{n}".encode() for n in range(25)]
        for data in sent:
            await log_.publish_intake(source, data)
        seen: list[bytes] = []
        # (The open pull asked for 10 and has brought 1; once it has brought the rest, the next fetch
        # asks again at once rather than wait out that pull's 20 s.)
        async with asyncio.timeout(10):
            while len(seen) < len(sent):
                batch = await consumer.fetch(10, timeout=5.0)
                assert len(batch) <= 10
                for delivery in batch:
                    await consumer.ack(delivery)
                    if delivery.subject == subject:
                        seen.append(delivery.data)
        assert seen == sent
    finally:
        await consumer.close()
        await log_.close()
