"""Who may do what on NATS: one user per role, each held to the subjects its role uses.

The roles every deployment has are here (user names in parentheses):

- **submitter** (``submit-<source>``): publishes submissions to ``herd.intake.<source>``, asks the
  scheduler where a job stands (``herd.ctl.scheduler.job``), and reads the answers in its own
  inboxes. It cannot read the log.
- **reader** (``reader``): the read-only CLI (``jobs``, ``events``, ``replay --audit``, ``status``):
  reads everything, appends nothing.
- **admin** (``admin``): everything; creates the streams (``gpuherd log init``) and records
  operator events (VCs, policy, drains, cancels).

Each service's users and rights come from its own spec (``ServiceSpec.permissions``, built with the
pieces below): a decider appends only the events it decides and writes its own snapshot,
leadership and status; an agent (``agent-<node>``) only its own node's events; the dashboard what
the reader may plus the operator commands it offers. This module names no service.

Every user's inboxes are ``_INBOX.<user>.>`` (the client sets its inbox prefix from ``NATS_USER``),
so no one reads another's replies. Passwords are never in the config: it names environment
variables (``$GPUHERD_PW_<USER>``) that nats-server substitutes at start.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING

import msgspec

from gpuherd.events import Event, leadership_subject
from gpuherd.log import (
    CONTROL_PREFIX,
    DEAD_LETTER_PREFIX,
    HERD,
    HERD_DEAD,
    HERD_INTAKE,
    HERD_TELEMETRY,
    INTAKE_PREFIX,
    LEADERSHIP_BUCKET,
    SNAPSHOT_BUCKET,
    STATUS_BUCKET,
)

if TYPE_CHECKING:
    from gpuherd.runtime.spec import ServiceSpec

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


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


def inbox(user: str) -> str:
    return f"_INBOX.{user}.>"


def read_log() -> tuple[str, ...]:
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


def kv_write(bucket: str, key_pattern: str) -> str:
    return f"$KV.{bucket}.{key_pattern}"


def appends_of(kinds: Iterable[type[Event]], **fixed: str) -> tuple[str, ...]:
    """The HERD subjects events of these types are appended to, with ``fixed`` fields (``source``,
    an agent's ``node``) as given and every other field any token (``*``): a user may append
    exactly what its service writes, read off the events' own ``subject()``."""
    subjects = set()
    for kind in kinds:
        placeholder = SimpleNamespace(**dict.fromkeys(kind.__struct_fields__, "*"))
        placeholder.__dict__.update(fixed)
        subjects.add(kind.subject(placeholder))  # type: ignore[arg-type]
    return tuple(sorted(subjects))


def decider_permissions(
    name: str,
    appends: Sequence[str],
    *,
    publish: Sequence[str] = (),
    subscribe: Sequence[str] = (),
    allow_responses: bool = False,
) -> Permissions:
    """A decider's rights: read the log, append to ``appends`` (the HERD subjects of the events it
    decides), keep its own dead letters, snapshot, leadership and status entry; plus ``publish``,
    ``subscribe`` and ``allow_responses`` for what else it does (an intake consumer, questions)."""
    check_token("service", name)
    allowed = [
        *appends,
        *read_log(),
        f"{DEAD_LETTER_PREFIX}.{name}",
        kv_write(SNAPSHOT_BUCKET, name),
        kv_write(SNAPSHOT_BUCKET, f"{name}.parts.>"),  # (a snapshot too large for one message)
        kv_write(LEADERSHIP_BUCKET, f"decider.{name}"),
        kv_write(STATUS_BUCKET, f"{name}.>"),
        leadership_subject(name),  # its runtime's fence (LeadershipTaken)
        *publish,
    ]
    return Permissions(publish=tuple(allowed), subscribe=(inbox(name), *subscribe), allow_responses=allow_responses)


def intake_consumer_permissions(consumer: str) -> tuple[str, ...]:
    """What reading HERD_INTAKE through the durable ``consumer`` takes (and answering submitters)."""
    return (
        f"$JS.API.CONSUMER.CREATE.{HERD_INTAKE}.{consumer}",
        f"$JS.API.CONSUMER.CREATE.{HERD_INTAKE}.{consumer}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{HERD_INTAKE}.{consumer}",
        f"$JS.API.CONSUMER.INFO.{HERD_INTAKE}.{consumer}",
        f"$JS.API.CONSUMER.MSG.NEXT.{HERD_INTAKE}.{consumer}",
        f"$JS.ACK.{HERD_INTAKE}.{consumer}.>",
        "_INBOX.>",  # verdicts go to the submitters' inboxes
    )


def submitter_permissions(source: str) -> Permissions:
    check_token("source", source)
    # It may ask the scheduler where a job stands (``scheduler.job``: to follow what it submitted), and
    # nothing else of the live services.
    return Permissions(
        publish=(f"{INTAKE_PREFIX}.{source}", f"{CONTROL_PREFIX}.scheduler.job"), subscribe=(inbox(f"submit-{source}"),)
    )


def reader_permissions() -> Permissions:
    # May ask live services questions (an agent's job logs): answers, not history.
    return Permissions(publish=(*read_log(), f"{CONTROL_PREFIX}.>"), subscribe=(inbox("reader"),))


def users(specs: Iterable[ServiceSpec], nodes: Iterable[str], sources: Iterable[str]) -> list[User]:
    """Every user of a deployment: admin and reader, each service's (from its spec: one per node for
    an agent), and one submitter per source."""
    nodes = [check_token("node", n) for n in nodes]
    out = [User("admin", "admin", None), User("reader", "reader", reader_permissions())]
    for spec in sorted(specs, key=lambda s: ({"decider": 0, "reader": 1, "proxy": 2, "agent": 3}[s.role], s.name)):
        out += [User(user, spec.role, spec.permissions_for(spec.instance_of(user))) for user in spec.users(nodes)]
    out += [User(f"submit-{s}", "submitter", submitter_permissions(s)) for s in sources]
    return out


def _list(items: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def render_accounts(specs: Iterable[ServiceSpec], nodes: Sequence[str], sources: Sequence[str]) -> str:
    """The ``accounts`` block of nats-server.conf for these services, agents' nodes and submitters' sources."""
    lines = [
        "# Generated by `gpuherd security nats-accounts`; edit the nodes and sources there, not here.",
        "# Passwords come from the environment of nats-server ($GPUHERD_PW_<USER>), never from this file.",
        "accounts {",
        "  HERD {",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user in users(specs, nodes, sources):
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
