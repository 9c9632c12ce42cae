"""An agent restart with real processes (in-memory log, cpu executor): it adopts what still
belongs to it and kills what no longer does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.log import InProcessLog
from services.nodeagent.agent import Agent
from services.nodeagent.executors import TaskKey
from services.nodeagent.executors.cpu import CpuExecutor
from tests.helpers import node
from tests.integration.test_process_executor import kill_processes_of_job, pids_of_job, wait_until

pytestmark = pytest.mark.timeout(60)


def make_agent(log: InProcessLog, data_dir: Path) -> Agent:
    executor = CpuExecutor(data_dir, gpus=2, alive_file=data_dir / "alive", fence_after_s=60.0, kill_grace_s=1.0)
    return Agent(log, "n1", executor, address="127.0.0.1", port_range=(29000, 29009))


@contextlib.asynccontextmanager
async def running(agent: Agent):
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(agent.caught_up.wait(), 10)
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


async def place(log: InProcessLog, job: str, code: str) -> None:
    spec = ev.JobSpec(name=job, user="u", gpus=1, command=(sys.executable, "-c", code))
    await log.append([ev.JobSubmitted(id=f"sub-{job}", job=job, spec=spec, intake_source="t")])
    await log.append(
        [
            ev.JobPlaced(
                id=f"place-{job}",
                job=job,
                attempt=0,
                allocations=(ev.Allocation("n1", (0,)),),
                rendezvous=ev.Rendezvous("127.0.0.1", 29000),
            )
        ]
    )


def events_of(log: InProcessLog, kind: type) -> list:
    return [r.event for r in log._records if isinstance(r.event, kind)]


async def test_restarted_agent_adopts_its_running_task_without_starting_it_again(tmp_path: Path) -> None:
    log = InProcessLog(leadership_ttl=0.5)
    async with running(make_agent(log, tmp_path)):
        await place(log, "keep", "import time; time.sleep(2); print('finished')")
        await wait_until(lambda: bool(pids_of_job("keep")))
    # The agent is gone; its task runs on under its shim.
    assert pids_of_job("keep")
    await asyncio.sleep(0.6)  # the old agent's lease expires
    async with running(make_agent(log, tmp_path)):
        await wait_until(lambda: bool(events_of(log, ev.TaskEnded)), timeout=20)
    (ended,) = events_of(log, ev.TaskEnded)
    assert ended.outcome == "completed" and "finished" in ended.output_tail
    assert len(events_of(log, ev.JobStarted)) == 1, "adopted, not started twice"


async def test_restarted_agent_kills_a_task_whose_job_moved_on_and_registers_again(tmp_path: Path) -> None:
    log = InProcessLog(leadership_ttl=0.5)
    async with running(make_agent(log, tmp_path)):
        await place(log, "moved", "import time; time.sleep(60)")
        await wait_until(lambda: bool(pids_of_job("moved")))
    # While the agent was away the scheduler declared the node lost and requeued the job.
    await log.append([ev.NodeLost(id="lost-n1", node="n1", reason="no heartbeat")])
    await log.append([ev.JobRequeued(id="rq-moved", job="moved", attempt=0, reason="node n1 lost")])
    assert pids_of_job("moved"), "the shim outlived the agent (its fence is long in this test)"
    await asyncio.sleep(0.6)
    async with running(make_agent(log, tmp_path)):
        await wait_until(lambda: not pids_of_job("moved"), timeout=20)
        await wait_until(lambda: len(events_of(log, ev.NodeRegistered)) == 2)
    assert events_of(log, ev.TaskEnded) == [], "the attempt was settled without this part's word"


async def test_agent_reports_an_unhealthy_gpu_once(tmp_path: Path) -> None:
    from services.nodeagent.executors import GpuSample

    log = InProcessLog(leadership_ttl=0.5)
    agent = make_agent(log, tmp_path)
    agent.telemetry_s = 0.1
    agent.executor.sample = lambda: [GpuSample(index=0), GpuSample(index=1, healthy=False, problem="XID 79")]
    async with running(agent):
        await wait_until(lambda: bool(events_of(log, ev.GpuHealthChanged)))
        await asyncio.sleep(0.5)  # more samples: still one report
    (report,) = events_of(log, ev.GpuHealthChanged)
    assert (report.node, report.index, report.healthy, report.reason) == ("n1", 1, False, "XID 79")


async def test_preemption_gives_the_job_its_checkpoint_signal_and_grace(tmp_path: Path) -> None:
    log = InProcessLog(leadership_ttl=0.5)
    code = (
        "import signal, sys, time\n"
        "def checkpoint(*_):\n"
        "    print('checkpoint saved', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGUSR1, checkpoint)\n"
        "print('training', flush=True); time.sleep(60)\n"
    )
    async with running(make_agent(log, tmp_path)):
        await place(log, "victim", code)
        await wait_until(
            lambda: (
                "training" in (tmp_path / "jobs/victim/attempt-0/rank-0.log").read_text()
                if (tmp_path / "jobs/victim/attempt-0/rank-0.log").exists()
                else False
            )
        )
        await log.append([ev.JobPreempted(id="pre", job="victim", attempt=0, reason="priority", by="vip", grace_s=10)])
        await wait_until(lambda: bool(events_of(log, ev.TaskEnded)), timeout=20)
    (ended,) = events_of(log, ev.TaskEnded)
    assert ended.outcome == "stopped" and ended.reason == "priority"
    assert "checkpoint saved" in ended.output_tail
    assert pids_of_job("victim") == []


async def test_a_restarted_agent_reads_only_the_log_after_its_snapshot(tmp_path: Path) -> None:
    class Reads(InProcessLog):
        starts: list[int] = []

        def read(self, start: int = 1, **kw):  # type: ignore[override]
            self.starts.append(start)
            return super().read(start, **kw)

    log = Reads(leadership_ttl=0.5)
    first = make_agent(log, tmp_path)
    first.snapshots.every = 5
    async with running(first):
        await place(log, "done", "print('ok')")
        await wait_until(lambda: bool(events_of(log, ev.TaskEnded)), timeout=20)
        await log.append([ev.JobFinished(id="fin-done", job="done", attempt=0, outcome="completed")])
        for i in range(12):  # other jobs: folded, and the snapshot follows them
            spec = ev.JobSpec(name=f"o{i}", user="u", gpus=1, duration_s=1.0)
            await log.append([ev.JobSubmitted(id=f"sub-o{i}", job=f"o{i}", spec=spec, intake_source="t")])
        await wait_until(lambda: first.snapshots.seq >= len(log._records) - 5 and first._snapshotting.done())
    saved = first.snapshots.seq
    await asyncio.sleep(0.6)  # the old agent's lease expires
    log.starts.clear()
    second = make_agent(log, tmp_path)
    async with running(second):
        assert log.starts[0] == saved + 1, "it folded the snapshot's state, then read from there on"
        assert set(second.state.jobs) == {f"o{i}" for i in range(12)}, "what it knows is the snapshot's"
    assert len(events_of(log, ev.JobStarted)) == 1, "the finished job was not started again"


async def test_an_elastic_part_back_on_its_node_reports_its_stop_on_a_cancel(tmp_path: Path) -> None:
    """The part left at a shrink (its end recorded then) and came back at a grow: stopped on a
    cancel, its end must still reach the log, or the job waits for it forever."""
    from services.nodeagent.executors.sim import SimExecutor

    log = InProcessLog(leadership_ttl=0.5)
    spec = ev.JobSpec(name="e", user="u", gpus=2, duration_s=1000.0, elastic=ev.Elastic(min=1, max=3))
    both = (ev.Allocation("n1", (0, 1)), ev.Allocation("n2", (0,)))
    rendezvous = ev.Rendezvous("n1.local", 29500)
    agent = Agent(log, "n2", SimExecutor(gpus=2))
    await log.append([node("n1", 2)])
    async with running(agent):
        await log.append([ev.JobSubmitted(id="sub-e", job="e", spec=spec, intake_source="t")])
        placed = ev.JobPlaced(id="p", at=time.time(), job="e", attempt=0, allocations=both, rendezvous=rendezvous)
        await log.append([placed])
        await log.append([ev.JobStarted(id="s-n1", at=time.time(), job="e", attempt=0, node="n1")])
        await wait_until(lambda: len(events_of(log, ev.JobStarted)) == 2)
        shrink = ev.JobResized(
            id="g1", job="e", attempt=0, generation=1, allocations=both[:1], releasing=both[1:], kind="shrink",
            rendezvous=rendezvous,
        )  # fmt: skip
        await log.append([shrink])
        # Its worker took part in the switch and left: the part's end, as its agent records it.
        await log.append([agent.writer.events.ended(TaskKey("e", 0), "completed", 1.0, exit_code=0)])
        done = ev.RescaleCompleted(id="r1", job="e", attempt=0, generation=1, node="n1", world=2, world_before=3)
        await log.append([done])
        await wait_until(lambda: agent.executor.running() == set())  # (a sim task: stopped once the rescale is done)
        grow = ev.JobResized(id="g2", job="e", attempt=0, generation=2, allocations=both, rendezvous=rendezvous)
        await log.append([grow])
        await wait_until(lambda: len(events_of(log, ev.JobStarted)) == 3)
        await log.append([ev.JobCancelRequested(id="c", job="e")])
        await wait_until(lambda: agent.executor.running() == set())
        await agent.settled()
    ends = [e for e in events_of(log, ev.TaskEnded) if e.node == "n2"]
    assert [e.outcome for e in ends] == ["completed", "stopped"], "the stop after the grow was recorded too"


async def test_a_restarted_agent_stops_the_ranks_of_a_cancelled_job_whose_shim_was_killed(tmp_path: Path) -> None:
    """The shim was SIGKILLed while no agent ran (the OOM killer, `kill -9`), and the job cancelled
    meanwhile: nothing supervises its rank any more, so the next agent must end it."""
    log = InProcessLog(leadership_ttl=0.5)
    try:
        async with running(make_agent(log, tmp_path)):
            await place(log, "orphan", "import time; time.sleep(60)")
            await wait_until(lambda: bool(pids_of_job("orphan")))
        info = json.loads((tmp_path / "jobs/orphan/attempt-0/shim.json").read_text())
        os.kill(info["pid"], signal.SIGKILL)
        await log.append([ev.JobCancelRequested(id="cancel-orphan", job="orphan")])
        await asyncio.sleep(0.6)  # the old agent's lease expires
        assert pids_of_job("orphan"), "its rank outlived the shim"
        async with running(make_agent(log, tmp_path)):
            await wait_until(lambda: not pids_of_job("orphan"), timeout=10)
            await wait_until(lambda: bool(events_of(log, ev.TaskEnded)))
        (ended,) = events_of(log, ev.TaskEnded)
        assert ended.outcome == "stopped"
    finally:
        kill_processes_of_job("orphan")
