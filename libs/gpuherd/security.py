"""Who may do what on NATS: one user per role, each held to the subjects its role uses.

The roles (user names in parentheses):

- **submitter** (``submit-<source>``): publishes submissions to ``herd.intake.<source>`` only and
  reads the verdicts in its own inboxes. It cannot read the log.
- **agent** (``agent-<node>``): reads the log; appends only its own node's events
  (``herd.node.<node>``, ``herd.job.<id>.by.<node>``, ``herd.lease.<id>.by.<node>``) and telemetry
  (``herd.telemetry.<node>.>``); holds only its node's lease; answers ``herd.ctl.<node>.>``.
- **service** (``scheduler``, ``elastic``, ``memory``, ``analytics``): reads the log; appends only
  the events its decider makes; writes its own snapshot, lease and status. Only the scheduler reads
  intake and answers submitters.
- **reader** (``reader``): the read-only CLI (``jobs``, ``events``, ``replay --audit``, ``status``):
  reads everything, appends nothing.
- **dashboard** (``dashboard``): the web dashboard: what the reader may, plus its own status entry
  and the operator commands its pages offer (cancel a job, drain and undrain a node), which it
  sends only for a request carrying its operator token.
- **admin** (``admin``): everything; creates the streams (``gpuherd log init``) and records
  operator events (VCs, policy, drains, cancels).

Every user's inboxes are ``_INBOX.<user>.>`` (the client sets its inbox prefix from ``NATS_USER``),
so no one reads another's replies. Passwords are never in the config: it names environment
variables (``$GPUHERD_PW_<USER>``) that nats-server substitutes at start.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import msgspec

from gpuherd.events import leadership_subject
from gpuherd.log import (
    CONTROL_PREFIX,
    DEAD_LETTER_PREFIX,
    HERD,
    HERD_DEAD,
    HERD_INTAKE,
    HERD_TELEMETRY,
    INTAKE_PREFIX,
    LEASE_BUCKET,
    SNAPSHOT_BUCKET,
    STATUS_BUCKET,
    TELEMETRY_PREFIX,
)

SERVICES = ("scheduler", "elastic", "memory", "analytics")
# The agents' nodes and the submitters' sources of the compose deployment (infra/nats/accounts.conf).
COMPOSE_NODES = ("gpu-1", "sim-1", "sim-2", "cpu-1")
COMPOSE_SOURCES = ("ci", "notebook")
INTAKE_CONSUMER = "scheduler-intake"  # the scheduler's durable consumer of HERD_INTAKE
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

# The HERD subjects each service's decider appends to (see each event's ``subject()``).
SERVICE_APPENDS: dict[str, tuple[str, ...]] = {
    "scheduler": (
        "herd.job.*",
        "herd.rejected.*",
        "herd.node.*",
        "herd.clock.scheduler",
        "herd.cluster.policy",
        "herd.cluster.refused.scheduler",
    ),
    "elastic": ("herd.job.*", "herd.clock.elastic", "herd.cluster.elastic", "herd.cluster.refused.elastic"),
    "memory": ("herd.lease.*", "herd.clock.memory", "herd.cluster.memory", "herd.cluster.refused.memory"),
    "analytics": ("herd.job.*", "herd.node.*", "herd.clock.analytics"),
}


class Permissions(msgspec.Struct, frozen=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may answer the requests it receives (herd.ctl)


class User(msgspec.Struct, frozen=True):
    name: str
    role: str
    permissions: Permissions | None  # None: everything (admin)

    @property
    def password_env(self) -> str:
        return password_env(self.name)


def password_env(user: str) -> str:
    """The environment variable holding ``user``'s password, for nats-server and for the client."""
    return "GPUHERD_PW_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper()


