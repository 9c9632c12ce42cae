"""The log is durable by default: every nats-server gpuherd starts fsyncs before it acknowledges,
the opt-out is explicit and loud, and ``gpuherd status`` says which a server does."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from gpuherd.log.health import durability, sync_mode
from gpuherd.natsd import UNSAFE_FSYNC_ENV, NatsServer, NatsServerError, default_sync


def test_sync_mode_reads_varz() -> None:
    assert sync_mode({"jetstream": {"config": {"sync_always": True, "sync_interval": 120_000_000_000}}}) == "always"
    assert sync_mode({"jetstream": {"config": {"sync_interval": 120_000_000_000}}}) == "2m"
    assert sync_mode({"jetstream": {"config": {"sync_interval": 500_000_000}}}) == "0.5s"
    assert sync_mode({"jetstream": {"config": {}}}) == "2m", "nats-server's own default when the config says none"


def test_durable_unless_opted_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(UNSAFE_FSYNC_ENV, raising=False)
    assert default_sync() == "always"
    monkeypatch.setenv(UNSAFE_FSYNC_ENV, "0")
    assert default_sync() == "always"
    monkeypatch.setenv(UNSAFE_FSYNC_ENV, "1")
    assert default_sync() == "2m"


async def test_servers_say_how_they_sync(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    durable = NatsServer(tmp_path / "durable").start()
    unsafe = NatsServer(tmp_path / "unsafe", sync="2m").start()
    try:
        assert "sync_interval: always" in (tmp_path / "durable" / "nats-server.conf").read_text()
        assert "WARNING" in capfd.readouterr().err, "the opt-out is printed"
        seen = await durability([durable.monitor_url, unsafe.monitor_url, "http://127.0.0.1:9"])
        assert [(d["sync"], d["durable"]) for d in seen] == [("always", True), ("2m", False), ("unknown", None)]

        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "apps", "status", "--json"],
            env={"NATS_URL": unsafe.url, "NATS_MONITOR_URL": unsafe.monitor_url, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        view = json.loads(out.stdout)
        assert any("fsyncs every 2m" in problem for problem in view["degraded"]), view["degraded"]
        assert out.returncode == 1
    finally:
        durable.stop()
        unsafe.stop()


def test_a_running_server_is_not_started_twice(tmp_path) -> None:
    """``with NatsServer(...).start() as server`` stops the one process it started: none is left."""
    with NatsServer(tmp_path / "nats").start() as server:
        first = server.proc
        assert server.start() is server and server.proc is first
    assert first is not None and first.poll() is not None


def test_a_server_that_does_not_come_up_in_time_is_not_left_running(tmp_path) -> None:
    server = NatsServer(tmp_path / "nats")
    with pytest.raises(NatsServerError, match="did not listen"):
        server.start(timeout=0.0)  # (gone before it could listen)
    assert server.proc is not None and server.proc.poll() is not None, "the process it started was stopped"
