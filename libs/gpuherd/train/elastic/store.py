"""A generation's rendezvous store: waiting for its port and connecting to it without hanging."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from gpuherd.train.elastic.errors import ElasticError

STORE_GENERATION_KEY = "gpuherd/generation"
STORE_TRY_S = 5.0  # one try at connecting to a generation's store
STORE_RETRY_EVERY_S = 0.5  # between tries at opening a store whose port is busy


def wait_for_port(
    addr: str, port: int, timeout_s: float, poll_s: float, superseded: Callable[[], bool] = lambda: False
) -> None:
    """Until the generation's store listens (or a newer plan replaced this one, or time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1.0):
                return
        except OSError as exc:
            if superseded():
                raise ElasticError(f"a newer plan replaced the one served at {addr}:{port}") from exc
            if time.monotonic() > deadline:
                raise ElasticError(f"no rendezvous store at {addr}:{port} after {timeout_s:.0f}s: {exc}") from exc
            time.sleep(poll_s)


def store_client(addr: str, port: int, try_s: float, timeout: datetime.timedelta) -> dist.TCPStore:
    """Connect to the store at ``addr:port`` within ``try_s`` (TimeoutError otherwise). The client
    connects in a thread of its own: against a listener that is not a store, the handshake never
    ends, whatever its timeout says; such a thread is left behind, blocked, and costs one socket."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(addr, port, None, False, timeout=timeout)
        except Exception as exc:
            box["error"] = exc

    thread = threading.Thread(target=connect, name=f"store-client-{port}", daemon=True)
    thread.start()
    thread.join(try_s)
    if "error" in box:
        raise box["error"]
    if "store" not in box:
        raise TimeoutError(f"{addr}:{port} did not answer as a store within {try_s:.0f}s")
    return box["store"]
