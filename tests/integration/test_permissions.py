"""The per-role NATS permissions of ``gpuherd.security``, on a real nats-server started with them:
every forbidden publish is refused (and nothing is stored), every allowed one works."""

from __future__ import annotations

import asyncio
import secrets
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from apps import registry
from apps.deployment import accounts, nats_users
from gpuherd import events as ev
from gpuherd.log import HERD_INTAKE
from gpuherd.log.jetstream import JetStreamLog, JetStreamSettings, credentials_from_env
from gpuherd.log.pages import PAGE_HEADER, encode_page
from gpuherd.log.relay import RELAYED_SUBJECT
from gpuherd.natsd import NatsServer
from gpuherd.runtime.snapshots import PART_BYTES, load_snapshot, save_snapshot
from gpuherd.security import password_env

pytestmark = pytest.mark.slow

NODES = ("n1", "n2")
SOURCES = ("ci",)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # (A letter first: nats-server reads a variable's value as a config value, and an all-digit hex
    # password as a number, which it then refuses as a password; one run in a hundred or so.)
    passwords = {u.name: f"pw{secrets.token_hex(8)}" for u in nats_users(NODES, SOURCES)} | {"sys": "pw-sys"}
    env = {password_env(name): pw for name, pw in passwords.items()}
    server = NatsServer(tmp_path_factory.mktemp("nats-secured"), extra_config=accounts(NODES, SOURCES), env=env).start()
    yield server, passwords
    server.stop()


class Conn:
    """A connection as ``user``, collecting the permission errors the server sends back."""

    def __init__(self, nc: Any, errors: list[str]) -> None:
        self.nc = nc
        self.errors = errors
        self.js = nc.jetstream(timeout=1.5)

    async def refused(self, subject: str, data: bytes = b"{}") -> bool:
        """Publish to ``subject``; True if the server answered with a permissions violation. The
        server handles a connection's messages in order, so the error arrives before the flush's PONG."""
        before = len(self.errors)
        await self.nc.publish(subject, data)
        await self.nc.flush()
        for _ in range(20):
            if any("permissions violation" in e.lower() for e in self.errors[before:]):
                return True
            await asyncio.sleep(0.025)
        return False


@pytest.fixture
async def connect(secured: Any) -> AsyncIterator[Any]:
    server, passwords = secured
    opened: list[Any] = []

    async def as_user(user: str) -> Conn:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        options = credentials_from_env({"NATS_USER": user, "NATS_PASSWORD": passwords[user]})
        nc = await nats.connect(server.url, error_cb=on_error, allow_reconnect=False, **options)
        opened.append(nc)
        return Conn(nc, errors)

    yield as_user
    for nc in opened:
        await nc.close()


async def _admin_log(secured: Any) -> JetStreamLog:
    server, passwords = secured
    options = credentials_from_env({"NATS_USER": "admin", "NATS_PASSWORD": passwords["admin"]})
    nc = await nats.connect(server.url, **options)
    log_ = JetStreamLog(nc)
    await log_.ensure_streams()
    return log_


async def _count(log_: JetStreamLog, stream: str) -> int:
    return int((await log_.js.stream_info(stream)).state.messages)


def _event(job: str, node: str = "n1") -> bytes:
    return ev.encode(ev.JobStarted(id=f"t-{secrets.token_hex(4)}", job=job, attempt=1, node=node))


async def test_wrong_password_is_refused(secured: Any) -> None:
    server, _ = secured
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(server.url, user="scheduler", password="wrong", allow_reconnect=False, connect_timeout=2)


async def test_admin_creates_the_streams_and_a_service_only_requires_them(secured: Any, connect: Any) -> None:
    admin = await _admin_log(secured)
    scheduler = await connect("scheduler")
    log_ = JetStreamLog(scheduler.nc, JetStreamSettings(streams="require"))
    await log_.require_streams(timeout=10)
    # ...and may not create or change a stream itself.
    assert await scheduler.refused("$JS.API.STREAM.CREATE.EVIL", msgspec.json.encode({"name": "EVIL"}))
    assert await scheduler.refused("$JS.API.STREAM.DELETE.HERD")
    await admin.nc.close()


