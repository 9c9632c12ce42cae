"""The scheduler's I/O beside the generic decider shell (``spec.py`` wires it in).

Its loops share one ``DeciderRunner`` and run only while this instance leads the scheduler:
- the runner (folds the log, decides, appends);
- intake: raw submissions from HERD_INTAKE are handed to the runner, which decides them in turn
  with the log's events (``MAX_HANDED`` at most not yet answered, so the log's events never wait
  behind many); once a verdict is stored, the submitter gets its reply and the message is
  acknowledged (a message whose handling fails ``MAX_DELIVERIES`` times becomes a dead letter, and
  is acknowledged only once that is stored; while a verdict or a dead letter is on its way, its
  message is kept from being delivered again, and a delivery that came anyway is skipped and not
  counted: a slow log is no failure of the submission);
- the timer: a ``ClockTicked`` every ``--tick`` seconds (time-based decisions: fair-share decay,
  starvation, reservations), when a running job reaches its time limit (the decider stops it), and
  at once when a node's heartbeats stop, so the decider can declare it lost;
- at start, ``--policy`` recorded as ``PolicyConfigured`` (when the log differs, or records older
  scheduling rules).
It also answers ``herd.ctl.scheduler.ready`` once intake listens, and ``herd.ctl.scheduler.job``
(whether it knows a job: the client's quick check before a cancel, the log's pages hide a job's
subject from the server's index).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from gpuherd import events as ev
from gpuherd.aio import patiently
from gpuherd.log import (
    HERD_INTAKE,
    INTAKE_PREFIX,
    MAX_DELIVERIES,
    TRACEPARENT,
    DeadLetter,
    Delivery,
    DurableConsumer,
    reply_inboxes,
)
from gpuherd.obs import get_logger
from gpuherd.runtime.core import Decided
from gpuherd.runtime.deadletters import keep_dead_letter
from gpuherd.runtime.runner import DeciderRunner, ExtraTask
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission
from services.scheduler.state import SchedulerState, gpu_seconds_by_user

log = get_logger("gpuherd.scheduler")

INTAKE_CONSUMER = "scheduler-intake"  # its durable consumer of HERD_INTAKE
# Submissions handed to the runner and not answered yet, at most (fetched as room frees; decided
# together where their intake ids differ). The runner decides its inputs in order, so each one
# waiting there is one that the log's events (a task's end, a node's report) wait behind; more stay
# stored in the intake stream until some are answered.
MAX_HANDED = 64


def submission_of(delivery: Delivery) -> Submission:
    return Submission(
        source=delivery.subject[len(INTAKE_PREFIX) + 1 :],
        seq=delivery.seq,
        data=delivery.data,
        at=delivery.at,
        msg_id=delivery.headers.get("Nats-Msg-Id"),
        delivery=delivery,
        trace=delivery.headers.get(TRACEPARENT),
    )


@dataclass(frozen=True, slots=True)
class Handed:
    """An intake message being handled: handed to the runner, or given up on, and its verdict (or
    its dead letter) not stored yet."""

    delivery: Delivery
    attempt: int  # which of its deliveries that were handled this is (see ``Intake.attempt``)


class Intake:
    """Feeds intake messages to the runner and answers them once their verdicts are stored."""

    def __init__(
        self,
        runner: DeciderRunner[SchedulerState],
        *,
        ack_wait_s: float = 10.0,
        dead_letter_patience_s: float = 3600.0,
    ) -> None:
        self.runner = runner
        self.ack_wait_s = ack_wait_s  # unacknowledged this long, a message is delivered again
        self.dead_letter_patience_s = dead_letter_patience_s  # one try at storing a dead letter, at most
        self.consumer: DurableConsumer | None = None  # None while intake does not listen
        self._giving_up: set[asyncio.Task[None]] = set()  # dead letters being stored
        self._in_flight: dict[int, Handed] = {}  # by intake sequence
        # Deliveries of a message that came while it was in flight, by intake sequence: they handled
        # nothing, so they do not count towards MAX_DELIVERIES.
        self._skipped: collections.Counter[int] = collections.Counter()
        self._room = asyncio.Event()  # set while fewer than MAX_HANDED submissions are handed
        self._room.set()

    def attempt(self, delivery: Delivery) -> int:
        """How many deliveries of this message were handled (handed to the runner, or given up on),
        this one included: the server counts the ones skipped while a verdict was on its way too,
        and a log slower than ``ack_wait`` must not make a valid submission a dead letter."""
        return delivery.deliveries - self._skipped[delivery.seq]

    async def loop(self, runner: DeciderRunner[SchedulerState]) -> None:
        # A new leadership's runner holds nothing the last one was handed: its redeliveries are new.
        self._in_flight.clear()
        self._skipped.clear()
        self._room.set()
        await runner.caught_up.wait()
        consumer = self.consumer = runner.log.intake_consumer(INTAKE_CONSUMER, ack_wait=self.ack_wait_s)
        # The intake stream may be electing its leader, or NATS failing over: wait for it.
        await patiently(consumer.open, what="intake consumer", patience_s=300)
        # Intake listens from here on: a plain NATS request sent from now gets its reply.
        stop_ready = await runner.log.serve_requests("scheduler.ready", self._ready)
        stop_job = await runner.log.serve_requests("scheduler.job", self._job)
        in_progress = asyncio.create_task(self._keep_in_progress(consumer))
        try:
            while True:
                await self._room.wait()
                for delivery in await consumer.fetch(max(1, MAX_HANDED - self._handed()), timeout=1.0):
                    if delivery.seq in self._in_flight:
                        # Redelivered while its verdict is on its way (answered once stored): not a
                        # failure, so not counted; and the server is told it is still being handled.
                        self._skipped[delivery.seq] += 1
                        await consumer.in_progress(delivery)
                        continue
                    attempt = self.attempt(delivery)
                    if attempt > MAX_DELIVERIES:  # (handling it crashed the service each time)
                        self.give_up(delivery, attempt, "the scheduler stopped while handling it each time")
                        continue
                    self._in_flight[delivery.seq] = Handed(delivery, attempt)
                    runner.offer(submission_of(delivery))
                self._check_room()
        finally:
            # What is being handled stays unacknowledged: delivered again, to whoever leads next.
            self.consumer = None
            for task in [in_progress, *self._giving_up]:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(Exception):
                await stop_ready()
            with contextlib.suppress(Exception):
                await stop_job()
            await consumer.close()

    def _handed(self) -> int:
        """Submissions handed to the runner and not answered (dead letters on their way are not)."""
        return len(self._in_flight) - len(self._giving_up)

    def _check_room(self) -> None:
        if self._handed() < MAX_HANDED:
            self._room.set()
        else:
            self._room.clear()

    async def _keep_in_progress(self, consumer: DurableConsumer) -> None:
        """Tell the server, well within ``ack_wait``, that the messages whose verdicts are on their
        way are still being handled: while the log is slow or away, they are not delivered again
        (each delivery counts in the server's ``deliveries``, which outlive a restart of ours)."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            for handed in list(self._in_flight.values()):
                await consumer.in_progress(handed.delivery)

    async def answer(self, decided: Decided) -> None:
        """The verdict is stored (or was, for a duplicate): reply to the submitter, then acknowledge."""
        sub: Submission = decided.cause
        delivery: Delivery = sub.delivery
        self._in_flight.pop(sub.seq, None)
        self._skipped.pop(sub.seq, None)
        self._check_room()
        accepted = bool(decided.outputs) and isinstance(decided.outputs[0], ev.JobSubmitted)
        duplicate = not decided.outputs
        self.runner.metrics.intake.labels("accepted" if accepted or duplicate else "rejected").inc()
        if delivery is not None and decided.answer is not None:
            for inbox in reply_inboxes(delivery.headers):  # (retries of one Nats-Msg-Id: each hears it)
                with contextlib.suppress(Exception):
                    await self.runner.log.reply(inbox, decided.answer.reply)
        if self.consumer is not None and delivery is not None:
            await self.consumer.ack(delivery)
        if decided.outputs and isinstance(decided.outputs[0], ev.JobRejected):
            log.info("submission rejected", source=sub.source, reason=decided.outputs[0].reason)

    async def refused(self, decided: Decided, error: Exception) -> None:
        """The log refused the verdict: the message stays unacknowledged and comes back, until its
        last delivery, when it becomes a dead letter (its submitter is told why)."""
        sub: Submission = decided.cause
        handed = self._in_flight.pop(sub.seq, None)
        self._check_room()
        attempt = handed.attempt if handed is not None else self.attempt(sub.delivery)
        log.error("verdict not stored", intake_seq=sub.seq, deliveries=attempt, error=str(error))
        if attempt >= MAX_DELIVERIES:
            self.give_up(sub.delivery, attempt, f"{type(error).__name__}: {error}")

    def give_up(self, delivery: Delivery, attempts: int, why: str) -> None:
        """A submission handled ``attempts`` (``MAX_DELIVERIES``) times without an answer: keep it as a
        dead letter, so it neither retries forever nor vanishes. That is done beside intake and the
        runner, which go on meanwhile (the dead letters' stream may be away for long); the message
        is in flight until then, as one whose verdict is on its way."""
        if self.consumer is None:
            return  # intake stopped: left unacknowledged, it comes back to whoever leads next
        self._in_flight[delivery.seq] = Handed(delivery, attempts)
        task = asyncio.create_task(self._keep_dead_letter(delivery, attempts, why))
        self._giving_up.add(task)
        task.add_done_callback(self._giving_up.discard)

    async def _keep_dead_letter(self, delivery: Delivery, attempts: int, why: str) -> None:
        """Store the dead letter, then tell the submitter why and acknowledge the message."""
        reason = f"could not be handled after {attempts} deliveries: {why}"
        letter = DeadLetter(
            stream=HERD_INTAKE,
            seq=delivery.seq,
            subject=delivery.subject,
            consumer="scheduler",
            reason=reason,
            deliveries=attempts,
            at=time.time(),
            data=delivery.data,
        )
        try:
            stored = await keep_dead_letter(self.runner.log, letter, give_up_after=self.dead_letter_patience_s)
        finally:
            self._in_flight.pop(delivery.seq, None)
        if not stored:
            # Acknowledged now, bad input would be kept nowhere but the intake stream (until its
            # max_age) and the error log. Left unacknowledged, it comes back after ack_wait and is
            # given up on again, until the dead letters' stream takes it; its submitter hears then.
            log.error("dead letter not stored; the intake message is left for redelivery", intake_seq=delivery.seq)
            return
        self._skipped.pop(delivery.seq, None)
        self.runner.metrics.dead_letters.inc()
        for inbox in reply_inboxes(delivery.headers):
            with contextlib.suppress(Exception):
                await self.runner.log.reply(inbox, msgspec.json.encode({"ok": False, "error": reason}))
        if self.consumer is not None:
            await self.consumer.ack(delivery)
        log.error("intake message kept as a dead letter", intake_seq=delivery.seq, reason=reason)

    async def _job(self, data: bytes) -> bytes:
        """``herd.ctl.scheduler.job``: the job named in the request, as the leading scheduler knows it
        (see ``job_status``)."""
        return msgspec.json.encode(job_status(self.runner.state, data.decode(errors="replace")))

    async def _ready(self, data: bytes) -> bytes:
        """``herd.ctl.scheduler.ready``: answered by the leading scheduler once intake is live."""
        state = self.runner.state
        return msgspec.json.encode(
            {
                "ok": True,
                "instance": self.runner.instance,
                "seq": state.seq,
                "nodes": len(state.nodes),
                "queue": len(state.queue),
            }
        )


def job_status(state: SchedulerState, job_id: str) -> dict[str, Any]:
    """A job as the scheduler knows it, for systems that follow their jobs over NATS (a job's events
    are not all on its own subject: pages hold several jobs' events). ``known`` false means only that
    the scheduler does not know it (never submitted, or ended long enough ago to be forgotten); an
    ended job it remembers has its outcome as ``status`` and ``finished_at``."""
    job = state.jobs.get(job_id)
    if job is not None:
        return {
            "ok": True,
            "known": True,
            "job": job_id,
            "status": job.status,
            "attempt": job.attempt,
            "vc": job.spec.vc,
            "gpus": job.spec.gpus,
            "submitted_at": job.submitted_at,
            "placed_at": job.placed_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "nodes": sorted({a.node for a in job.allocations}),
            "reason": job.reason,
        }
    ended = state.outcomes.get(job_id)
    if ended is not None:
        return {"ok": True, "known": True, "job": job_id, "status": ended.outcome, "finished_at": ended.at}
    return {"ok": True, "known": False, "job": job_id}


def timer(lost_after_s: float, tick_s: float) -> ExtraTask:
    """The scheduler's timer. It listens to heartbeats and records a ``ClockTicked`` with what it heard
    every ``tick_s`` (a pass for time-based decisions), and at once when a node looks silent for longer
    than ``lost_after_s`` (the decider then declares it lost)."""

    async def ticking(runner: DeciderRunner[SchedulerState]) -> None:
        await runner.caught_up.wait()
        started = time.time()
        last_seen: dict[str, float] = {}
        ticked: dict[str, int] = {}  # node -> registration seq a tick was written for
        last_tick = time.monotonic()
        ticked_deadline: float | None = None  # the time limit a tick was written for

        async def watch() -> None:
            # Closed when the task is cancelled, while the connection is up (its consumer is deleted
            # then): left to the interpreter's shutdown, it held the process's exit for seconds.
            async with contextlib.aclosing(runner.log.telemetry("*.heartbeat")) as beats:
                async for beat in beats:
                    last_seen[beat.subject.split(".")[2]] = time.time()

        watcher = asyncio.create_task(watch())
        try:
            while True:
                deadline = next_deadline(runner.state)
                until_deadline = 1.0 if deadline is None else max(0.02, deadline - time.time())
                await asyncio.sleep(min(1.0, lost_after_s / 4, tick_s, until_deadline))
                now = time.time()
                deadline = next_deadline(runner.state)
                limit_due = deadline is not None and deadline <= now and deadline != ticked_deadline
                # Our own outage is no evidence against a node: count silence from our reconnect.
                floor = max(started, runner.log.connected_since())
                heard = {
                    name: max(last_seen.get(name, floor), floor, node.registered_at)
                    for name, node in runner.state.nodes.items()
                    if node.status != "lost"
                }
                overdue = [n for n, t in heard.items() if now - t > lost_after_s and ticked.get(n) != _reg(runner, n)]
                due = time.monotonic() - last_tick >= tick_s
                if not overdue and not due and not limit_due:
                    continue
                tick = ev.ClockTicked(
                    id=f"scheduler:tick:{uuid.uuid4().hex}",
                    at=now,
                    source="scheduler",
                    last_heard=heard,
                    lost_after_s=lost_after_s,
                )
                if overdue:
                    log.warning("nodes silent", nodes=overdue, lost_after_s=lost_after_s)
                await runner.append_input([tick])  # fenced: a former leader's stale tick is refused
                last_tick = time.monotonic()
                if limit_due:
                    ticked_deadline = deadline
                for name in overdue:
                    ticked[name] = _reg(runner, name)
        finally:
            watcher.cancel()

    return ticking


def _reg(runner: DeciderRunner[SchedulerState], node: str) -> int:
    state = runner.state.nodes.get(node)
    return state.registered_seq if state is not None else 0


def policy_recorder(policy: str | None) -> ExtraTask:
    """Record ``--policy`` in the log once caught up, unless the log already has it: the log, not
    a flag, is what every decision (and every replay) reads. A log whose policy was recorded under
    older scheduling rules gets the policy in force again with this scheduler's rules, so each pass
    is re-derived by the rules it was made by."""

    async def record(runner: DeciderRunner[SchedulerState]) -> None:
        await runner.caught_up.wait()
        config = runner.state.scheduling
        if (policy is None or config.policy == policy) and config.rules == ev.SCHEDULING_RULES:
            return
        decider: SchedulerDecider = runner.decider  # type: ignore[assignment]
        in_force = decider.policy_for(runner.state)
        new = ev.PolicyConfigured(
            id=f"scheduler:policy:{uuid.uuid4().hex}",
            at=time.time(),
            source="scheduler",
            policy=policy or in_force.name,
        )
        if policy in (None, config.policy):  # the same policy under this scheduler's rules
            new = msgspec.structs.replace(new, backfill=config.backfill, params=dict(config.params))
        await runner.append_input([new])
        log.info("policy recorded", policy=new.policy, rules=new.rules)

    return record


def setup(
    runner: DeciderRunner[SchedulerState], *, ack_wait_s: float = 10.0, dead_letter_patience_s: float = 3600.0
) -> None:
    """Give a scheduler's runner its intake and its cluster metrics."""
    intake = Intake(runner, ack_wait_s=ack_wait_s, dead_letter_patience_s=dead_letter_patience_s)
    runner.on_external = intake.answer
    runner.on_refused = intake.refused
    runner.extra_tasks.append(intake.loop)
    runner.metrics.watch_cluster(lambda: runner.state)
    runner.metrics.watch_usage(lambda: gpu_seconds_by_user(runner.state))


def next_deadline(state: SchedulerState) -> float | None:
    """When the timer must tick for a time limit: the earliest one a running job reaches."""
    return state.next_deadline()


def jobs_wait(state: SchedulerState) -> bool:
    """Whether the timer's pass can decide anything: only while jobs wait that may still start (a
    job whose dependency can never be met waits until cancelled, and a tick changes nothing for it;
    a tick's other work, declaring silent nodes lost, is the live timer's, which always ticks)."""
    return len(state.queue) > len(state.stuck)
