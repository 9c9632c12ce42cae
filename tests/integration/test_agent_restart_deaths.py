"""An elastic task's worker that dies while its node's agent restarts (real shim and worker,
in-memory log): the new agent records it lost, as the agent that was up would have, and the job
goes on with its other node's worker rather than stopping its whole gang."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.fold import ClusterState, apply
from gpuherd.log import InProcessLog
from services.nodeagent.agent import Agent
from services.nodeagent.control_socket import control_address
from services.nodeagent.executors.cpu import CpuExecutor
from tests.helpers import node
from tests.integration.test_agent_restart import events_of, running
from tests.integration.test_process_executor import kill_processes_of_job, pids_of_job, wait_until

pytestmark = pytest.mark.timeout(60)


def make_agent(log: InProcessLog, data_dir: Path) -> Agent:
    executor = CpuExecutor(
        data_dir,
        gpus=2,
        alive_file=data_dir / "alive",
        fence_after_s=60.0,
        kill_grace_s=1.0,
        agent_addr=control_address(str(data_dir), "n1"),
    )
    return Agent(log, "n1", executor, address="127.0.0.1", port_range=(29000, 29009))


async def test_a_worker_that_died_during_an_agent_restart_is_recorded_lost_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    log = InProcessLog(leadership_ttl=0.5)
    await log.append([node("n2", 2, executor="cpu")])
    go = tmp_path / "die-now"
    code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\nraise SystemExit(3)"
    spec = ev.JobSpec(
        name="e", user="u", gpus=2, command=(sys.executable, "-c", code), elastic=ev.Elastic(min=1, max=2)
    )
    both = (ev.Allocation("n2", (0,)), ev.Allocation("n1", (0,)))
    task_dir = tmp_path / "jobs" / "e" / "attempt-0"
    try:
        async with running(make_agent(log, tmp_path)):
            await log.append([ev.JobSubmitted(id="sub", job="e", spec=spec, intake_source="t")])
            placed = ev.JobPlaced(
                id="p", job="e", attempt=0, allocations=both, rendezvous=ev.Rendezvous("127.0.0.1", 29000)
            )
            await log.append([placed, ev.JobStarted(id="s-n2", job="e", attempt=0, node="n2")])
            await wait_until(lambda: len(events_of(log, ev.JobStarted)) == 2 and bool(pids_of_job("e")))
        go.touch()  # the worker dies while no agent runs
        await wait_until(lambda: (task_dir / "exit.json").exists())
        async with running(make_agent(log, tmp_path)) as agent:
            await wait_until(lambda: bool(events_of(log, ev.TaskEnded)), timeout=20)
            await agent.settled()
    finally:
        kill_processes_of_job("e")
    (lost,) = events_of(log, ev.WorkerLost)
    assert (lost.node, lost.gpu, lost.exit_code) == ("n1", 0, 3)
    seqs = {type(r.event): r.seq for r in log._records}
    assert seqs[ev.WorkerLost] < seqs[ev.TaskEnded], "lost before its task's end"
    state = ClusterState()
    for record in log._records:
        apply(state, record.seq, record.event)
    job = state.jobs["e"]
    assert not job.stopping() and "n1" not in job.parts_ended, "the job goes on with n2/0"