async def test_each_agent_appends_only_its_own_nodes_events(secured: Any, connect: Any) -> None:
    admin = await _admin_log(secured)
    agent = await connect("agent-n1")
    before = await _count(admin, "HERD")
    ack = await agent.js.publish("herd.job.j1.by.n1", _event("j1"))
    assert ack.stream == "HERD"
    ack = await agent.js.publish("herd.node.n1", b"{}")
    assert ack.stream == "HERD"
    await agent.nc.publish("herd.telemetry.n1.heartbeat", b"{}")
    for subject in (
        "herd.job.j1.by.n2",  # another node's report
        "herd.job.j1",  # a scheduler decision
        "herd.node.n2",
        "herd.lease.l1",  # a broker decision
        "herd.lease.l1.by.n2",
        RELAYED_SUBJECT,  # a relay's page of reports (of any node)
        "herd.intake.ci",
        "$KV.herd_snapshots.scheduler",
        "$KV.herd_leases.agent.n2",
    ):
        assert await agent.refused(subject), subject
    assert await agent.refused("herd.telemetry.n2.heartbeat")
    assert await _count(admin, "HERD") == before + 2
    # Its own lease and inbox work (request-reply through JetStream).
    ack = await agent.js.publish("$KV.herd_leases.agent.n1", b"me")
    assert ack.seq > 0
    own = JetStreamLog(agent.nc)  # and its snapshot, in parts when it is large
    await own.require_streams(timeout=10)
    big = secrets.token_bytes(PART_BYTES + 1)
    assert await save_snapshot(own, "agent.n1", 1, 5, big) is not None
    assert await agent.refused("$KV.herd_snapshots.agent.n2.parts.0.0")
    await admin.nc.close()


async def test_an_agent_reports_through_the_relay_only_for_its_own_node(secured: Any, connect: Any) -> None:
    """An agent may ask a relay to store its reports on its own node's subject only; the relay may
    append every agent's reports (alone, or as its pages) and answer them, and nothing else of
    anyone's."""
    admin = await _admin_log(secured)
    agent = await connect("agent-n1")
    relay = await connect("relay")
    before = await _count(admin, "HERD")
    assert not await agent.refused("herd.report.n1")
    assert await agent.refused("herd.report.n2")
    reports = await relay.nc.subscribe("herd.report.*", queue="relay")
    ack = await relay.js.publish("herd.job.j1.by.n2", _event("j1"))
    assert ack.stream == "HERD"
    ack = await relay.js.publish(RELAYED_SUBJECT, encode_page([_event("j2")], [None]), headers={PAGE_HEADER: "1"})
    assert ack.stream == "HERD"
    for subject in (
        "herd.job.j1",  # a scheduler decision
        "herd.lease.l1",  # a broker decision
        "herd.vc.a",
        "herd.intake.ci",
        "herd.telemetry.n1.heartbeat",
        "$KV.herd_snapshots.scheduler",
        "$KV.herd_leases.agent.n1",
    ):
        assert await relay.refused(subject), subject
    assert await _count(admin, "HERD") == before + 2
    await reports.unsubscribe()
    await admin.nc.close()


async def test_each_service_appends_only_its_decisions(secured: Any, connect: Any) -> None:
    admin = await _admin_log(secured)
    allowed = {
        "scheduler": ["herd.job.j2", "herd.node.n1", "herd.rejected.ci", "herd.clock.scheduler"],
        "elastic": ["herd.job.j2", "herd.clock.elastic", "herd.cluster.elastic"],
        "memory": ["herd.lease.l2", "herd.clock.memory", "herd.cluster.memory"],
        "analytics": ["herd.job.j2", "herd.node.n1", "herd.clock.analytics"],
    }
    forbidden = {
        "scheduler": [
            "herd.lease.l2",
            "herd.job.j2.by.n1",
            "herd.clock.memory",
            "$KV.herd_snapshots.memory",
            "$KV.herd_snapshots.memory.parts.0.0",
        ],
        "elastic": ["herd.node.n1", "herd.lease.l2", "herd.rejected.ci", "$KV.herd_leases.decider.scheduler"],
        "memory": ["herd.job.j2", "herd.node.n1", "herd.cluster.policy"],
        "analytics": ["herd.lease.l2", "herd.cluster.policy", "herd.job.j2.by.n1"],
    }
    for service, subjects in allowed.items():
        conn = await connect(service)
        for subject in subjects:
            ack = await conn.js.publish(subject, _event("j2"))
            assert ack.seq > 0, (service, subject)
        for subject in forbidden[service]:
            assert await conn.refused(subject), (service, subject)
        ack = await conn.js.publish(f"$KV.herd_snapshots.{service}", b"snap")
        assert ack.seq > 0
        # A snapshot too large for one message goes in parts, which its role may write too.
        own = JetStreamLog(conn.nc)
        await own.require_streams(timeout=10)
        big = secrets.token_bytes(PART_BYTES + 1)
        assert await save_snapshot(own, service, 1, 5, big) is not None, service
        snap = await load_snapshot(own, service, 1)
        assert snap is not None and snap.state == big, service
    await admin.nc.close()


