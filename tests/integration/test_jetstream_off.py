"""A NATS server that answers without JetStream (or without gpuherd's streams) is named as such at
once, with what to do about it; a JetStream that is only not ready yet (a cluster electing its meta
leader) is waited for, and the wait is said early."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from structlog.testing import capture_logs

from apps.cli import build_parser
from gpuherd.errors import GpuherdError, LogError
from gpuherd.log import open_log
from gpuherd.log.jetstream import JetStreamLog, JetStreamOff, JetStreamSettings, jetstream_off
from gpuherd.natsd import NatsCluster, NatsServer, find_binary, free_port

AT_ONCE_S = 3.0  # "at once": the old code took 11 s (a command) to 74 s (a service) to say anything
EXAMPLE_JOB = str(Path(__file__).parents[2] / "examples" / "jobs" / "sim-1gpu.yaml")


def start_server(args: list[str]) -> Iterator[str]:
    """A nats-server of the venv on a free loopback port with ``args``, killed when done."""
    port = free_port()
    proc = subprocess.Popen(
        [find_binary(), "-a", "127.0.0.1", "-p", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, f"nats-server {args} exited with {proc.returncode}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
            assert time.monotonic() < deadline, "nats-server did not listen within 10 s"
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def without_jetstream() -> Iterator[str]:
    """A nats-server started without -js."""
    yield from start_server([])


@pytest.fixture
def account_without_jetstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A server with JetStream whose account of the connecting user (from the environment) has none."""
    config = tmp_path / "accounts.conf"
    config.write_text(
        f'jetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "accounts {\n"
        "  HERD { jetstream: enabled, users: [{user: herd, password: herd}] }\n"
        "  PLAIN { users: [{user: plain, password: plain}] }\n"
        "}\n"
    )
    monkeypatch.setenv("NATS_USER", "plain")
    monkeypatch.setenv("NATS_PASSWORD", "plain")
    yield from start_server(["-c", str(config)])


def says_jetstream_is_disabled(message: str, url: str) -> None:
    assert f"the NATS server at {url} answers but has JetStream disabled" in message, message
    assert "-js" in message and "jetstream {}" in message, message
    assert "cannot reach" not in message and "()" not in message, message


async def test_a_service_opening_the_log_without_jetstream_is_told_at_once(without_jetstream: str) -> None:
    started = time.monotonic()
    with pytest.raises(JetStreamOff) as raised:
        await asyncio.wait_for(open_log(without_jetstream, name="service", persistent=True), 30)
    assert time.monotonic() - started < AT_ONCE_S
    says_jetstream_is_disabled(str(raised.value), without_jetstream)


def test_gpuherd_jobs_without_jetstream_says_so_at_once(without_jetstream: str) -> None:
    args = build_parser().parse_args(["--nats-url", without_jetstream, "jobs"])
    started = time.monotonic()
    with pytest.raises(GpuherdError) as raised:
        args.func(args)
    assert time.monotonic() - started < AT_ONCE_S
    says_jetstream_is_disabled(str(raised.value), without_jetstream)


def test_gpuherd_submit_without_jetstream_says_so_at_once(without_jetstream: str) -> None:
    args = build_parser().parse_args(["--nats-url", without_jetstream, "submit", EXAMPLE_JOB, "--timeout", "30"])
    started = time.monotonic()
    with pytest.raises(GpuherdError) as raised:
        args.func(args)
    assert time.monotonic() - started < AT_ONCE_S
    says_jetstream_is_disabled(str(raised.value), without_jetstream)
    assert "HERD_INTAKE" not in str(raised.value)  # not a missing stream: no JetStream at all


async def test_an_account_without_jetstream_is_named_at_once(account_without_jetstream: str) -> None:
    started = time.monotonic()
    with pytest.raises(JetStreamOff) as raised:
        await asyncio.wait_for(open_log(account_without_jetstream, name="service", persistent=True), 30)
    assert time.monotonic() - started < AT_ONCE_S
    message = str(raised.value)
    assert f"the NATS server at {account_without_jetstream} answers but JetStream is not enabled" in message
    assert "account" in message


