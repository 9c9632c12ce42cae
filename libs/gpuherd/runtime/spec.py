"""What a service is, declared once, beside its own code: ``services/<name>/spec.py`` holds
``SPEC = ServiceSpec(...)``.

Everything that starts, simulates, audits, deploys or secures a service reads its spec, and nothing
else lists services: ``gpuherd serve`` and ``gpuherd up`` (its command line and how a local cluster
starts it), the simulator (whether and how it takes part, its timer), the audit (``auditable``),
``gpuherd status`` (which deciders a deployment must run), the compose check, and the NATS
permission file (``permissions``). The application layer finds the specs (``apps/registry.py``:
every ``services/*/spec.py``, and the ``gpuherd.services`` entry points of installed plugins).

This module only says what a spec holds; it names no service. A decider's spec is all a service
needs beyond its pure ``decide``: the generic shell (``runtime.shell``) runs any of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpuherd import events as ev
from gpuherd.runtime.decider import ConfiguredDecider, Decider

if TYPE_CHECKING:  # (the runner imports the log client: a spec is read without it)
    from gpuherd.explain import QueueExplainer
    from gpuherd.runtime.runner import DeciderRunner, ExtraTask
    from gpuherd.security import Permissions

Role = Literal["decider", "agent", "reader", "proxy"]
# decider: folds the log and appends decisions, one leader at a time (the generic shell runs it);
# agent:   one process per node, carrying decisions out (its own main);
# reader:  reads the log and decides nothing (its own main; e.g. the dashboard);
# proxy:   stores other processes' events for them and decides nothing (its own main; e.g. the
#          report relay).

# The ``nice`` of a decider no decision waits on within milliseconds (predictions, rescales, leases):
# on a host it shares, the CPU goes first to the scheduler, the agents and NATS when they need it.
BACKGROUND_NICE = 10


def _always(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class TimerSpec:
    """A decider's timer: ``tick`` events of its own type, so time-based decisions (expiries,
    intervals, starvation) happen in the log and replay exactly."""

    tick: type[ev.Tick]
    every_s: float  # the live period (``--tick``)
    # Whether a tick may decide anything, from the decider's state (a broker with no lease needs none).
    needed: Callable[[Any], bool] = _always
    # Whether this decider has time-based decisions at all (analytics only with energy saving on).
    active: Callable[[Decider[Any]], bool] = _always
    # (Simulation) after a pause, it ticks when it would have had it never paused.
    on_grid: bool = False
    # When a time-based decision next falls due in the decider's state (e.g. a job's time limit; None:
    # none): the timer also ticks then, between its periodic ticks (live and simulated).
    due: Callable[[Any], float | None] | None = None
    # A live ticker of its own (e.g. one that also listens to heartbeats), from the command line;
    # None: a plain clock ticker (``runtime.timers.clock_ticker``) every ``--tick`` while ``needed``.
    live: Callable[[argparse.Namespace], ExtraTask] | None = None


@dataclass(frozen=True)
class ParamsSpec:
    """A decider's parameters command: ``--params JSON`` at start records ``event`` (a
    ``...Configured`` command) once checked by ``convert`` (ValueError: refused, with the reason)."""

    event: type[ev.Command]
    convert: Callable[[dict[str, float]], object]
    example: str  # shown in --help


@dataclass(frozen=True)
class Simulated:
    """How a service takes part in one simulation: its decider, and its timer's period (None: its
    timer does not run in this simulation)."""

    decider: Decider[Any]
    tick_every_s: float | None = None


@dataclass(frozen=True)
class LocalContext:
    """What ``gpuherd up`` tells a spec about the local cluster it starts: the NATS URL, the
    cluster's data folder, and its options (``policy``, ``lost_after_s``, ``ui_port``, ... and, for
    an agent, its node's ``node``, ``executor``, ``gpus``, ``rack``, ``port_block``)."""

    url: str
    data_dir: Path
    options: Mapping[str, Any] = field(default_factory=dict)

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)


