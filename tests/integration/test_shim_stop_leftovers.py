"""Nothing of a task runs on after it is stopped or fenced, though its shim wrote its exit record:
a grandchild that left the task's process group (a session of its own) is found by its
environment, which names the task's folder, and killed too."""

from __future__ import annotations

import pytest

from services.nodeagent.executors import TaskKey
from tests.integration.test_process_executor import (
    executor,
    exit_of,
    kill_processes_of_job,
    launch,
    pids_of_job,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

# The rank starts a grandchild in a session of its own (out of its process group), then waits.
ESCAPING = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
    "print('ready', flush=True); time.sleep(60)"
)


async def test_a_stopped_task_leaves_no_grandchild_that_started_a_session_of_its_own(tmp_path) -> None:
    ex = executor(tmp_path, kill_grace_s=1.0)
    key = TaskKey("escape", 0)
    try:
        await ex.start(launch("escape", ESCAPING))
        await wait_until(lambda: len(pids_of_job("escape")) == 2)
        stopped = await ex.stop(key, "cancelled on request")
        assert stopped is not None and stopped.outcome == "stopped"
        assert (ex.task_dir(key) / "exit.json").exists(), "the shim wrote its record"
        await wait_until(lambda: pids_of_job("escape") == [], timeout=5.0)
    finally:
        kill_processes_of_job("escape")


async def test_a_fenced_task_leaves_no_grandchild_that_started_a_session_of_its_own(tmp_path) -> None:
    ex = executor(tmp_path, fence_after_s=1.0, kill_grace_s=1.0)
    try:
        await ex.start(launch("fenced", ESCAPING))
        await wait_until(lambda: len(pids_of_job("fenced")) == 2)
        ended = await exit_of(ex, timeout=20)  # no agent touches the alive file: the shim stops the task
        assert ended.outcome == "stopped" and "fenced" in ended.reason
        await wait_until(lambda: pids_of_job("fenced") == [], timeout=5.0)
    finally:
        kill_processes_of_job("fenced")