async def test_a_submitter_only_submits_under_its_source_and_gets_its_verdicts(secured: Any, connect: Any) -> None:
    admin = await _admin_log(secured)
    submitter = await connect("submit-ci")
    before = await _count(admin, "HERD_INTAKE")
    await submitter.nc.publish("herd.intake.ci", b'{"name": "x"}')
    await submitter.nc.flush()
    await asyncio.sleep(0.2)
    assert await _count(admin, "HERD_INTAKE") == before + 1
    refused = (
        "herd.intake.other",
        "herd.job.j3",
        "$JS.API.STREAM.INFO.HERD",
        "herd.ctl.n1.logs",
        "herd.ctl.scheduler.ready",
    )
    for subject in refused:
        assert await submitter.refused(subject), subject
    assert await _count(admin, "HERD_INTAKE") == before + 1
    # Its inboxes are its own: another user cannot listen to them.
    other = await connect("submit-ci")
    inbox = submitter.nc.new_inbox()
    assert inbox.startswith("_INBOX.submit-ci.")
    reader = await connect("reader")
    await reader.nc.subscribe(inbox)
    await reader.nc.flush()
    await asyncio.sleep(0.1)
    assert any("permissions violation" in e.lower() for e in reader.errors)
    del other
    await admin.nc.close()


async def test_the_read_only_role_reads_and_cannot_append(secured: Any, connect: Any) -> None:
    admin = await _admin_log(secured)
    await admin.append([ev.JobCancelRequested(id="c-ro", job="j4")])
    reader = await connect("reader")
    log_ = JetStreamLog(reader.nc, JetStreamSettings(streams="require"))
    await log_.require_streams(timeout=10)
    records = await log_.read_all()
    assert any(r.event.id == "c-ro" for r in records)
    before = await _count(admin, "HERD")
    for subject in ("herd.job.j4", "herd.node.n1", "herd.intake.ci", "$KV.herd_snapshots.scheduler", "herd.dead.x"):
        assert await reader.refused(subject), subject
    assert await _count(admin, "HERD") == before
    await admin.nc.close()