@dataclass(frozen=True)
class ServiceSpec:
    """One service, whole. Only ``name``, ``about``, ``role``, ``follows``, ``emits`` and
    ``permissions`` are needed by every role; a decider names its ``decider``, an agent or a reader
    its ``main`` and ``parser``."""

    name: str  # a NATS subject token: `gpuherd serve NAME`, its NATS user, its status entry
    about: str
    role: Role
    follows: frozenset[type[ev.Event]]  # the events it acts on (the rest it only folds, if at all)
    emits: frozenset[type[ev.Event]]  # the events it writes (one writer per event type)
    # Operator commands it records on an operator's behalf at start (``--params``, ``--policy``):
    # it may append them, but they are the operator's, not its decisions.
    records: frozenset[type[ev.Command]] = frozenset()
    # Its NATS user's rights, given the instance (an agent's node; else its own name). None (a
    # decider): append what it emits and records, and the usual (see ``permissions_for``).
    permissions: Callable[[str], Permissions] | None = None
    # -- deciders ----------------------------------------------------------------------------------
    # With its defaults (the audit, `gpuherd why`, the dashboard); options by keyword.
    decider: Callable[..., Decider[Any]] | None = None
    # From its command line (default: ``decider()``).
    live_decider: Callable[[argparse.Namespace], Decider[Any]] | None = None
    timer: TimerSpec | None = None
    params: ParamsSpec | None = None
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None  # its own flags
    tasks: Callable[[argparse.Namespace], Sequence[ExtraTask]] = lambda args: ()  # loops beside the runner's
    setup: Callable[[DeciderRunner[Any], argparse.Namespace], None] | None = None  # adjusts the runner
    auditable: bool = False  # the audit re-derives every decision it made
    # How long its live reader lets events gather between pulls while they flow (``--read-linger-ms``;
    # 0: woken by each event as it is stored). Only for a decider nothing waits on within
    # milliseconds: it then costs the host a wake-up per pull, not per event.
    read_linger_s: float = 0.0
    # How far it yields the CPU to the processes decisions wait on (the scheduler, the agents, NATS)
    # where they share a host: a ``nice`` increment its process takes at start (``--nice``).
    nice: int = 0
    # A fresh explainer of its queue (folds from the start, says why each job waits and when it
    # starts), for readers that show it (the dashboard).
    explainer: Callable[[], QueueExplainer] | None = None
    takes_intake: bool = False  # it judges submissions (the simulator hands it the trace's jobs, first)
    # -- agents and readers ------------------------------------------------------------------------
    # ``main(argv)``; a reader's is ``main(argv, peers=...)``, handed the other services' specs.
    main: Callable[..., None] | None = None
    parser: Callable[[], argparse.ArgumentParser] | None = None
    # -- where it runs ---------------------------------------------------------------------------
    # Its part in a simulation, from the simulation's switches (None: it takes no part).
    simulated: Callable[[Mapping[str, Any]], Simulated | None] | None = None
    # Its command line in `gpuherd up` after ``--nats-url`` (None: not started there).
    local_argv: Callable[[LocalContext], list[str] | None] | None = None
    required: bool = True  # a deployment without it is degraded (`gpuherd status`)

    def __post_init__(self) -> None:
        if self.role == "decider" and self.decider is None:
            raise ValueError(f"service {self.name}: a decider's spec names its decider")
        if self.role != "decider" and (self.main is None or self.parser is None):
            raise ValueError(f"service {self.name}: an {self.role}'s spec names its main and parser")
        if self.decider is not None:
            made = self.decider()
            if made.name != self.name:
                raise ValueError(f"service {self.name}: its decider is named {made.name!r}")
        for kind in self.emits:
            if kind.__dict__.get("CATALOGUED", True) is False:
                raise ValueError(f"service {self.name} emits {kind.__name__}, which is not an event type")

    def permissions_for(self, instance: str) -> Permissions:
        """What its NATS user may do (an agent's: for its ``instance`` node)."""
        from gpuherd.security import appends_of, decider_permissions

        if self.permissions is not None:
            return self.permissions(instance)
        if self.role != "decider":
            raise ValueError(f"service {self.name}: an {self.role}'s spec names its permissions")
        return decider_permissions(self.name, appends_of(self.emits | self.records, source=self.name))

    @property
    def state_format(self) -> int | None:
        """Its snapshots' format (a snapshot of another is never read: the state is rebuilt)."""
        return self.decider().STATE_FORMAT if self.decider is not None else None

    def users(self, nodes: Sequence[str]) -> list[str]:
        """Its NATS users: one per node for an agent, else one, named as the service."""
        return [f"{self.name}-{node}" for node in nodes] if self.role == "agent" else [self.name]

    def instance_of(self, user: str) -> str:
        """The instance a NATS user of this service stands for (an agent's node)."""
        return user.removeprefix(f"{self.name}-") if self.role == "agent" else self.name


def switched_decider(
    decider: type[ConfiguredDecider[Any, Any]],
    about: str,
    timer: TimerSpec,
    tasks: Callable[[argparse.Namespace], Sequence[ExtraTask]] = lambda args: (),
    read_linger_s: float = 0.0,
    nice: int = 0,
) -> ServiceSpec:
    """The spec of a decider with a parameters command (``--params``, its ``PARAMS_EXAMPLE`` in the
    help) and a timer, which takes part in a simulation when its name is a switch that is on
    (``gpuherd sim --elastic``) and runs in `gpuherd up` with its defaults: all the elastic service
    and the memory broker need."""
    name = decider.name

    def simulated(switches: Mapping[str, Any]) -> Simulated | None:
        return Simulated(decider(), timer.every_s) if switches.get(name) else None

    return ServiceSpec(
        name=name,
        about=about,
        role="decider",
        follows=decider.FOLLOWS,
        emits=decider.EMITS,
        records=frozenset({decider.CONFIGURED}),
        decider=decider,
        timer=timer,
        params=ParamsSpec(decider.CONFIGURED, decider().convert_params, decider.PARAMS_EXAMPLE),
        tasks=tasks,
        auditable=True,
        simulated=simulated,
        local_argv=lambda ctx: [],
        read_linger_s=read_linger_s,
        nice=nice,
    )
