"""The decider contract: pure functions over a state, plus the ids and provenance of what they decide.

A decider is ``evolve(state, seq, event)`` (fold an event) and ``decide(state, event)`` (the events
it decides on). Neither reads a clock, randomness or I/O: time comes from the events (``at``), so a
replay makes the same decisions. The runtime (``core``) decides what is decided on which state;
the runner (live) and the simulator only drive it.

A decider declares its routing: ``FOLLOWS``, the event types ``decide`` may act on (the others
are folded and never handed to it); ``EMITS``, the types it writes (one writer per type: the
registry checks it); and ``REFUSES``, the operator commands it applies, and so checks, recording
``CommandRefused`` for one it cannot apply (one service per command). Its state is a msgspec
Struct whose layout is versioned by ``STATE_FORMAT``: a snapshot of another format is never read;
the state is rebuilt from the log instead.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, NamedTuple, Protocol, TypeVar

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply
from gpuherd.log import Record


class HasClock(Protocol):
    seq: int
    now: float


S = TypeVar("S", bound=HasClock)


class Answer(NamedTuple):
    """What a decider makes of an input that is not in the log (a submission from intake): the
    events to append, stamped by the decider itself, and what to tell whoever sent it."""

    events: list[ev.Event]
    reply: bytes = b""


class Decider(abc.ABC, Generic[S]):
    """A pure decider. Subclasses must not read clocks, randomness or I/O."""

    name: ClassVar[str]
    STATE_FORMAT: ClassVar[int] = 1
    FOLLOWS: ClassVar[frozenset[type[ev.Event]]] = frozenset()
    EMITS: ClassVar[frozenset[type[ev.Event]]] = frozenset()
    REFUSES: ClassVar[frozenset[type[ev.Command]]] = frozenset()  # the commands it checks and applies

    @abc.abstractmethod
    def initial_state(self) -> S: ...

    @abc.abstractmethod
    def evolve(self, state: S, seq: int, event: ev.Event) -> S: ...

    @abc.abstractmethod
    def decide(self, state: S, event: ev.Event) -> list[ev.Event]:
        """Drafts of the decisions to append; ids and provenance are stamped by ``stamp``."""

    def follows(self, event: ev.Event) -> bool:
        """Whether ``decide`` may act on ``event`` (routing: the rest is only folded)."""
        return type(event) in self.FOLLOWS

    def coalescible(self, event: ev.Event) -> bool:
        """True when all ``decide`` does for ``event`` is a pass over the whole state (nothing about
        the event itself). Of several such events waiting to be decided, only the last is decided:
        it sees the same state, so it makes the same pass, once."""
        return False

    def only_passes(self, event: ev.Event) -> bool:
        """True when all ``decide`` may make of ``event`` is a pass (or nothing): coalescible, or a
        pass only on some condition. Live, while a pass is being appended, such an event waits for
        it, and the independent inputs behind it are decided meanwhile."""
        return self.coalescible(event)

    def independent(self, event: ev.Event) -> str | None:
        """A key (e.g. the job) when what ``decide`` makes of ``event`` depends on nothing this decider
        decides about other keys: waiting events with different keys are then decided on one state
        and appended together, in one round trip. None: decided alone, after all before it are folded."""
        return None

    def keys_of(self, decisions: Sequence[ev.Event]) -> set[str] | None:
        """The keys (as ``independent`` names them) that ``decisions`` of a pass decide about; None:
        not known. Live, a pass joins the batch of independent inputs waiting ahead of it, decided on
        their state, unless it decides about one of their keys (then it waits for them to fold)."""
        return None

    # -- inputs that are not in the log (only the scheduler takes them: intake) ----------------------

    def take(self, state: S, external: Any) -> Answer:
        """Decide on an input from outside the log (its events carry their own ids and provenance)."""
        raise NotImplementedError(f"decider {self.name} takes no external inputs")

    def external_key(self, external: Any) -> str | None:
        """Like ``independent``, for an external input."""
        return None

    # Whether an answer of ``take`` may be given on the state a decision about the log's events is
    # made on, in one batch with it: true where an answer given on the state just before those
    # decisions is as valid as one given a moment earlier. Then the external inputs waiting right
    # behind a pass are answered in the pass's batch, and do not wait a round trip for it.
    TAKES_BESIDE_PASSES: ClassVar[bool] = False

    def answers(self, event: ev.Decision) -> bool:
        """Whether ``event`` is one of this decider's answers to an external input (the audit
        re-judges those with ``recheck`` rather than re-running ``decide``)."""
        return False

    def recheck(self, state: S, answer: ev.Decision) -> str | None:
        """Why ``answer`` would not be given again on ``state`` (its ``based_on``); None if it would."""
        return None

    def audit_state(self, state: S, recorded: Sequence[ev.Event]) -> S:
        """The state the audit re-decides ``recorded`` (one batch of decisions) on: ``state`` (their
        ``based_on``), unless it cannot say all they were decided by, where the decisions carry it
        (the elastic service's rules, in a log from before they were recorded)."""
        return state

    # -- snapshots ---------------------------------------------------------------------------------------

    @abc.abstractmethod
    def state_type(self) -> type[S]:
        """The state's class (snapshots decode into it)."""

    def encode_state(self, state: S) -> bytes:
        return msgspec.msgpack.encode(state)

    def decode_state(self, data: bytes) -> S:
        return msgspec.msgpack.decode(data, type=self.state_type())


P = TypeVar("P")


class RecordedParams(Generic[P]):
    """A service's parameters as the log last recorded them (a ``...Configured`` event's ``params``),
    converted once per change; ``default`` while the log recorded none. A recorded value the
    service refused (``CommandRefused``) is never folded, so what gets here converts."""

    def __init__(self, default: P, convert: Callable[[dict[str, float]], P]) -> None:
        self.default = default
        self._convert = convert
        self._cached: tuple[tuple, P] | None = None

    def get(self, recorded: dict[str, float] | None) -> P:
        if recorded is None:
            return self.default
        key = tuple(sorted(recorded.items()))
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._convert(recorded))
        return self._cached[1]


