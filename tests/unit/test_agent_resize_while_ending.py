"""A task that ended by itself is never started again, unless a resize brings its job back onto the
node. When that resize was read before the task's end was recorded (both of j's workers on n1 died,
then a rollback naming n1 arrived before the agent's reconcile), the next reconcile recorded a
failed end and started the task again in the same pass: a task for an attempt that end stops. The
task starts again only once its end is recorded, and only after a completed one (its workers left
at a shrink, and a grow brings it back)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuherd import events as ev
from gpuherd.log import InProcessLog
from services.nodeagent.agent import Agent
from services.nodeagent.executors.base import TaskExit, TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor
from tests.unit.test_rollback_to_workers_that_left import _agent_state, _rolled_back

pytestmark = pytest.mark.timeout(30)

KEY = TaskKey("j", 0)


class _EndedTask(CpuExecutor):
    """j's task here has ended (it runs no more); a start is written down, nothing is launched."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, gpus=4, alive_file=root / "alive")
        self.started: list[TaskLaunch] = []

    def running(self) -> set[TaskKey]:
        return set()

    async def start(self, launch: TaskLaunch) -> None:
        self.started.append(launch)


def _resized_onto_n1() -> ev.JobResized:
    return ev.JobResized(
        id="r", job="j", attempt=0, generation=3, allocations=(ev.Allocation("n1", (0, 1, 2)),), kind="rollback"
    )


@pytest.mark.parametrize("outcome", ["failed", "completed"])
async def test_a_resize_read_before_a_tasks_end_is_recorded_starts_it_again_only_after_a_completed_end(
    tmp_path: Path, outcome: str
) -> None:
    executor = _EndedTask(tmp_path)
    log = InProcessLog(duplicate_window=0)
    agent = Agent(log, "n1", executor)
    agent.state = _agent_state(_rolled_back("failed"))  # j's rollback generation holds n1/0,1,2
    agent.caught_up.set()
    agent._note_exit(TaskExit(key=KEY, outcome=outcome, exit_code=1 if outcome == "failed" else 0))  # type: ignore[arg-type]
    agent._remember(_resized_onto_n1(), None, None)  # read before the reconcile that records the end

    await agent.reconcile("j")
    ended = [r.event for r in await log.read_all() if isinstance(r.event, ev.TaskEnded)]
    assert [e.outcome for e in ended] == [outcome]
    assert executor.started == [], "the same pass that recorded its end started it again"
    await agent.settled()  # (the reconcile its recorded end asks for, if any)
    if outcome == "completed":
        assert [launch.key for launch in executor.started] == [KEY], "a completed part comes back with a resize"
    else:
        await agent.reconcile("j")
        assert executor.started == [], "a failed part is not started again: its end stops the attempt"