def check_token(what: str, value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a NATS subject token: use letters, digits, '-' and '_'")
    return value


def _inbox(user: str) -> str:
    return f"_INBOX.{user}.>"


def _read_log() -> tuple[str, ...]:
    """JetStream API calls that read HERD, telemetry, dead letters and the KV buckets, and nothing else."""
    readable = (HERD, HERD_TELEMETRY, HERD_DEAD, f"KV_{STATUS_BUCKET}")
    subjects = ["$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST"]
    for stream in readable:
        subjects += [
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>",
        ]
    # Direct gets (KV reads, last event of a subject); flow-control replies of push consumers (KV listings).
    subjects += ["$JS.API.DIRECT.GET.>", "$JS.API.STREAM.MSG.GET.*", "$JS.FC.>"]
    return tuple(subjects)


def _kv_write(bucket: str, key_pattern: str) -> str:
    return f"$KV.{bucket}.{key_pattern}"


def service_permissions(service: str) -> Permissions:
    if service not in SERVICE_APPENDS:
        raise ValueError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    publish = [
        *SERVICE_APPENDS[service],
        *_read_log(),
        f"{DEAD_LETTER_PREFIX}.{service}",
        _kv_write(SNAPSHOT_BUCKET, service),
        _kv_write(LEASE_BUCKET, f"decider.{service}"),
        _kv_write(STATUS_BUCKET, f"{service}.>"),
        leadership_subject(service),  # its runtime's fence (LeadershipTaken)
    ]
    subscribe = [_inbox(service)]
    if service == "scheduler":
        publish += [
            f"$JS.API.CONSUMER.CREATE.{HERD_INTAKE}.{INTAKE_CONSUMER}",
            f"$JS.API.CONSUMER.CREATE.{HERD_INTAKE}.{INTAKE_CONSUMER}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{HERD_INTAKE}.{INTAKE_CONSUMER}",
            f"$JS.API.CONSUMER.INFO.{HERD_INTAKE}.{INTAKE_CONSUMER}",
            f"$JS.API.CONSUMER.MSG.NEXT.{HERD_INTAKE}.{INTAKE_CONSUMER}",
            f"$JS.ACK.{HERD_INTAKE}.{INTAKE_CONSUMER}.>",
            "_INBOX.>",  # verdicts go to the submitters' inboxes
        ]
        subscribe += [f"{INTAKE_PREFIX}.>", f"{CONTROL_PREFIX}.scheduler.>"]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe), allow_responses=service == "scheduler")


def agent_permissions(node: str) -> Permissions:
    check_token("node", node)
    user = f"agent-{node}"
    publish = (
        f"herd.node.{node}",
        f"herd.job.*.by.{node}",
        f"herd.lease.*.by.{node}",
        f"{TELEMETRY_PREFIX}.{node}.>",
        *_read_log(),
        f"{DEAD_LETTER_PREFIX}.{user}",
        _kv_write(LEASE_BUCKET, f"agent.{node}"),
        _kv_write(SNAPSHOT_BUCKET, f"agent.{node}"),
        _kv_write(STATUS_BUCKET, f"{user}.>"),
    )
    return Permissions(publish=publish, subscribe=(_inbox(user), f"{CONTROL_PREFIX}.{node}.>"), allow_responses=True)


def submitter_permissions(source: str) -> Permissions:
    check_token("source", source)
    return Permissions(publish=(f"{INTAKE_PREFIX}.{source}",), subscribe=(_inbox(f"submit-{source}"),))


def reader_permissions() -> Permissions:
    # May ask live services questions (an agent's job logs): answers, not history.
    return Permissions(publish=(*_read_log(), f"{CONTROL_PREFIX}.>"), subscribe=(_inbox("reader"),))


# The HERD subjects of the operator commands the dashboard offers (JobCancelRequested, NodeDrained,
# NodeUndrained): each aggregate's own subject, never an agent's ``.by.<node>`` one.
DASHBOARD_APPENDS = ("herd.job.*", "herd.node.*")


def dashboard_permissions() -> Permissions:
    publish = (*_read_log(), f"{CONTROL_PREFIX}.>", *DASHBOARD_APPENDS, _kv_write(STATUS_BUCKET, "dashboard.>"))
    return Permissions(publish=publish, subscribe=(_inbox("dashboard"),))


def users(nodes: Iterable[str], sources: Iterable[str]) -> list[User]:
    out = [User("admin", "admin", None), User("reader", "reader", reader_permissions())]
    out.append(User("dashboard", "dashboard", dashboard_permissions()))
    out += [User(s, "service", service_permissions(s)) for s in SERVICES]
    out += [User(f"agent-{n}", "agent", agent_permissions(n)) for n in nodes]
    out += [User(f"submit-{s}", "submitter", submitter_permissions(s)) for s in sources]
    return out


def _list(items: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def render_accounts(nodes: Sequence[str], sources: Sequence[str]) -> str:
    """The ``accounts`` block of nats-server.conf for these agents' nodes and submitters' sources."""
    lines = [
        "# Generated by `gpuherd security nats-accounts`; edit the nodes and sources there, not here.",
        "# Passwords come from the environment of nats-server ($GPUHERD_PW_<USER>), never from this file.",
        "accounts {",
        "  HERD {",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user in users(nodes, sources):
        lines.append(f"      # {user.role}")
        head = f"      {{ user: {user.name}, password: ${user.password_env}"
        if user.permissions is None:
            lines.append(head + " }")
            continue
        p = user.permissions
        lines.append(head + ", permissions: {")
        lines.append(f"          publish: {{ allow: {_list(p.publish)} }}")
        lines.append(f"          subscribe: {{ allow: {_list(p.subscribe)} }}")
        if p.allow_responses:
            lines.append("          allow_responses: true")
        lines.append("      } }")
    lines += [
        "    ]",
        "  }",
        "  SYS { users: [ { user: sys, password: $GPUHERD_PW_SYS } ] }",
        "}",
        "system_account: SYS",
        "",
    ]
    return "\n".join(lines)
