"""The floor plan holds: libs never names services or apps, one writer per event type, each
service's routing and NATS permissions agree with what it emits."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from apps.registry import AGENT_EMITS, OPERATOR_EMITS, SERVICES, writers
from gpuherd import events as ev
from gpuherd.security import SERVICE_APPENDS
from services.scheduler.decide import COALESCIBLE, ROUTES, SchedulerDecider

ROOT = Path(__file__).resolve().parents[2]


def test_the_library_names_no_service_and_no_app_not_even_by_string() -> None:
    named = re.compile(r"""(^\s*(from|import)\s+(services|apps)\b)|(["'](services|apps)[.:])""", re.MULTILINE)
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "libs" / "gpuherd").rglob("*.py")
        if named.search(path.read_text())
    ]
    assert offenders == []


def test_every_event_type_has_exactly_one_writer() -> None:
    """(A refusal is written by the one service that applies the refused command: one writer per command.)"""
    who = writers()
    assert set(ev.EVENT_TYPES.values()) - set(who) == set(), "an event nobody writes"
    several = {kind.__name__: names for kind, names in who.items() if len(names) > 1 and kind is not ev.CommandRefused}
    assert several == {}, f"event types with several writers: {several}"
    assert ev.Unreadable not in who, "readers make it; nobody writes it"
    refusers: dict[type, list[str]] = {}
    for service in SERVICES.values():
        for command in service.decider.REFUSES if service.decider is not None else ():
            refusers.setdefault(command, []).append(service.name)
    assert set(refusers) == {k for k in OPERATOR_EMITS if issubclass(k, ev.Command)}
    assert all(len(names) == 1 for names in refusers.values()), refusers
    assert {name for names in refusers.values() for name in names} == set(who[ev.CommandRefused])


def test_each_service_ticks_its_own_clock_and_follows_only_its_own_ticks() -> None:
    for service in SERVICES.values():
        own = {k for k in service.emits if issubclass(k, ev.Tick)}
        followed = {k for k in service.follows if issubclass(k, ev.Tick)}
        assert followed <= own, (service.name, followed)


def test_the_scheduler_follows_exactly_its_routes_and_coalesces_only_passes() -> None:
    assert frozenset(ROUTES) == SchedulerDecider.FOLLOWS
    for kind, route in ROUTES.items():
        assert (kind in COALESCIBLE) == (route.react is None and route.passes is True), kind.__name__


def test_what_a_service_emits_its_nats_user_may_append() -> None:
    for name, subjects in SERVICE_APPENDS.items():
        patterns = [re.compile("^" + s.replace(".", r"\.").replace("*", r"[^.]+") + "$") for s in subjects]
        for kind in SERVICES[name].emits:
            placeholder = SimpleNamespace(**dict.fromkeys(kind.__struct_fields__, "x"))
            placeholder.source = name
            subject = kind.subject(placeholder)  # type: ignore[arg-type]
            assert any(p.match(subject) for p in patterns), f"{name} may not append {kind.__name__} to {subject}"


def test_agents_and_operators_write_only_inputs_never_decisions() -> None:
    for kind in AGENT_EMITS | OPERATOR_EMITS:
        assert not issubclass(kind, ev.Decision) or kind is ev.JobStarted, kind.__name__
