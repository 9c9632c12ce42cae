"""Progress reports from a training process to its node agent (standard library only).

``report(step, loss=..., samples_per_s=...)`` sends one datagram to the agent's
control socket (``GPUHERD_AGENT_ADDR``). It never blocks and never fails the
job: with no agent (a script started by hand) it does nothing.
"""

from __future__ import annotations

import json
import os
import socket
import time

from gpuherd import jobenv

_sock: socket.socket | None = None


def _address() -> bytes | None:
    scheme, _, name = os.environ.get(jobenv.AGENT_ADDR, "").partition(":")
    return b"\0" + name.encode() if scheme == "unix-abstract" and name else None


def report(step: int, **values: float) -> bool:
    """Tell the agent how far this process is; True if the agent got it."""
    return send({"kind": "metrics", "step": step, "values": {k: float(v) for k, v in values.items()}})


def send(message: dict) -> bool:
    """One message to the agent, stamped with this process's job, attempt, rank and time."""
    global _sock
    address = _address()
    if address is None:
        return False
    message = {
        "job": os.environ.get(jobenv.JOB_ID, ""),
        "attempt": int(os.environ.get(jobenv.ATTEMPT, "0")),
        "rank": int(os.environ.get(jobenv.RANK, "0")),
        "at": time.time(),
        **message,
    }
    try:
        if _sock is None:
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sock.setblocking(False)
        _sock.sendto(json.dumps(message).encode(), address)
        return True
    except OSError:
        return False  # the agent is restarting or gone: training goes on
