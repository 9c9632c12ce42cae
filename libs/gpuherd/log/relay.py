"""Report relay: the reports of many node agents stored together, with one disk sync.

Every node's agent appends its own reports (``JobStarted``, ``TaskEnded``, ...) under its node's
subjects. With the log's fsync on every acknowledged write, each one costs a disk sync, and each
agent has too few of them at a time to batch: 1,000 agents reporting once each cost 1,000 syncs. A
relay takes their reports as requests on ``herd.report.<node>``, stores the reports that arrived
while its last append was out in one commit, and answers each agent once its report is stored.

How a commit stores them:
- the reports every reader takes the first word of (``PAGED_REPORTS``: a task started, a task
  ended, the bulk of them) as one page (``gpuherd.log.pages``) on ``RELAYED_SUBJECT``: one message
  for the lot, which every reader then takes in as one, where a message per report cost the server
  and every reader a delivery each;
- any other report as its own message, on its own subject, deduplicated by its own id, exactly as
  its agent would have stored it (``JetStreamLog.append_each``: an atomic batch, one commit).

Nothing is lost through a relay, and nothing doubled changes anything:
- an agent that gets no answer (no relay runs, a relay died or is slow, the log is away) appends the
  report itself (``RelayClient.store`` returns False). Were it stored by the relay after all, a
  report of its own message is dropped by its id; a paged one is stored twice, and the second copy
  changes no state and makes no decision: each fold keeps the first word on a task (an elastic
  job keeps its attempt's reports by node and id, ``JobState.reports``: its part may leave a node
  and come back, and an old copy must not speak for the new part), and a decider passes over a
  report it followed lately (``DecisionCore``). ``tests/unit/test_report_twice.py`` runs whole
  simulations with every such report doubled, ``tests/unit/test_reconcile.py`` an elastic part
  that comes back;
- a relay stores for ``<node>`` only events on the subjects that node's agent may append to itself
  (``REPORT_SUBJECTS``), and NATS lets each agent ask only on its own node's subject: a relay does
  not widen what an agent may write. Only a relay may publish on ``RELAYED_SUBJECT``, and readers
  take from a page there only events on those subjects (of any node): an agent's own page holds
  its node's events alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.errors

from gpuherd import events as ev
from gpuherd.errors import UNDECODABLE, EventDecodeError
from gpuherd.log.streams import TRACEPARENT
from gpuherd.obs import get_logger

log = get_logger("gpuherd.relay")

REPORT_PREFIX = "herd.report"
RELAY_QUEUE = "relay"  # relays share the reports (a NATS queue group): any number may run
# The HERD subjects a node's agent may append to, ``{node}`` its node (as its NATS permissions say):
# all a relay stores for that node.
REPORT_SUBJECTS = ("herd.job.*.by.{node}", "herd.lease.*.by.{node}", "herd.node.{node}")
# Where a relay stores reports of many nodes as one page. (Under ``herd.job.>``, which the log's
# stream holds already; four tokens, which no other writer's permission covers.)
RELAYED_SUBJECT = "herd.job.relayed.reports"
# Reports that every reader takes the first word of (per job, attempt and node): a second copy,
# stored when a relay paged one and its answer was lost, changes nothing. A relay pages these.
PAGED_REPORTS: frozenset[type[ev.Event]] = frozenset({ev.JobStarted, ev.TaskEnded})
# How long an agent waits for a relay's answer before it appends the report itself: a relay stores
# within milliseconds unless the log is away, when the agent's own append waits as long anyway.
ANSWER_TIMEOUT_S = 2.0
# After a relay failed it (none running, no answer), an agent appends itself this long before it
# asks a relay again: one missing relay costs each report a round trip only once in a while.
REST_S = 10.0


class RelayAnswer(msgspec.Struct, frozen=True, omit_defaults=True):
    """A relay's answer to one report: stored (at ``position``), or refused with the reason."""

    ok: bool
    position: int = 0
    error: str = ""


_ANSWER = msgspec.json.Decoder(RelayAnswer)
_ENCODE_ANSWER = msgspec.json.Encoder()


