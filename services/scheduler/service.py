"""The scheduler service shell: all of the scheduler's I/O lives here.

Three loops share one folded state, and run only while this instance holds
the scheduler's lease:
- the decider runner (placement decisions),
- intake: raw submissions -> JobSubmitted/JobRejected, then the reply,
- liveness: the timer that records ``ClockTicked`` when a node's heartbeats stop;
- at start, ``--policy`` recorded as ``PolicyConfigured`` (when the log differs).
It also answers ``herd.ctl.scheduler.ready`` once intake listens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import time
import uuid

import msgspec

from gpuherd import events as ev
from gpuherd.aio import patiently
from gpuherd.decider import (
    DeciderRunner,
    ExtraTask,
    add_metrics_argument,
    append_reliably,
    keep_dead_letter,
)
from gpuherd.errors import ConcurrencyError
from gpuherd.log import Delivery, DurableConsumer, EventLog, open_log
from gpuherd.log.base import HERD_INTAKE, INTAKE_PREFIX, MAX_DELIVERIES, REPLY_HEADER, DeadLetter
from gpuherd.metrics import serve_until_signal_with_http
from gpuherd.obs import configure, current_traceparent, get_logger, span_from
from gpuherd.state import ClusterState
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import NodeSizes, Submission, Verdict, judge, node_sizes, rejection
from services.scheduler.policy import make_policy

log = get_logger("gpuherd.scheduler")

INTAKE_CONSUMER = "scheduler-intake"


async def handle_submission(
    log_: EventLog,
    state: ClusterState,
    delivery: Delivery,
    *,
    service: str = "scheduler",
    sizes: NodeSizes | None = None,
) -> Verdict:
    """Judge one intake message, record the verdict in HERD, reply, and only then acknowledge."""
    source = delivery.subject[len(INTAKE_PREFIX) + 1 :]
    with span_from(delivery.headers.get("traceparent"), "scheduler.intake", source=source, intake_seq=delivery.seq):
        submission = Submission(
            source=source,
            seq=delivery.seq,
            data=delivery.data,
            at=delivery.at,
            msg_id=delivery.headers.get("Nats-Msg-Id"),
        )
        try:
            verdict = judge(state, submission, service=service, sizes=sizes)
        except Exception as exc:  # a bug must not turn one submission into a crash loop
            log.exception("could not judge a submission; recording it as rejected", intake_seq=delivery.seq)
            reason = f"the scheduler failed to judge this submission ({type(exc).__name__}: {exc}); please report it"
            verdict = rejection(state, submission, reason, service=service)
        trace = current_traceparent()
        if not verdict.duplicate:
            expect = {verdict.event.subject(): 0} if isinstance(verdict.event, ev.JobSubmitted) else None
            try:
                result = await append_reliably(log_, [verdict.event], expect=expect, trace=trace)
                if result.duplicate and isinstance(verdict.event, ev.JobSubmitted):
                    verdict = Verdict(verdict.event, job_id=verdict.job_id, duplicate=True)
            except ConcurrencyError:
                # The job's subject already has events: an earlier submission with this intake id.
                verdict = Verdict(verdict.event, job_id=verdict.job_id, duplicate=True)
        reply_to = delivery.headers.get(REPLY_HEADER)
        if reply_to:
            with contextlib.suppress(Exception):
                await log_.reply(reply_to, verdict.reply())
        if isinstance(verdict.event, ev.JobRejected):
            log.info("submission rejected", source=source, reason=verdict.event.reason)
        else:
            log.info("job submitted", job=verdict.job_id, source=source, duplicate=verdict.duplicate)
    return verdict


async def intake_loop(runner: DeciderRunner[ClusterState]) -> None:
    await runner.caught_up.wait()
    consumer = runner.log.intake_consumer(INTAKE_CONSUMER)
    # The intake stream may be electing its leader, or NATS failing over: wait for it.
    await patiently(consumer.open, what="intake consumer", patience_s=300)
    # Intake listens from here on: a plain NATS request sent from now gets its reply.
    stop_ready = await runner.log.serve_requests("scheduler.ready", _ready(runner))
    try:
        while True:
            deliveries = await consumer.fetch(512, timeout=1.0)
            sizes = node_sizes(runner.state)  # once per batch, not per submission

            # A fetched batch is judged and recorded concurrently (each job has a subject of its own).
            # The appends are pipelined on one connection, so they reach the log in about fetch order;
            # submissions that arrived within one fetch carry no order a user could rely on anyway.
            await asyncio.gather(*(handle_delivery(runner, consumer, d, sizes) for d in deliveries))
    finally:
        with contextlib.suppress(Exception):
            await stop_ready()


async def handle_delivery(
    runner: DeciderRunner[ClusterState], consumer: DurableConsumer, delivery: Delivery, sizes: NodeSizes
) -> None:
    """Handle one intake message and acknowledge it. A failure leaves it unacknowledged, so it comes
    back; after ``MAX_DELIVERIES`` it goes to the dead letters instead of blocking or retrying forever."""
    try:
        verdict = await handle_submission(runner.log, runner.state, delivery, sizes=sizes)
    except Exception as exc:
        log.exception("intake message not handled", intake_seq=delivery.seq, deliveries=delivery.deliveries)
        if delivery.deliveries >= MAX_DELIVERIES:
            await give_up(runner, consumer, delivery, f"{type(exc).__name__}: {exc}")
        return
    runner.metrics.intake.labels("rejected" if isinstance(verdict.event, ev.JobRejected) else "accepted").inc()
    await consumer.ack(delivery)


async def give_up(runner: DeciderRunner[ClusterState], consumer: DurableConsumer, delivery: Delivery, why: str) -> None:
    """A submission whose handling failed ``MAX_DELIVERIES`` times: keep it as a dead letter, tell the
    submitter why, and acknowledge it, so it neither retries forever nor vanishes."""
    reason = f"could not be handled after {delivery.deliveries} deliveries: {why}"
    letter = DeadLetter(
        stream=HERD_INTAKE,
        seq=delivery.seq,
        subject=delivery.subject,
        consumer="scheduler",
        reason=reason,
        deliveries=delivery.deliveries,
        at=time.time(),
        data=delivery.data,
    )
    await keep_dead_letter(runner.log, letter)
    runner.metrics.dead_letters.inc()
    reply_to = delivery.headers.get(REPLY_HEADER)
    if reply_to:
        with contextlib.suppress(Exception):
            await runner.log.reply(reply_to, msgspec.json.encode({"ok": False, "error": reason}))
    await consumer.ack(delivery)
    log.error("intake message kept as a dead letter", intake_seq=delivery.seq, reason=reason)


def _ready(runner: DeciderRunner[ClusterState]):
    """``herd.ctl.scheduler.ready``: answered by the leading scheduler once intake is live."""

    async def answer(data: bytes) -> bytes:
        state = runner.state
        return msgspec.json.encode(
            {
                "ok": True,
                "instance": runner.instance,
                "seq": state.seq,
                "nodes": len(state.nodes),
                "queue": len(state.queue),
            }
        )

    return answer


def liveness_loop(lost_after_s: float) -> ExtraTask:
    """The scheduler's timer. It listens to heartbeats, and when a node looks silent for longer
    than ``lost_after_s`` it records a ``ClockTicked`` with what it heard; the decider then
    declares the node lost. The timer writes nothing while all nodes are heard from."""

    async def liveness(runner: DeciderRunner[ClusterState]) -> None:
        await runner.caught_up.wait()
        started = time.time()
        last_seen: dict[str, float] = {}
        ticked: dict[str, int] = {}  # node -> registration seq a tick was written for

        async def watch() -> None:
            async for beat in runner.log.telemetry("*.heartbeat"):
                last_seen[beat.subject.split(".")[2]] = time.time()

        watcher = asyncio.create_task(watch())
        try:
            while True:
                await asyncio.sleep(min(1.0, lost_after_s / 4))
                now = time.time()
                # Our own outage is no evidence against a node: count silence from our reconnect.
                floor = max(started, runner.log.connected_since())
                heard = {
                    name: max(last_seen.get(name, floor), floor, node.registered_at)
                    for name, node in runner.state.nodes.items()
                    if node.status != "lost"
                }
                overdue = [n for n, t in heard.items() if now - t > lost_after_s and ticked.get(n) != _reg(runner, n)]
                if not overdue:
                    continue
                tick = ev.ClockTicked(
                    id=f"scheduler:tick:{uuid.uuid4().hex}",
                    at=now,
                    source="scheduler",
                    last_heard=heard,
                    lost_after_s=lost_after_s,
                )
                log.warning("nodes silent", nodes=overdue, lost_after_s=lost_after_s)
                await append_reliably(runner.log, [tick])
                for name in overdue:
                    ticked[name] = _reg(runner, name)
        finally:
            watcher.cancel()

    return liveness


def _reg(runner: DeciderRunner[ClusterState], node: str) -> int:
    state = runner.state.nodes.get(node)
    return state.registered_seq if state is not None else 0


def policy_recorder(policy: str) -> ExtraTask:
    """Record ``--policy`` in the log once caught up, unless the log already has it: the log, not
    a flag, is what every decision (and every replay) reads."""

    async def record(runner: DeciderRunner[ClusterState]) -> None:
        await runner.caught_up.wait()
        if runner.state.scheduling.policy == policy:
            return
        config = ev.PolicyConfigured(
            id=f"scheduler:policy:{uuid.uuid4().hex}", at=time.time(), source="scheduler", policy=policy
        )
        await append_reliably(runner.log, [config])
        log.info("policy recorded", policy=policy)

    return record


async def serve(
    url: str,
    *,
    policy: str | None = None,
    lost_after_s: float = 10.0,
    instance: str | None = None,
    metrics_port: int | None = None,
) -> None:
    if policy is not None:
        make_policy(policy)  # fail at start on a name that does not exist
    instance = instance or f"{socket.gethostname()}-{os.getpid()}"
    log_ = await open_log(url, name=f"scheduler-{instance}")
    extra = [intake_loop, liveness_loop(lost_after_s)] + ([policy_recorder(policy)] if policy else [])
    runner = DeciderRunner(log_, SchedulerDecider(), instance=instance, extra_tasks=extra)
    runner.metrics.watch_cluster(lambda: runner.state)
    try:
        await serve_until_signal_with_http(runner, metrics_port)
    finally:
        await log_.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuherd-scheduler", description="gpuherd scheduler service")
    parser.add_argument("--nats-url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument(
        "--policy",
        default=os.environ.get("GPUHERD_POLICY"),
        help="record this policy in the log at start (default: keep the log's, else fifo)",
    )
    parser.add_argument(
        "--lost-after", type=float, default=10.0, help="seconds without heartbeat before a node is lost"
    )
    parser.add_argument("--instance", default=None, help="instance id for the leader lease")
    add_metrics_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure("scheduler")
    asyncio.run(
        serve(
            args.nats_url,
            policy=args.policy,
            lost_after_s=args.lost_after,
            instance=args.instance,
            metrics_port=args.metrics_port,
        )
    )
