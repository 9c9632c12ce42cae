"""The decider runner on the in-memory log.

The log's duplicate window is 0 here, so a decision made twice would be
stored twice: these tests see the runner's own guarantees, not dedupe's.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec
import pytest

from gpuherd import events as ev
from gpuherd.errors import LeadershipLost
from gpuherd.fold.invariants import violations
from gpuherd.log import SNAPSHOT_BUCKET, InProcessLog
from gpuherd.runtime.audit import audit
from gpuherd.runtime.decider import cause_seq_of
from gpuherd.runtime.runner import DeciderRunner
from gpuherd.runtime.snapshots import load_snapshot
from services.scheduler.decide import SchedulerDecider
from tests.helpers import ended, finish, node, submit, until


def placements(log: InProcessLog) -> list[ev.JobPlaced]:
    return [r.event for r in log._records if isinstance(r.event, ev.JobPlaced)]


async def start(log: InProcessLog, instance: str = "a", **kw) -> tuple[DeciderRunner, asyncio.Event, asyncio.Task]:
    runner = DeciderRunner(log, SchedulerDecider(), instance=instance, **kw)
    stop = asyncio.Event()
    return runner, stop, asyncio.create_task(runner.run(stop))


async def test_runner_places_and_records_provenance() -> None:
    log = InProcessLog(duplicate_window=0)
    _, stop, task = await start(log)
    await log.append([node("n1", 2)])
    await log.append([submit("a", 2)])
    await log.append([submit("b", 1)])
    await until(lambda: len(placements(log)) == 1)
    await log.append([finish("a")])
    await until(lambda: len(placements(log)) == 2)
    a, b = placements(log)
    by_id = {r.event.id: r.seq for r in log._records}
    for placed in (a, b):
        cause_seq = by_id[placed.cause]
        assert placed.id == f"scheduler:{cause_seq}:0", "ids derive from the cause's sequence"
        assert cause_seq <= placed.based_on < by_id[placed.id], "decided on a state at or after its cause"
    assert a.job == "a" and a.based_on >= by_id["test:intake:a"]
    assert b.job == "b" and b.based_on >= by_id["fin-a-0"], "b could only start once a had finished"
    stop.set()
    await task


async def test_restart_from_snapshot_decides_nothing_twice() -> None:
    log = InProcessLog(duplicate_window=0)
    _, stop, task = await start(log, snapshot_every=1)
    await log.append([node("n1", 4)])
    for j in "abcd":
        await log.append([submit(j, 2)])
    await until(lambda: len(placements(log)) == 2)
    stop.set()
    await task
    await log.append([finish("a")])  # arrives while no scheduler runs
    runner2, stop2, task2 = await start(log, instance="b")
    await until(lambda: len(placements(log)) == 3)
    await asyncio.sleep(0.2)
    assert runner2.state.seq == await log.last_seq()
    stop2.set()
    await task2
    assert [p.job for p in placements(log)] == ["a", "b", "c"]
    assert violations(log._records) == []


class CrashAfterAppend(InProcessLog):
    """Appends succeed, then the process 'dies' before it sees its own output."""

    def __init__(self, crash_on: int) -> None:
        super().__init__(duplicate_window=0)
        self.crash_on = crash_on
        self.appends = 0

    async def append(self, events, **kw):
        result = await super().append(events, **kw)
        if events and cause_seq_of(events[0], "scheduler") is not None:
            self.appends += 1
            if self.appends == self.crash_on:
                raise asyncio.CancelledError  # the task dies here, like a SIGKILL right after the write
        return result


async def test_crash_right_after_append_then_restart_adds_no_duplicate() -> None:
    # Decision appends in this history: (1) place a and b, (2) after a finishes, place c.
    for crash_on in (1, 2):
        log = CrashAfterAppend(crash_on)
        await log.append([node("n1", 2), node("n2", 2)])
        await log.append([submit("a", 2)])
        await log.append([submit("b", 2)])
        await log.append([submit("c", 2)])
        _, _, task = await start(log)
        await until(lambda log=log: len(placements(log)) == 2)
        await log.append([finish("a")])
        await until(task.done, timeout=2)
        log._leaderships.clear()  # a killed process's leadership expires; skip the wait
        log.crash_on = 0
        _, stop2, task2 = await start(log, instance="b")
        await until(lambda log=log: len(placements(log)) == 3)
        await asyncio.sleep(0.1)
        stop2.set()
        await task2
        ids = Counter(r.event.id for r in log._records)
        assert max(ids.values()) == 1, f"duplicate events after crash #{crash_on}: {ids.most_common(2)}"
        assert [p.job for p in placements(log)] == ["a", "b", "c"]
        assert violations(log._records) == []


async def test_standby_waits_for_the_lease() -> None:
    log = InProcessLog(duplicate_window=0, leadership_ttl=0.3)
    a, stop_a, task_a = await start(log, "a")
    await until(lambda: a.is_leader)
    b, stop_b, task_b = await start(log, "b")
    await log.append([node("n1", 1)])
    await log.append([submit("x", 1)])
    await until(lambda: len(placements(log)) == 1)
    assert not b.is_leader
    stop_a.set()
    await task_a
    await until(lambda: b.is_leader, timeout=3)
    await log.append([finish("x"), submit("y", 1)])
    await until(lambda: len(placements(log)) == 2)
    stop_b.set()
    await task_b
    assert violations(log._records) == []


async def test_a_lease_lost_to_another_instance_makes_a_standby_that_leads_again_later() -> None:
    log = InProcessLog(duplicate_window=0, leadership_ttl=0.3)
    a, stop, task = await start(log, "a")
    await log.append([node("n1", 2), submit("x", 1)])
    await until(lambda: len(placements(log)) == 1)
    log._leaderships["decider.scheduler"] = ("b", log.clock() + 0.6)  # b took over while a could not renew
    await until(lambda: not a.is_leader)
    assert not task.done(), "a lost lease makes a standby, not a dead process"
    await until(lambda: a.is_leader, timeout=3)  # b went away: its lease expired
    await log.append([submit("y", 1)])
    await until(lambda: len(placements(log)) == 2)
    stop.set()
    await task
    assert violations(log._records) == []


async def test_a_lease_that_expired_unclaimed_during_an_outage_is_taken_again() -> None:
    log = InProcessLog(duplicate_window=0, leadership_ttl=0.3)
    a, stop, task = await start(log, "a")
    await until(lambda: a.is_leader)
    del log._leaderships["decider.scheduler"]  # expired while NATS was away; nobody else took it
    await asyncio.sleep(0.3)
    assert a.is_leader and log._leaderships["decider.scheduler"][0] == "a"
    stop.set()
    await task


async def test_waiting_settlements_of_different_jobs_are_decided_together_and_of_one_job_once() -> None:
    """Task ends waiting at once are settled in one append, on one state; the two task ends of a
    2-node job still settle it once; the audit re-makes every one of those decisions."""
    log = InProcessLog(duplicate_window=0)
    await log.append([node("n1", 4), node("n2", 4)])
    await log.append([submit("a", 1), submit("b", 1), submit("g", 2, nodes=2)])
    _, stop, task = await start(log)
    await until(lambda: len(placements(log)) == 3)
    stop.set()
    await task
    nodes_of = {p.job: [a.node for a in p.allocations] for p in placements(log)}
    await log.append([ended("a", nodes_of["a"][0]), ended("b", nodes_of["b"][0])])
    await log.append([ended("g", "n1"), ended("g", "n2")])
    _, stop2, task2 = await start(log, instance="b")  # all four wait at once when it catches up
    await until(lambda: sum(isinstance(r.event, ev.JobFinished) for r in log._records) == 3)
    await asyncio.sleep(0.1)
    stop2.set()
    await task2
    finished = [r for r in log._records if isinstance(r.event, ev.JobFinished)]
    assert sorted(r.event.job for r in finished) == ["a", "b", "g"]
    assert len({r.event.based_on for r in finished[:2]}) == 1, "a and b were decided on one state"
    assert finished[1].seq == finished[0].seq + 1, "...and appended together"
    assert violations(log._records) == []
    assert audit(log._records, SchedulerDecider()).ok


async def test_a_pass_larger_than_one_atomic_append_is_appended_in_parts() -> None:
    log = InProcessLog(duplicate_window=0)
    log.max_batch = 2  # JetStream's is 1,000: a pass on a big cluster can place more jobs than that
    await log.append([node("n1", 8)])
    for j in "abcde":
        await log.append([submit(j, 1)])
    _, stop, task = await start(log)  # all five wait when it catches up: one pass places them
    await until(lambda: len(placements(log)) == 5)
    stop.set()
    await task
    seqs = [r.seq for r in log._records if isinstance(r.event, ev.JobPlaced)]
    assert len({p.based_on for p in placements(log)}) == 1, "one pass"
    assert seqs == list(range(seqs[0], seqs[0] + 5)), "its decisions stored together, in three atomic parts"
    report = audit(log._records, SchedulerDecider())
    assert violations(log._records) == [] and report.ok
    assert report.decisions_checked >= 5, "the audit re-derived the pass, all of its parts"


async def test_a_snapshot_of_another_state_format_is_not_read_and_the_state_is_rebuilt_from_the_log() -> None:
    import zlib

    import msgspec

    from gpuherd.log import SNAPSHOT_BUCKET
    from gpuherd.runtime.snapshots import Snapshot

    log = InProcessLog(duplicate_window=0)
    await log.append([node("n1", 2), submit("a", 1)])
    decider = SchedulerDecider()
    stale = decider.initial_state()
    stale.seq = 2  # "everything folded": were it read, the runner would know of no node and no job
    for v in (SchedulerDecider.STATE_FORMAT - 1, SchedulerDecider.STATE_FORMAT):
        snap = Snapshot(v=v, seq=2, state=decider.encode_state(stale))
        await log.kv_put(SNAPSHOT_BUCKET, "scheduler", zlib.compress(msgspec.msgpack.encode(snap)))
        runner, stop, task = await start(log, instance=f"v{v}")
        await until(lambda runner=runner: runner.caught_up.is_set())
        stop.set()
        await task
        if v != SchedulerDecider.STATE_FORMAT:
            assert "n1" in runner.state.nodes and len(placements(log)) == 1, "rebuilt from the log, and decided"
        else:
            assert not runner.state.nodes, "a snapshot of this format is trusted (it is only ever written whole)"


async def test_a_former_leader_that_wakes_up_is_fenced_out_of_the_log() -> None:
    """A leader frozen past its lease (a paused process, a partition) still believes it leads when
    it wakes, and appends what it decided on its stale state. The leader that took over fenced the
    subject: every append of the former one is refused, and it turns standby."""
    log = InProcessLog(duplicate_window=0, leadership_ttl=0.3)
    zombie = DeciderRunner(log, SchedulerDecider(), instance="a")
    assert await zombie.acquire_leadership(asyncio.Event())
    await log.append([node("n1", 1), submit("x", 1)])
    del log._leaderships["decider.scheduler"]  # a froze; its leadership expired
    _, stop_b, task_b = await start(log, "b")
    await until(lambda: len(placements(log)) == 1)  # b leads, fenced, and placed x
    head = len(log._records)
    stale = ev.JobPlaced(
        id="scheduler:3:0",
        source="scheduler",
        job="x",
        attempt=1,
        allocations=(ev.Allocation(node="n1", gpus=(0,)),),
        based_on=2,
        cause="test:intake:x",
    )
    with pytest.raises(LeadershipLost):
        await zombie._append([stale], [None])
    with pytest.raises(LeadershipLost):
        await zombie.append_input([ev.ClockTicked(id="scheduler:tick:z", at=1.0, source="scheduler")])
    assert len(log._records) == head, "nothing of the former leader reached the log"
    takes = [r.event for r in log._records if isinstance(r.event, ev.LeadershipTaken)]
    assert [t.instance for t in takes] == ["a", "b"]
    stop_b.set()
    await task_b
    assert audit(log._records, SchedulerDecider()).ok


async def test_a_former_leader_that_wakes_up_does_not_write_over_the_new_leaders_snapshot() -> None:
    """A snapshot says everything it folded is decided: a former leader's (frozen past its lease,
    awake again) is refused like its decisions, and the new leader's stays."""
    log = InProcessLog(duplicate_window=0, leadership_ttl=0.3)
    zombie = DeciderRunner(log, SchedulerDecider(), instance="a")
    assert await zombie.acquire_leadership(asyncio.Event())
    await log.append([node("n1", 1), submit("x", 1)])
    del log._leaderships["decider.scheduler"]  # a froze; its leadership expired
    _, stop_b, task_b = await start(log, "b", snapshot_interval_s=0.0)
    await until(lambda: len(placements(log)) == 1)  # b leads, fenced, placed x
    for _ in range(500):
        snap = await load_snapshot(log, "scheduler", SchedulerDecider.STATE_FORMAT)
        if snap is not None and snap.seq >= len(log._records):
            break
        await asyncio.sleep(0.01)
    stop_b.set()
    await task_b
    newer = await log.kv_get(SNAPSHOT_BUCKET, "scheduler")
    assert newer is not None, "b snapshotted its state"
    with pytest.raises(LeadershipLost):
        await zombie.save_snapshot()
    assert await log.kv_get(SNAPSHOT_BUCKET, "scheduler") == newer, "the new leader's snapshot stays"