def encode_answer(answer: RelayAnswer) -> bytes:
    return _ENCODE_ANSWER.encode(answer)


_FREE_OF = frozenset(" \t\r\n*>")  # what no token of a stored subject holds


def report_subject(node: str) -> str:
    return f"{REPORT_PREFIX}.{node}"


def subjects_of(node: str) -> tuple[str, ...]:
    """The HERD subjects (patterns) whose events a relay stores for ``node``'s agent."""
    return tuple(pattern.format(node=node) for pattern in REPORT_SUBJECTS)


def matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` is one of NATS subject ``pattern``'s (``*``: any one token, ``>``: the rest)."""
    return _matches(pattern.split("."), subject.split("."))


def _matches(want: list[str], have: list[str]) -> bool:
    """``matches``, on subjects split into tokens."""
    if len(want) != len(have) and ">" not in want:
        return False
    for n, token in enumerate(want):
        if token == ">":
            return len(have) > n
        if n >= len(have) or (token != "*" and token != have[n]):
            return False
    return len(want) == len(have)


_ANY_NODE = [pattern.split(".") for pattern in subjects_of("*")]  # (split once: see ``relayed``)


def relayed(subject: str) -> bool:
    """Whether an event on ``subject`` may travel in a page a relay stored (``RELAYED_SUBJECT``):
    a report subject of any node. (Asked of every event of such a page by every reader.)"""
    have = subject.split(".")
    return any(_matches(want, have) for want in _ANY_NODE)


def check_report(node: str, data: bytes) -> tuple[ev.Event | None, str]:
    """The event a report on ``herd.report.<node>`` carries, or None and why a relay refuses it. (A
    relay stores the bytes it got, as their agent wrote them: the event is decoded to check it.)"""
    try:
        event = ev.decode(data)
    except (EventDecodeError, *UNDECODABLE) as exc:
        return None, str(exc)
    except Exception as exc:  # (an upcaster failing on a field it needs)
        return None, f"not a readable event: {type(exc).__name__}: {exc}"
    if not event.id:
        return None, f"{type(event).__name__} has no id: a report is stored once by its id"
    subject = event.subject()
    if not all(token and _FREE_OF.isdisjoint(token) for token in subject.split(".")):
        return None, f"{type(event).__name__} goes to {subject!r}, which is no NATS subject"
    if not any(matches(pattern, subject) for pattern in subjects_of(node)):
        return None, f"{type(event).__name__} goes to {subject}, which the agent of {node} may not write"
    return event, ""


class RelayClient:
    """An agent's side of the relay: ``store`` a report through a relay, or be told to append it."""

    def __init__(
        self,
        nc: Any,
        node: str,
        *,
        timeout_s: float = ANSWER_TIMEOUT_S,
        rest_s: float = REST_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.subject = report_subject(node)
        self.timeout_s = timeout_s
        self.rest_s = rest_s
        self.clock = clock
        self._resting_until = 0.0
        self.stored = 0  # reports a relay stored
        self.fell_back = 0  # reports the agent was told to append itself

    async def store(self, event: ev.Event, trace: str | None = None) -> bool:
        """True once a relay has stored ``event``; False: no relay did, append it yourself (a copy
        a relay stores later is dropped by its id, or, in a relay's page, folded as nothing new)."""
        if self.clock() < self._resting_until:
            self.fell_back += 1
            return False
        headers = {TRACEPARENT: trace} if trace else None
        try:
            msg = await self.nc.request(self.subject, ev.encode(event), timeout=self.timeout_s, headers=headers)
            answer = _ANSWER.decode(msg.data)
        except (nats.errors.Error, TimeoutError, *UNDECODABLE) as exc:
            if not isinstance(exc, nats.errors.NoRespondersError):
                log.warning("no answer from a report relay; appending directly", subject=self.subject, error=repr(exc))
            self._resting_until = self.clock() + self.rest_s
            self.fell_back += 1
            return False
        if not answer.ok:
            log.warning("a report relay refused a report; appending directly", report=event.id, error=answer.error)
            self.fell_back += 1
            return False
        self.stored += 1
        return True
