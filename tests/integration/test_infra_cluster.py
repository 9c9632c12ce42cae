"""The compose deployment's NATS cluster without Docker: three nats-servers of
``infra/nats/server.conf`` and ``accounts.conf`` (ports and paths moved to this host), the streams
made with 3 replicas by ``admin`` as compose's ``init`` does, then what ops and the dashboard do
against it with nothing but their own user: no GPUHERD_REPLICAS, no GPUHERD_STREAMS."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from apps.deployment import nats_users
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log
from gpuherd.log.streams import HERD, HERD_DEAD, HERD_INTAKE, HERD_TELEMETRY
from gpuherd.natsd import find_binary, free_port
from gpuherd.security import password_env

pytestmark = pytest.mark.slow

INFRA = Path(__file__).resolve().parents[2] / "infra"
SERVERS = ("nats-1", "nats-2", "nats-3")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The three servers: (client URL of all three, password by user)."""
    folder = tmp_path_factory.mktemp("compose-nats")
    (folder / "accounts.conf").write_text((INFRA / "nats" / "accounts.conf").read_text())
    ports = {name: (free_port(), free_port(), free_port()) for name in SERVERS}  # client, monitor, route
    passwords = {u.name: f"pw-{u.name}" for u in nats_users()} | {"sys": "pw-sys"}
    env = dict(os.environ) | {password_env(user): pw for user, pw in passwords.items()}
    processes = []
    for name, (client, monitor, route) in ports.items():
        text = (INFRA / "nats" / "server.conf").read_text()
        text = text.replace("0.0.0.0:4222", f"127.0.0.1:{client}").replace("0.0.0.0:8222", f"127.0.0.1:{monitor}")
        text = text.replace("0.0.0.0:6222", f"127.0.0.1:{route}").replace("/data", str(folder / name))
        for other, (_, _, other_route) in ports.items():
            text = text.replace(f"nats-route://{other}:6222", f"nats-route://127.0.0.1:{other_route}")
        (folder / f"{name}.conf").write_text(text)
        command = [find_binary(), "-c", str(folder / f"{name}.conf")]
        log = (folder / f"{name}.log").open("w")
        processes.append(subprocess.Popen(command, env=env | {"NATS_SERVER_NAME": name}, stdout=log, stderr=log))
    try:
        deadline = time.monotonic() + 30
        for _, monitor, _ in ports.values():  # the full /healthz: JetStream with a meta leader
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{monitor}/healthz", timeout=2)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the three servers did not form a JetStream cluster"
                    time.sleep(0.2)
        yield ",".join(f"nats://127.0.0.1:{client}" for client, _, _ in ports.values()), passwords
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


def _as(user: str, passwords: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GPUHERD_REPLICAS", "GPUHERD_STREAMS", "NATS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NATS_USER", user)
    monkeypatch.setenv("NATS_PASSWORD", passwords[user])


async def _replicas(url: str, passwords: dict[str, str]) -> dict[str, int]:
    nc = await nats.connect(url.split(","), user="admin", password=passwords["admin"])
    try:
        js = nc.jetstream()
        return {
            name: (await js.stream_info(name)).config.num_replicas
            for name in (HERD, HERD_INTAKE, HERD_TELEMETRY, HERD_DEAD)
        }
    finally:
        await nc.close()


async def test_nobody_but_init_changes_the_replicas_and_nobody_hangs_on_them(
    cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, passwords = cluster
    _as("admin", passwords, monkeypatch)
    init = await open_log(url, name="init", persistent=False, streams="create", replicas=3)  # compose's init
    gpu = ev.GpuInfo(index=0, uuid="GPU-0", model="sim", memory_mb=1024)
    await init.append([ev.NodeRegistered(id="reg-sim-1", at=1.0, source="agent.sim-1", node="sim-1", gpus=(gpu,))])
    await init.close()
    assert set((await _replicas(url, passwords)).values()) == {3}

    # `gpuherd status` as reader (the README's command): it only looks, and at once.
    _as("reader", passwords, monkeypatch)
    started = time.monotonic()
    reader = await open_log(url, name="status", persistent=False)
    await reader.close()
    assert time.monotonic() - started < 3

    # An operator's command as admin (`gpuherd nodes`, `gpuherd drain`): the log keeps its 3 copies.
    _as("admin", passwords, monkeypatch)
    admin = await open_log(url, name="cli", persistent=False)
    await admin.close()
    client = await Client.connect(url, source="cli")
    try:
        await asyncio.wait_for(client.drain("sim-1", "maintenance"), 10)
    finally:
        await client.close()
    assert set((await _replicas(url, passwords)).values()) == {3}

    # The dashboard's operator actions (docker-compose.operator.yml), as its own user.
    _as("dashboard", passwords, monkeypatch)
    client = await Client.connect(url, source="dashboard")
    try:
        await asyncio.wait_for(client.drain("sim-1", "", undrain=True), 10)
    finally:
        await client.close()
    assert set((await _replicas(url, passwords)).values()) == {3}
