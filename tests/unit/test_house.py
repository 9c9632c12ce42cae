"""The floor plan holds: libs never names services or apps, every service is one spec found in its
own folder, one writer per event type, each service's routing and NATS permissions agree with what
it emits."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from apps import registry
from gpuherd import events as ev
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


def test_the_library_keeps_no_table_of_services() -> None:
    """No list of services, their subjects or their consumers in libs: each spec says what its service
    is. (Service names in libs are history only: v1 ticks are upcast by the service that wrote them.)"""
    tables = re.compile(
        r"^(SERVICES|SERVICE_APPENDS|INTAKE_CONSUMER|COMPOSE_NODES|COMPOSE_SOURCES)\b|scheduler-intake", re.M
    )
    offenders = [
        str(p.relative_to(ROOT)) for p in (ROOT / "libs" / "gpuherd").rglob("*.py") if tables.search(p.read_text())
    ]
    assert offenders == []
    names = "|".join(sorted(s.name for s in registry.specs()))
    several = re.compile(rf"""["']({names})["'][^\n]*["']({names})["']""")
    history = {"libs/gpuherd/events/cluster.py"}
    listed = [
        str(p.relative_to(ROOT)) for p in (ROOT / "libs" / "gpuherd").rglob("*.py") if several.search(p.read_text())
    ]
    assert set(listed) <= history, listed


def test_every_service_folder_has_its_spec_and_nothing_else_lists_them() -> None:
    folders = {p.parent.name for p in (ROOT / "services").glob("*/spec.py")}
    assert folders == {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").exists()}
    assert len(registry.specs()) == len(folders)
    # (The simulator, `gpuherd up`, status and the permission file read the registry: a service named
    # in their code would be a list kept by hand.)
    for path in ("apps/sim/run.py", "apps/cluster/local.py", "apps/deployment.py", "apps/cli/ops.py"):
        code = "\n".join(line for line in (ROOT / path).read_text().splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"""from services\.\w+\.(decide|spec|service) import""", code), path
        assert not re.search(r"""Simulated\(|ElasticDecider|MemoryDecider|AnalyticsDecider""", code), path


def test_every_event_type_has_exactly_one_writer() -> None:
    """(A refusal is written by the one service that applies the refused command: one writer per command.)"""
    who = registry.writers()
    assert set(ev.EVENT_TYPES.values()) - set(who) == set(), "an event nobody writes"
    several = {kind.__name__: names for kind, names in who.items() if len(names) > 1 and kind is not ev.CommandRefused}
    assert several == {}, f"event types with several writers: {several}"
    assert ev.Unreadable not in who, "readers make it; nobody writes it"
    refusers: dict[type, list[str]] = {}
    for service in registry.deciders():
        for command in service.decider().REFUSES:  # type: ignore[misc]
            refusers.setdefault(command, []).append(service.name)
    assert set(refusers) == {k for k in registry.operator_commands() if issubclass(k, ev.Command)}
    assert all(len(names) == 1 for names in refusers.values()), refusers
    assert {name for names in refusers.values() for name in names} == set(who[ev.CommandRefused])


def test_each_service_ticks_its_own_clock_and_follows_only_its_own_ticks() -> None:
    for service in registry.specs():
        own = {k for k in service.emits if issubclass(k, ev.Tick)}
        followed = {k for k in service.follows if issubclass(k, ev.Tick)}
        assert followed <= own, (service.name, followed)
        if service.timer is not None:
            assert service.timer.tick in own, service.name


def test_a_decider_spec_and_its_decider_agree() -> None:
    for service in registry.deciders():
        decider = service.decider()  # type: ignore[misc]
        assert (decider.name, decider.FOLLOWS, decider.EMITS) == (service.name, service.follows, service.emits)


# What serving a decider must not import: every process that serves one looks up every spec, and
# these cost it its start, about 65 MB, and its exit (their teardown). (nats-py itself loads
# aiohttp's client; its web server is the dashboard's.)
OFFLINE_ONLY = ("pandas", "matplotlib", "aiohttp.web", "lightgbm", "torch")

LOADS_A_DECIDER_PROCESS = """
import sys
from apps.cli import build_parser
from apps import registry
from gpuherd.runtime import shell
build_parser()  # `gpuherd serve NAME`: the CLI's parser, then the service's own
for spec in registry.deciders():
    args = shell.build_parser(spec).parse_args([])
    decider = spec.live_decider(args) if spec.live_decider is not None else spec.decider()
    shell.live_tasks(spec, decider, args)
print(" ".join(name for name in {names!r} if name in sys.modules))
"""


def test_serving_a_decider_loads_no_offline_library() -> None:
    """Reports, trace tables, the web server and training load where they are used, not where the
    CLI, a spec or a decider is built (a fresh interpreter: this one has them all by now)."""
    code = LOADS_A_DECIDER_PROCESS.format(names=OFFLINE_ONLY)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == []


def test_the_scheduler_follows_exactly_its_routes_and_coalesces_only_passes() -> None:
    assert frozenset(ROUTES) == SchedulerDecider.FOLLOWS
    for kind, route in ROUTES.items():
        assert (kind in COALESCIBLE) == (route.react is None and route.passes is True), kind.__name__


def _subject_pattern(subject: str) -> re.Pattern[str]:
    return re.compile("^" + subject.replace(".", r"\.").replace("*", r"[^.]+").replace(">", ".+") + "$")


def test_what_a_service_emits_its_nats_user_may_append() -> None:
    for service in registry.specs():
        for user in service.users(["n1"]):
            instance = service.instance_of(user)
            patterns = [_subject_pattern(s) for s in service.permissions_for(instance).publish]
            source = f"agent.{instance}" if service.role == "agent" else service.name
            for kind in service.emits | service.records:
                placeholder = SimpleNamespace(**dict.fromkeys(kind.__struct_fields__, "x"))
                placeholder.source, placeholder.node = source, instance
                subject = kind.subject(placeholder)  # type: ignore[arg-type]
                assert any(p.match(subject) for p in patterns), f"{user} may not append {kind.__name__} to {subject}"


def test_agents_and_operators_write_only_inputs_never_decisions() -> None:
    agents = [s for s in registry.specs() if s.role == "agent"]
    for kind in {k for s in agents for k in s.emits} | registry.operator_commands():
        assert not issubclass(kind, ev.Decision) or kind is ev.JobStarted, kind.__name__


def test_no_log_call_passes_event_as_a_keyword() -> None:
    """structlog takes a call's message as ``event``: ``log.info("msg", event=...)`` raises
    TypeError where it runs (a leader recording its --params, a node's power change, an elastic
    worker's message crashed so), however rarely that line is reached."""
    offenders = []
    for folder in ("libs", "services", "apps"):
        for path in (ROOT / folder).rglob("*.py"):
            for call in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr in {"debug", "info", "warning", "error", "exception", "critical"}
                    and any(keyword.arg == "event" for keyword in call.keywords)
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert offenders == []