async def test_every_service_and_agent_works_under_its_own_role(secured: Any, tmp_path: Path, connect: Any) -> None:
    """The real processes, each as its user, with streams created by admin only: a submission from
    ``submit-ci`` is judged, placed, run and finished, and the server refused nothing on the way."""
    from gpuherd.client import Client
    from tests.integration.procs import Services, wait_scheduler_ready, wait_state

    server, passwords = secured
    log_start = server.log_file.stat().st_size  # the other tests' refusals are before this
    admin = await _admin_log(secured)
    services = Services(server.url, tmp_path, agents=2, gpus=2)
    for name in [*registry.required(), "relay"]:  # (the relay too: the agents' reports go through it)
        services.specs[name] = ["-m", f"services.{name}", "--nats-url", server.url]
    for name in services.specs:
        user = name.replace("agent-", "agent-n") if name.startswith("agent-") else name
        services.env_of[name] = {"NATS_USER": user, "NATS_PASSWORD": passwords[user], "GPUHERD_STREAMS": "require"}
    relayed: list[bytes] = []  # the relay's answers that say a report is stored

    async def on_inbox(msg: Any) -> None:
        if msg.data.startswith(b'{"ok":true,"position"'):
            relayed.append(msg.data)

    watch = await admin.nc.subscribe("_INBOX.>", cb=on_inbox)
    services.start_all()
    try:
        await wait_scheduler_ready(admin, timeout=60)
        await wait_state(admin, lambda s: len(s.nodes) == 2, timeout=30)
        submitter = await connect("submit-ci")
        client = Client(submitter.nc, "ci")
        job = await client.submit({"name": "roles", "user": "u", "gpus": 2, "duration_s": 1.0})
        # Two at once: the client sends them as one atomic batch, which the role may send too.
        more = await asyncio.gather(
            *(client.submit({"name": f"roles-{n}", "user": "u", "gpus": 1, "duration_s": 1.0}) for n in (1, 2))
        )
        last = (await admin.js.stream_info(HERD_INTAKE)).state.last_seq
        batch_ids = {
            ((await admin.js.get_msg(HERD_INTAKE, seq)).headers or {}).get("Nats-Batch-Id") for seq in (last - 1, last)
        }
        assert len(batch_ids) == 1 and None not in batch_ids, "the two went as one batch"

        def done(s: Any) -> bool:
            return all(s.jobs.get(j) and s.jobs[j].status == "completed" for j in (job, *more))

        state = await wait_state(admin, done, timeout=60)
        assert state.jobs[job].status == "completed"
        # The submitter may follow its job: it asks the scheduler, without reading the log.
        assert (await client.job_status(job))["status"] == "completed"
        assert relayed, "the agents' reports went through the relay"
        await watch.unsubscribe()
        assert not services.crashed(), services.logs()
        # The read-only role's view of it all: status and dead letters.
        reader_env = {
            **services.env,
            "NATS_URL": server.url,
            "NATS_USER": "reader",
            "NATS_PASSWORD": passwords["reader"],
        }
        for argv in (["status", "--json"], ["events", "--dead-letter", "--json"], ["jobs", "--json"]):
            out = subprocess.run(
                [sys.executable, "-m", "apps", *argv], env=reader_env, capture_output=True, text=True, timeout=60
            )
            assert out.returncode in (0, 1), out.stderr  # status: 1 = degraded (no agent of its own, say)
            assert "Traceback" not in out.stderr, out.stderr
        with open(server.log_file, "rb") as f:
            f.seek(log_start)
            refused = [line for line in f.read().decode().splitlines() if "Violation" in line]
        assert not refused, "\n".join(refused[:10])
    finally:
        services.stop_all()
        await admin.nc.close()


async def test_tls_with_the_dev_ca(tmp_path: Path) -> None:
    """infra/nats/make-dev-ca.sh's certificates on a real server: a client that trusts the CA
    (NATS_CA) connects over TLS; one that does not is refused."""
    certs = tmp_path / "certs"
    script = Path(__file__).resolve().parents[2] / "infra" / "nats" / "make-dev-ca.sh"
    subprocess.run([str(script), str(certs)], check=True, capture_output=True)
    tls = f'tls {{ cert_file: "{certs}/server.pem", key_file: "{certs}/server-key.pem", ca_file: "{certs}/ca.pem" }}\n'
    server = NatsServer(tmp_path / "nats", extra_config=tls).start()
    try:
        url = f"tls://127.0.0.1:{server.port}"
        nc = await nats.connect(url, allow_reconnect=False, **credentials_from_env({"NATS_CA": str(certs / "ca.pem")}))
        assert nc.is_connected
        await nc.close()
        with pytest.raises(Exception, match=r"(?i)certificate"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=2, tls=ssl.create_default_context())
    finally:
        server.stop()


async def test_the_dashboard_reads_and_appends_only_operator_commands(secured: Any, connect: Any) -> None:
    admin = await _admin_log(secured)
    dashboard = await connect("dashboard")
    log_ = JetStreamLog(dashboard.nc, JetStreamSettings(streams="require"))
    await log_.require_streams(timeout=10)
    before = await _count(admin, "HERD")
    drained = ev.NodeDrained(id=f"t-{secrets.token_hex(4)}", node="n1", reason="maintenance")
    stored = await log_.append([drained])  # a drain from its page, on the node's own subject
    assert await _count(admin, "HERD") == before + 1
    assert [r.event.id for r in await log_.read_all(stored.seqs[0])] == [drained.id]
    # Never an agent's report, a lease, intake, or another service's status.
    assert await dashboard.refused("herd.job.j1.by.n1", _event("j1"))
    assert await dashboard.refused("herd.lease.l1", b"{}")
    assert await dashboard.refused("herd.intake.ci", b"{}")
    assert await dashboard.refused("$KV.herd_services.scheduler.x", b"{}")
    await admin.nc.close()