def test_gpuherd_jobs_with_streams_required_but_missing_names_them_at_once(
    local_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUHERD_STREAMS", "require")
    args = build_parser().parse_args(["--nats-url", local_nats.url, "jobs"])
    started = time.monotonic()
    with pytest.raises(GpuherdError) as raised:
        args.func(args)
    assert time.monotonic() - started < AT_ONCE_S
    message = str(raised.value)
    for missing in ("HERD,", "HERD_INTAKE", "HERD_TELEMETRY", "HERD_DEAD", "herd_snapshots", "herd_leases"):
        assert missing in message, message
    assert "gpuherd log init" in message and "GPUHERD_STREAMS" in message, message
    assert "cannot reach" not in message, message


async def test_a_client_under_streams_required_only_checks_them_and_creates_none(
    local_nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submitter's client (cancel, job lookups) follows GPUHERD_STREAMS as services and commands
    do: a user without the right to manage streams is told what is missing, and nothing is created."""
    from gpuherd.client import Client

    monkeypatch.setenv("GPUHERD_STREAMS", "require")
    nc = await nats.connect(local_nats.url)
    try:
        started = time.monotonic()
        with pytest.raises(LogError) as raised:
            await Client(nc, "ci").cancel("some-job")
        assert time.monotonic() - started < AT_ONCE_S
        assert "HERD_INTAKE" in str(raised.value) and "gpuherd log init" in str(raised.value), raised.value
        assert await nc.jetstream().streams_info() == []  # (not created behind the user's back)
    finally:
        await nc.close()


def test_streams_setting_other_than_create_or_require_is_refused() -> None:
    from gpuherd.log import settings_from_env

    assert settings_from_env({}).streams == "create"
    assert settings_from_env({"GPUHERD_STREAMS": "require", "GPUHERD_REPLICAS": "3"}).replicas == 3
    with pytest.raises(LogError, match="GPUHERD_STREAMS='requires'"):
        settings_from_env({"GPUHERD_STREAMS": "requires"})


async def test_a_jetstream_without_meta_leader_is_waited_for_and_the_wait_said_early(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, size=3)
    lone, *others = cluster.servers
    lone.start()  # one of three: its cluster cannot elect a meta leader
    nc = await nats.connect(lone.url)
    log_ = JetStreamLog(nc, JetStreamSettings(request_timeout_s=1.0))
    setup: asyncio.Task[None] | None = None
    try:
        with capture_logs() as logs:
            setup = asyncio.create_task(log_.ensure_streams())

            def said() -> list[dict[str, Any]]:
                return [e for e in logs if e["log_level"] == "warning" and "JetStream does not answer" in e["event"]]

            deadline = time.monotonic() + 5
            while not said() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert said(), "the wait is said early"
            assert said()[0]["server"] == lone.url
            assert not setup.done(), "a JetStream that is on but not ready is waited for"
            for server in others:
                server.start()
            await asyncio.wait_for(setup, 60)  # a meta leader elected: the streams are made
    finally:
        if setup is not None and not setup.done():
            setup.cancel()
            await asyncio.gather(setup, return_exceptions=True)
        await nc.close()
        cluster.stop()


class _FakeConnection:
    """What ``jetstream_off`` reads of a connection: its server's INFO and a request nobody answers."""

    def __init__(self, info: dict[str, Any]) -> None:
        self._server_info = info
        self.connected_url = None

    async def request(self, subject: str, data: bytes, timeout: float) -> Any:
        raise nats.errors.NoRespondersError


async def test_no_responders_on_a_server_whose_info_says_jetstream_is_taken_as_not_ready() -> None:
    assert await jetstream_off(_FakeConnection({"jetstream": True})) is None  # type: ignore[arg-type]
    off = await jetstream_off(_FakeConnection({}))  # type: ignore[arg-type]
    assert off is not None and "JetStream disabled" in off


async def test_a_short_lived_open_gives_up_on_a_jetstream_without_meta_leader_saying_why(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path, size=3)
    cluster.servers[0].start()
    try:
        started = time.monotonic()
        with pytest.raises(LogError) as raised:
            await asyncio.wait_for(JetStreamLog.open(cluster.servers[0].url, persistent=False), 30)
        assert time.monotonic() - started < 10  # (the CLI gives up at 10 s)
        assert not isinstance(raised.value, JetStreamOff)
        assert f"the NATS server at {cluster.servers[0].url} answers, but its JetStream did not" in str(raised.value)
        assert "meta leader" in str(raised.value)
    finally:
        cluster.stop()