class ConfiguredDecider(Decider[S], Generic[S, P]):
    """A decider whose parameters are an operator command (``CONFIGURED``, a ``...Configured``
    event), acting on ``TRIGGERS`` and its own ticks.

    The parameters in force are the log's latest applied command, else this decider's default. A
    command it cannot apply is refused (``CommandRefused``, with the reason) and folded as nothing;
    one recorded unchecked (before commands were checked) that does not convert means the default,
    as it did then.

    A subclass declares its pieces: ``STATE`` (a core-fold state keeping no finished job, with the
    latest applied ``params``) and ``FOLD`` (``fold(state, seq, event, *, params_ok)``), ``PARAMS``
    (the parameters class; its defaults are the default) and ``CONVERT`` (recorded values ->
    parameters, ValueError for ones it cannot apply), and writes ``decide``."""

    CONFIGURED: ClassVar[type[ev.Command]]
    TRIGGERS: ClassVar[frozenset[type[ev.Event]]]
    PARAMS_EXAMPLE: ClassVar[str] = "{}"  # what ``--params`` takes (shown in --help)
    STATE: ClassVar[type[Any]]
    FOLD: ClassVar[Callable[..., Any]]
    PARAMS: ClassVar[type[Any]]
    CONVERT: ClassVar[Callable[[dict[str, float]], Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "TRIGGERS" in cls.__dict__:
            cls.FOLLOWS = cls.TRIGGERS  # what it acts on
        if "CONFIGURED" in cls.__dict__:
            cls.REFUSES = frozenset({cls.CONFIGURED})  # the one command it checks and applies

    def __init__(self, params: P | None = None) -> None:
        default = params if params is not None else self.default_params()

        def lenient(values: dict[str, float]) -> P:
            try:
                return self.convert_params(values)
            except ValueError:
                return default

        self.params = RecordedParams(default, lenient)

    def default_params(self) -> P:
        return self.PARAMS()

    def convert_params(self, values: dict[str, float]) -> P:
        """Recorded values as parameters; ValueError (naming what is wrong) for ones it cannot apply."""
        return type(self).CONVERT(values)

    def initial_state(self) -> S:
        return self.STATE(retain_finished=False)

    def state_type(self) -> type[S]:
        return self.STATE

    def evolve(self, state: S, seq: int, event: ev.Event) -> S:
        return type(self).FOLD(state, seq, event, params_ok=self.applies(event))

    def params_for(self, state: S) -> P:
        """The parameters in force at ``state``."""
        return self.params.get(state.params)  # type: ignore[attr-defined]

    def applies(self, event: ev.Event) -> bool:
        """Whether ``event`` is a parameters command that is applied when folded."""
        return isinstance(event, self.CONFIGURED) and (
            event.unchecked or params_problem(event.params, self.convert_params) is None  # type: ignore[attr-defined]
        )

    def triggered(self, event: ev.Event) -> bool:
        """Whether ``decide`` acts on ``event``. (Any tick: logs of older versions had one tick type for
        every service, and it triggered this decider.)"""
        return type(event) in self.TRIGGERS or isinstance(event, ev.Tick)

    def refusal(self, event: ev.Event) -> list[ev.Event]:
        """The refusal of a parameters command it cannot apply ([] for anything else)."""
        if not isinstance(event, self.CONFIGURED) or event.unchecked:
            return []
        problem = params_problem(event.params, self.convert_params)  # type: ignore[attr-defined]
        return [] if problem is None else [refused(event, problem)]


def params_problem(params: dict[str, float], convert: Callable[[dict[str, float]], object]) -> str | None:
    """Why recorded parameters cannot be applied (None: they can)."""
    try:
        convert(params)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def refused(command: ev.Event, reason: str) -> ev.CommandRefused:
    """The decision that an operator command was not applied, and why."""
    return ev.CommandRefused(command=type(command).__name__, command_id=command.id, reason=reason)


MAX_BATCH_DECISIONS = 500  # decisions appended at once (one append, all or nothing, holds up to 1,000 events)


def decision_id(service: str, cause_seq: int, n: int) -> str:
    return f"{service}:{cause_seq}:{n}"


def cause_seq_of(event: ev.Event, service: str) -> int | None:
    """The cause sequence encoded in a decision id of ``service`` (None for other ids)."""
    prefix = service + ":"
    if not event.id.startswith(prefix):
        return None
    parts = event.id.split(":")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def stamp(service: str, drafts: Sequence[ev.Event], cause: Record, state: HasClock) -> list[ev.Event]:
    """Give drafts their deterministic id, time and provenance."""
    # (Every decision of every decider is stamped here: no dict of fields per draft.)
    replace = msgspec.structs.replace
    now, cause_seq, cause_id = state.now, cause.seq, cause.event.id
    out = []
    for n, draft in enumerate(drafts):
        id_ = decision_id(service, cause_seq, n)
        if isinstance(draft, ev.Decision):
            out.append(replace(draft, id=id_, at=now, source=service, based_on=state.seq, cause=cause_id))
        else:
            out.append(replace(draft, id=id_, at=now, source=service))
    return out


def decide_stamped(decider: Decider[S], state: S, cause: Record) -> list[ev.Event]:
    """What the decider decides on ``cause`` at ``state``, fully stamped (used live and by the audit)."""
    drafts = decider.decide(state, cause.event)
    return stamp(decider.name, drafts, cause, state) if drafts else []


def replay(decider: Decider[S], records: Sequence[Record], state: S | None = None) -> S:
    """The decider's state after folding ``records``."""
    state = state if state is not None else decider.initial_state()
    for record in records:
        state = decider.evolve(state, record.seq, record.event)
    return state


class CoreFoldDecider(Decider[ClusterState]):
    """A decider that needs no state beyond the core fold (nodes, GPUs, jobs): a small service is
    then its spec and one pure ``decide(state, event)`` function."""

    def __init__(
        self,
        name: str,
        decide: Callable[[ClusterState, ev.Event], list[ev.Event]],
        *,
        follows: frozenset[type[ev.Event]],
        emits: frozenset[type[ev.Event]],
        state_format: int = 1,
    ) -> None:
        self.name = name  # type: ignore[misc]
        self.FOLLOWS = follows  # type: ignore[misc]
        self.EMITS = emits  # type: ignore[misc]
        self.STATE_FORMAT = state_format  # type: ignore[misc]
        self._decide = decide

    def initial_state(self) -> ClusterState:
        return ClusterState(retain_finished=False)

    def state_type(self) -> type[ClusterState]:
        return ClusterState

    def evolve(self, state: ClusterState, seq: int, event: ev.Event) -> ClusterState:
        return apply(state, seq, event)

    def decide(self, state: ClusterState, event: ev.Event) -> list[ev.Event]:
        return self._decide(state, event)
