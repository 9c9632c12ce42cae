"""The compose deployment as ops run it, checked without a Docker engine: what it publishes beyond
the host, what its containers need to follow a TLS switch, and whether the commands the README gives
ops work against it (what each needs from the environment)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.compose_file import load_compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def _published(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, container port) of each published port (no address: every interface)."""
    out = []
    for port in service.get("ports", []):
        parts = str(port).split(":")
        out.append((parts[0] if len(parts) == 3 else "0.0.0.0", parts[-1]))
    return out


def test_only_the_nats_client_port_is_published_beyond_the_host(compose: dict[str, Any]) -> None:
    """Submitters reach NATS (authenticated) from elsewhere; everything else a container serves
    (metrics with per-user GPU usage, health, the dashboard, Prometheus, Grafana) answers without a
    password, so it is published on 127.0.0.1 at most (Prometheus scrapes on the compose network)."""
    for name, service in compose["services"].items():
        for host, port in _published(service):
            if (name, port) == ("nats-1", "4222"):
                continue
            assert host == "127.0.0.1", f"{name} publishes :{port} on every interface of the host"
