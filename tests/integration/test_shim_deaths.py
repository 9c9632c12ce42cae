"""An elastic task's shim with real worker processes: every worker that dies is told to the agent
(a ``WorkerExit`` datagram) and written down (``dead-workers.json``), whenever it dies."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuherd import control
from services.nodeagent import taskfiles
from services.nodeagent.shim import Shim
from services.nodeagent.taskfiles import ExitRecord, ProcLaunch, TaskDescription, WorkerDeath

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def agent_socket() -> Iterator[tuple[str, socket.socket]]:
    """The agent's control socket, as the shim addresses it: (address, socket)."""
    name = f"gpuherd-test-shim-deaths-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2.0)
    try:
        yield f"unix-abstract:{name}", sock
    finally:
        sock.close()


@contextlib.contextmanager
def shim_handlers_restored() -> Iterator[None]:
    """The shim installs its own SIGTERM/SIGINT handlers: give pytest its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_last_worker_dying_between_the_shims_report_and_its_poll_is_still_reported(
    tmp_path: Path, agent_socket: tuple[str, socket.socket]
) -> None:
    address, agent = agent_socket
    go = tmp_path / "die-now"
    # The worker dies once told to: after the shim's report of dead workers, before its own poll.
    code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\nraise SystemExit(3)"
    worker = ProcLaunch(argv=[sys.executable, "-c", code], env=dict(os.environ), log=str(tmp_path / "w.log"), gpu=0)
    (tmp_path / "alive").touch()
    description = TaskDescription(
        procs=[worker],
        alive_file=str(tmp_path / "alive"),
        fence_after_s=60.0,
        kill_grace_s=1.0,
        elastic=True,
        job="j",
        agent_addr=address,
        node="n1",
    )
    taskfiles.write(tmp_path / taskfiles.TASK_FILE, description)
    shim = Shim(tmp_path)

    def worker_dies_meanwhile() -> None:  # (stands in for the standby's start, which takes a while)
        if go.exists():
            return
        go.touch()
        deadline = time.monotonic() + 10.0
        while shim.procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    shim.keep_standby = worker_dies_meanwhile  # type: ignore[method-assign]
    try:
        with shim_handlers_restored():
            assert shim.run() == 0
    finally:
        for proc in shim.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    told = control.decode_message(agent.recv(65536))
    assert isinstance(told, control.WorkerExit)
    assert (told.job, told.gpu, told.code) == ("j", 0, 3)
    dead = taskfiles.read(tmp_path / taskfiles.DEAD_WORKERS_FILE, list[WorkerDeath])
    assert dead is not None and [(d.gpu, d.code) for d in dead] == [(0, 3)]
    record = taskfiles.read(tmp_path / taskfiles.EXIT_FILE, ExitRecord)
    assert record is not None and record.codes == [3]
