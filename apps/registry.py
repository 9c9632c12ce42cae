"""Every gpuherd service, found, never listed: each ``services/<name>/spec.py`` holds its ``SPEC``
(``gpuherd.runtime.spec.ServiceSpec``), and an installed plugin adds its own through the
``gpuherd.services`` entry point group (``name = "package.module:SPEC"``).

Everything that starts, simulates, audits, deploys or secures services asks here: ``gpuherd
serve`` and ``gpuherd up``, the simulator, ``gpuherd replay --audit`` and ``why``, ``gpuherd
status``, the compose check and the NATS permission file. Adding a service is one folder.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import pkgutil
from collections.abc import Sequence
from typing import Any

import services
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.log import Record
from gpuherd.runtime.decider import Decider, replay
from gpuherd.runtime.spec import ServiceSpec

ENTRY_POINTS = "gpuherd.services"  # plugins: an entry point naming a ServiceSpec

# Operators' commands about the cluster as a whole (the CLI as admin, the dashboard with its token);
# each service's own commands (``ServiceSpec.records``: its --params, the scheduler's --policy) too.
CLUSTER_COMMANDS: frozenset[type[ev.Event]] = frozenset(
    {ev.VcConfigured, ev.NodeDrained, ev.NodeUndrained, ev.JobCancelRequested, ev.ProfileRequested}
)


class UnknownService(GpuherdError, ValueError):
    """A name that no spec has."""


@functools.cache
def _found() -> dict[str, ServiceSpec]:
    found: dict[str, ServiceSpec] = {}

    def add(spec: object, where: str) -> None:
        if not isinstance(spec, ServiceSpec):
            raise TypeError(f"{where} is not a ServiceSpec")
        if spec.name in found:
            raise ValueError(f"two services named {spec.name!r} (the second in {where})")
        found[spec.name] = spec

    for module in pkgutil.iter_modules(services.__path__):
        name = f"services.{module.name}.spec"
        if module.ispkg and importlib.util.find_spec(name) is not None:
            add(importlib.import_module(name).SPEC, name)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        add(entry.load(), f"entry point {entry.name} ({entry.value})")
    return found


def rediscover() -> None:
    """Look for specs again (a plugin installed since, in tests)."""
    _found.cache_clear()


def specs() -> list[ServiceSpec]:
    """Every service, by name."""
    return [s for _, s in sorted(_found().items())]


def spec(name: str) -> ServiceSpec:
    try:
        return _found()[name]
    except KeyError:
        raise UnknownService(f"no service named {name!r}; services: {', '.join(sorted(_found()))}") from None


def deciders() -> list[ServiceSpec]:
    return [s for s in specs() if s.decider is not None]


def auditable() -> list[str]:
    """The deciders whose every decision the audit re-derives."""
    return [s.name for s in specs() if s.auditable]


def required() -> list[str]:
    """What a deployment must run (``gpuherd status`` says it is degraded without one)."""
    return [s.name for s in specs() if s.required]


def make_decider(name: str, **options: Any) -> Decider[Any]:
    """The decider of service ``name`` with its defaults and those of ``options`` it takes (the
    scheduler's ``policy``: its policy until the log records one; fifo if None). An option it does
    not take, or None, is left out: a command that audits every decider offers each the same."""
    found = spec(name)
    if found.decider is None:
        raise UnknownService(f"{name} is no decider; deciders: {', '.join(s.name for s in deciders())}")
    takes = inspect.signature(found.decider).parameters
    return found.decider(**{k: v for k, v in options.items() if v is not None and k in takes})


def replay_state(decider: Decider[Any], records: Sequence[Record]) -> Any:
    """The decider's own state after folding ``records``."""
    return replay(decider, records)


def operator_commands() -> frozenset[type[ev.Event]]:
    """What operators write: commands about the cluster, and each service's own."""
    return CLUSTER_COMMANDS | {kind for s in specs() for kind in s.records}


def writers() -> dict[type[ev.Event], list[str]]:
    """Who writes each event type: services by name, and ``operator``."""
    out: dict[type[ev.Event], list[str]] = {}
    for service in specs():
        for kind in service.emits:
            out.setdefault(kind, []).append(service.name)
    for kind in operator_commands():
        out.setdefault(kind, []).append("operator")
    out[ev.LeadershipTaken] = ["runtime"]  # each decider's shell fences its own leadership
    return out
