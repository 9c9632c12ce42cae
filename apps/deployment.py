"""The compose deployment (``infra/``) as the code sees it: the agents' nodes and the submitters'
sources it runs, and the NATS accounts for them (``infra/nats/accounts.conf``, rendered from every
service's spec; CI checks the committed file is current)."""

from __future__ import annotations

from collections.abc import Sequence

from apps import registry
from gpuherd.security import User, render_accounts, users

COMPOSE_NODES = ("gpu-1", "sim-1", "sim-2", "cpu-1")
COMPOSE_SOURCES = ("ci", "notebook")


def accounts(nodes: Sequence[str] = COMPOSE_NODES, sources: Sequence[str] = COMPOSE_SOURCES) -> str:
    """The ``accounts`` block of nats-server.conf: admin, reader, every service's users, submitters."""
    return render_accounts(registry.specs(), nodes, sources)


def nats_users(nodes: Sequence[str] = COMPOSE_NODES, sources: Sequence[str] = COMPOSE_SOURCES) -> list[User]:
    return users(registry.specs(), nodes, sources)
