"""Messages from a training process to its node agent (``gpuherd.control``).

``report(step, loss=..., samples_per_s=...)`` sends one datagram to the agent's
control socket (``GPUHERD_AGENT_ADDR``). It never blocks and never fails the
job: with no agent (a script started by hand) it does nothing.

A datagram sent while the agent restarts is lost. The reports the job cannot do without are
therefore also left in the task's folder, where the agent finds them: a rescale's completion (the
scheduler rolls back a rescale never reported done; ``RESCALE_COMPLETED_FILE``), and a worker's
leaving (a later generation that names its GPU again, a rollback of the shrink it left at, needs a
new worker there; ``left_file``).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import msgspec

from gpuherd import control, jobenv

_sock: socket.socket | None = None

# In the task's folder (``GPUHERD_TASK_DIR``): the last completed rescale's report (a ``RescaleReport``).
RESCALE_COMPLETED_FILE = "rescale-completed.json"
# In the task's folder: the ``RescaleReport`` of the worker of one GPU that left (``left_file``).
LEFT_PATTERN = "left-*.json"


def left_file(gpu: int) -> str:
    """The file in the task's folder where the worker of ``gpu`` says it left (the last one that did)."""
    return f"left-{gpu}.json"


def _address() -> bytes | None:
    scheme, _, name = os.environ.get(jobenv.AGENT_ADDR, "").partition(":")
    return b"\0" + name.encode() if scheme == "unix-abstract" and name else None


def report(step: int, **values: float) -> bool:
    """Tell the agent how far this process is; True if the agent got it."""
    return send(control.Progress, step=step, values={k: float(v) for k, v in values.items()})


def send(kind: type[control.Message], **fields: Any) -> bool:
    """One message of ``kind`` to the agent, stamped with this process's job, attempt, rank and time."""
    global _sock
    address = _address()
    if address is None and not os.environ.get(jobenv.TASK_DIR):
        return False
    stamp: dict[str, Any] = {
        "job": os.environ.get(jobenv.JOB_ID, ""),
        "attempt": int(os.environ.get(jobenv.ATTEMPT, "0")),
        "at": time.time(),
    }
    if "rank" in kind.__struct_fields__:
        stamp["rank"] = int(os.environ.get(jobenv.RANK, "0"))
    try:
        message = msgspec.convert(stamp | fields, kind)
    except msgspec.ValidationError:
        return False  # (a bug in the sender: the agent would refuse it anyway)
    if isinstance(message, control.RescaleReport) and message.event == "completed":
        _keep(message, RESCALE_COMPLETED_FILE)
    elif isinstance(message, control.RescaleReport) and message.event == "left":
        gpu = _own_gpu()
        if gpu is not None:
            _keep(message, left_file(gpu))
    if address is None:
        return False
    try:
        if _sock is None:
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sock.setblocking(False)
        _sock.sendto(control.encode_message(message), address)  # type: ignore[arg-type]
        return True
    except OSError:
        return False  # the agent is restarting or gone: training goes on


def _own_gpu() -> int | None:
    """The GPU of this elastic worker (its id is ``<node>/<gpu>``); None for a process that is not one."""
    _, _, gpu = os.environ.get(jobenv.ELASTIC_WORKER, "").rpartition("/")
    return int(gpu) if gpu.isdecimal() else None


def _keep(message: control.RescaleReport, name: str) -> None:
    """Leave the report in the task's folder as ``name``, replaced whole (the agent reads the old
    report or the new one); a folder that cannot be written to costs only the copy."""
    folder = os.environ.get(jobenv.TASK_DIR)
    if not folder:
        return
    path = Path(folder) / name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(control.encode_message(message))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