async def test_a_leader_that_reads_a_newer_leaders_fence_steps_down_at_once() -> None:
    """Reading a newer ``LeadershipTaken`` is news enough: it steps down before folding it (its
    lease's renewal would tell it a third of a TTL later, or its next append), so it decides and
    snapshots nothing on a state that holds the newer fence."""
    log = InProcessLog(duplicate_window=0, leadership_ttl=60.0)
    a, stop, task = await start(log, "a", snapshot_interval_s=0.0)
    await log.append([node("n1", 1)])
    await until(lambda: a.is_leader and a.caught_up.is_set())
    log._leaderships["decider.scheduler"] = ("b", log.clock() + 60.0)  # b took over while a was away
    taken = ev.LeadershipTaken(id="scheduler:leader:b:1", source="scheduler", service="scheduler", instance="b")
    fence = (await log.append([taken])).seqs[0]
    await until(lambda: not a.is_leader, timeout=3.0)
    stop.set()
    await task
    snap = await load_snapshot(log, "scheduler", SchedulerDecider.STATE_FORMAT)
    assert snap is None or snap.seq < fence, "no snapshot of a state holding the newer fence"


async def test_the_audit_reports_a_decision_stored_after_a_newer_leader_took_over() -> None:
    log = InProcessLog(duplicate_window=0)
    _, stop, task = await start(log, "a")
    await log.append([node("n1", 2), submit("x", 1)])
    await until(lambda: len(placements(log)) == 1)
    stop.set()
    await task
    placed = placements(log)[0]
    await log.append(
        [ev.LeadershipTaken(id="scheduler:leader:b:1", source="scheduler", service="scheduler", instance="b")]
    )
    # What the fence keeps out, forced in by hand: a decision of the former leader, stored late.
    await log.append([msgspec.structs.replace(placed, id=f"scheduler:{placed.based_on}:9", job="late")])
    report = audit(log._records, SchedulerDecider())
    assert [m.kind for m in report.mismatches if m.kind == "stale"] == ["stale"]


