"""The compose deployment as ops run it, checked without a Docker engine: what it publishes beyond
the host, what its containers need to follow a TLS switch, and whether the commands the README gives
ops work against it (what each needs from the environment)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.compose_file import INFRA, dotenv, interpolate, load_compose, published

README = INFRA.parent / "README.md"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def test_only_the_nats_client_port_is_published_beyond_the_host(compose: dict[str, Any]) -> None:
    """Submitters reach NATS (authenticated) from elsewhere; everything else a container serves
    (metrics with per-user GPU usage, health, the dashboard, Prometheus, Grafana) answers without a
    password, so it is published on 127.0.0.1 at most (Prometheus scrapes on the compose network)."""
    for name, service in compose["services"].items():
        for host, port in published(service):
            if name.startswith("nats-") and port == "4222":
                continue
            assert host == "127.0.0.1", f"{name} publishes :{port} on every interface of the host"


@pytest.mark.parametrize("ca", ["", "./nats/certs/ca.pem"])
def test_every_gpuherd_container_trusts_the_nats_ca_when_the_servers_speak_tls(ca: str) -> None:
    """NATS_CONFIG=server-tls.conf makes the servers refuse plain clients and certificates of
    another CA (tests/integration/test_permissions.py::test_tls_with_the_dev_ca): every gpuherd
    container (init, services, agents, dashboard) gets NATS_CA, a file it can read, from infra/.env's
    NATS_CA; with it empty, none is given one (plain NATS)."""
    assert "NATS_CA" in dotenv(), "infra/.env says where the CA is (empty: plain NATS)"
    env = dotenv() | {"NATS_CA": ca, "NATS_CONFIG": "server-tls.conf" if ca else "server.conf"}
    compose = interpolate(yaml.safe_load((INFRA / "docker-compose.yml").read_text()), env)
    gpuherd = {n: s for n, s in compose["services"].items() if "gpuherd" in str(s.get("image", ""))}
    assert {"init", "scheduler", "dashboard", "sim-1", "gpu-1"} <= set(gpuherd)
    for name, service in gpuherd.items():
        inside = service["environment"].get("NATS_CA")
        if not ca:
            assert not inside, name
            continue
        assert inside, f"{name}: no NATS_CA, so it cannot connect to servers that speak only TLS"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}
        assert mounts.get(inside) == ca, f"{name}: NATS_CA={inside} is not the CA of infra/.env ({mounts})"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_the_readme_adds_a_nats_user_by_recreating_the_servers_one_at_a_time() -> None:
    """A new user's password reaches a NATS server only through its container's environment
    (secrets.env, read when the container is created): `nats-server --signal reload` then fails on
    the accounts.conf that names it ("variable reference ... can not be found", checked on a real
    server), and `make up` recreates all three servers at once. The README says to recreate them
    one at a time, each after the one before has caught up."""
    deploy, operate = _section("Deploying with docker compose"), _section("Operating it")
    adding = deploy[deploy.index("Adding a node or a submitter") :].split("\n\n")[0]
    assert "recreate" in adding, adding
    assert not re.search(r"and reload the servers \(`nats-server --signal reload`\)\.", adding), adding
    assert re.search(r"up -d --no-deps --force-recreate nats-\d", operate), "no rolling restart of NATS"
    assert "localhost:8222/healthz`" in operate, "wait for the full /healthz (streams current) between servers"


def test_the_dashboard_shows_the_report_the_analytics_service_writes(compose: dict[str, Any]) -> None:
    """The analytics service writes its characterization report to its volume; the dashboard had
    neither --report-dir nor that volume, so its Audit & analysis page listed no report."""

    def option(service: dict[str, Any], name: str) -> str | None:
        command = service["command"]
        return command[command.index(name) + 1] if name in command else None

    def mounts(service: dict[str, Any]) -> dict[str, str]:
        """Where each named volume is mounted (container path -> volume)."""
        return {str(v).split(":")[1]: str(v).split(":")[0] for v in service.get("volumes", [])}

    analytics, dashboard = compose["services"]["analytics"], compose["services"]["dashboard"]
    written, shown = option(analytics, "--report-dir"), option(dashboard, "--report-dir")
    assert written is not None and shown == written, "the dashboard shows the folder the analytics service writes"
    volume_of = {path: volume for path, volume in mounts(analytics).items() if written.startswith(path + "/")}
    assert volume_of, "the report is on a volume"
    ((path, volume),) = volume_of.items()
    assert mounts(dashboard).get(path) == volume, "the dashboard mounts the same volume at the same path"
    assert any(str(v).startswith(f"{volume}:{path}:ro") for v in dashboard["volumes"]), "read-only: it only reads it"


def test_every_nats_server_takes_clients_from_beyond_the_host(compose: dict[str, Any]) -> None:
    """Only nats-1's client port was published: a submitter from elsewhere lost the cluster whenever
    nats-1 restarted (a rolling restart or upgrade, as the README's operating section does it),
    though nats-2 and nats-3 served on. Each server's is published, on a host port of its own."""
    servers = {name: service for name, service in compose["services"].items() if name.startswith("nats-")}
    assert len(servers) == 3
    published = {
        name: [s for s in service.get("ports", []) if str(s).endswith(":4222")] for name, service in servers.items()
    }
    assert all(len(ports) == 1 for ports in published.values()), published
    host_ports = {str(ports[0]).split(":")[-2] for ports in published.values()}
    assert len(host_ports) == 3, f"one host port per server: {published}"


def test_the_readmes_status_command_reads_every_servers_durability(compose: dict[str, Any]) -> None:
    """`gpuherd status` reads how each server fsyncs from its monitoring endpoint; none was published,
    so the README's status command printed "durability: unknown". Each server's is on 127.0.0.1, and
    the README's command names them all."""
    monitors = {
        str(port).split(":")[1]: name
        for name, service in compose["services"].items()
        if name.startswith("nats-")
        for port in service.get("ports", [])
        if str(port).startswith("127.0.0.1:") and str(port).endswith(":8222")
    }
    assert sorted(monitors.values()) == ["nats-1", "nats-2", "nats-3"], monitors
    command = next(line for line in README.read_text().splitlines() if "gpuherd status" in line and "MONITOR" in line)
    named = re.search(r"NATS_MONITOR_URL=(\S+)", command)
    assert named is not None, command
    ports = {url.rsplit(":", 1)[1].rstrip("/") for url in named.group(1).split(",")}
    assert ports == set(monitors), (ports, monitors)