async def test_stage_trace_times_each_batch_in_order(tmp_path, monkeypatch) -> None:
    """With ``GPUHERD_STAGE_TRACE_DIR`` set, every decided batch gets one line, written once its own
    outputs fold back, whose times run in the order of a decision's life."""
    from gpuherd.runtime.stages import TRACE_DIR_ENV, TRACE_MAX_ENV, read_traces

    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(TRACE_MAX_ENV, "2")
    log = InProcessLog(duplicate_window=0)
    runner, stop, task = await start(log)
    await log.append([node("n1", 4)])
    for j in "abc":
        await log.append([submit(j, 1)])
        await until(lambda j=j: j in {p.job for p in placements(log)})
    await until(lambda: runner.state.seq == len(log._records))
    stop.set()
    await task
    traces = read_traces(tmp_path / "scheduler.jsonl")
    assert len(traces) == 2, "only the first GPUHERD_STAGE_TRACE_MAX batches"
    stored = {r.event.id: r for r in log._records}
    for trace in traces:
        assert trace.arrived[0] <= trace.start <= trace.decided <= trace.acked <= trace.folded
        (cause,) = trace.causes
        ((out_id, job),) = trace.outputs[0]
        assert isinstance(stored[out_id].event, ev.JobPlaced) and stored[out_id].event.cause == cause
        assert stored[out_id].event.job == job
        assert trace.last_seq == stored[out_id].seq
    assert [t.outputs[0][0][1] for t in traces] == ["a", "b"]


class SnapshotsRefused(InProcessLog):
    """A log whose snapshot bucket refuses every snapshot (too large for the server, say)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.snapshot_tries = 0

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        if bucket == SNAPSHOT_BUCKET:
            self.snapshot_tries += 1
            raise OSError("maximum payload exceeded")
        await super().kv_put(bucket, key, value)


async def test_a_snapshot_that_cannot_be_stored_is_tried_again_a_cadence_later_not_at_every_pause() -> None:
    # Tried at every quiescent moment, a refused snapshot had the whole state encoded and sent again
    # after each event: a state too large to store cost its service a full encoding per decision.
    log = SnapshotsRefused(duplicate_window=0)
    runner, stop, task = await start(log, snapshot_every=20)
    await log.append([node("n1", 2)])
    for i in range(60):
        await log.append([submit(f"j{i}", 1)])
        await until(lambda: runner.state.seq >= log._records[-1].seq and runner.core.quiescent())
    stop.set()
    await task
    assert 1 <= log.snapshot_tries <= 60 * 2 // 20 + 1, log.snapshot_tries
    assert runner.metrics.snapshots_missed._value.get() == log.snapshot_tries
