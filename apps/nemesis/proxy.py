"""A userspace TCP proxy that degrades a link on command (the nemesis' ``latency`` fault).

The kernels here have no netem qdisc, so a host reaches its NATS servers through this proxy
(one process per host, in the host's network namespace): every byte is forwarded, in order, after
``delay_ms`` (+ up to ``jitter_ms``); with ``stall_p`` a chunk waits ``stall_ms`` more (what a lost
segment costs TCP: a retransmission timeout); with ``reset_p`` the connection is reset (RST) at
that chunk. Both directions of every connection of the process are degraded alike.

    python -m apps.nemesis.proxy CONTROL_SOCKET LISTEN_PORT=HOST:PORT [...]

Control (one JSON line on the Unix socket): ``{"delay_ms": 200, "jitter_ms": 50, "stall_p": 0.05,
"stall_ms": 400, "reset_p": 0.01, "seed": 1}`` sets the degradation (``{}`` heals it); the answer is
the settings in force and how many connections were reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import sys
import time

CHUNK = 65536


class Link:
    """What the proxy does to the bytes it forwards, now."""

    def __init__(self) -> None:
        self.delay_ms = 0.0
        self.jitter_ms = 0.0
        self.stall_p = 0.0
        self.stall_ms = 400.0
        self.reset_p = 0.0
        self.rng = random.Random(0)
        self.resets = 0
        self.connections = 0

    def set(self, settings: dict[str, float]) -> None:
        self.delay_ms = float(settings.get("delay_ms", 0.0))
        self.jitter_ms = float(settings.get("jitter_ms", 0.0))
        self.stall_p = float(settings.get("stall_p", 0.0))
        self.stall_ms = float(settings.get("stall_ms", 400.0))
        self.reset_p = float(settings.get("reset_p", 0.0))
        self.rng = random.Random(int(settings.get("seed", 0)))

    def state(self) -> dict[str, float]:
        return {
            "delay_ms": self.delay_ms,
            "jitter_ms": self.jitter_ms,
            "stall_p": self.stall_p,
            "stall_ms": self.stall_ms,
            "reset_p": self.reset_p,
            "resets": self.resets,
            "connections": self.connections,
        }

    def hold_s(self) -> float:
        hold = self.delay_ms + (self.rng.uniform(0, self.jitter_ms) if self.jitter_ms else 0.0)
        if self.stall_p and self.rng.random() < self.stall_p:
            hold += self.stall_ms
        return hold / 1000.0

    def reset_now(self) -> bool:
        return bool(self.reset_p) and self.rng.random() < self.reset_p


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a middlebox or a crashed peer would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pipe(link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: asyncio.StreamWriter):
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
    last_due = 0.0

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                queue.put_nowait((0.0, b""))
                break
            if link.reset_now():
                link.resets += 1
                _reset(writer)
                _reset(peer)
                return
            last_due = max(last_due, time.monotonic() + link.hold_s())  # in order, whatever the jitter
            queue.put_nowait((last_due, data))
        await sender
    except (OSError, asyncio.IncompleteReadError):
        _reset(writer)
        _reset(peer)
    finally:
        sender.cancel()


async def _serve_pair(link: Link, target: tuple[str, int], client_r, client_w) -> None:
    link.connections += 1
    try:
        server_r, server_w = await asyncio.wait_for(asyncio.open_connection(*target), 5.0)
    except (OSError, TimeoutError):
        _reset(client_w)
        return
    try:
        await asyncio.gather(_pipe(link, client_r, server_w, client_w), _pipe(link, server_r, client_w, server_w))
    finally:
        for w in (client_w, server_w):
            with contextlib.suppress(Exception):
                w.close()


async def _control(link: Link, path: str) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        try:
            settings = json.loads(line or b"null")
            if settings is not None:
                link.set(settings)
            answer = link.state()
        except (ValueError, TypeError) as exc:
            answer = {"error": str(exc)}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return await asyncio.start_unix_server(handle, path)


async def serve(control_path: str, routes: dict[int, tuple[str, int]]) -> None:
    link = Link()
    servers = [await _control(link, control_path)]
    for port, target in routes.items():
        servers.append(await asyncio.start_server(lambda r, w, t=target: _serve_pair(link, t, r, w), "127.0.0.1", port))
    await asyncio.gather(*(s.serve_forever() for s in servers))


def control(path: str | os.PathLike[str], settings: dict[str, float] | None, timeout: float = 5.0) -> dict:
    """Set a running proxy's degradation (``{}``: none; None: only ask) and return its state."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(settings).encode() + b"\n")
        return json.loads(s.makefile().readline())


def main(argv: list[str] | None = None) -> None:
    args = argv or sys.argv[1:]
    routes = {}
    for spec in args[1:]:
        port, _, target = spec.partition("=")
        host, _, target_port = target.rpartition(":")
        routes[int(port)] = (host, int(target_port))
    asyncio.run(serve(args[0], routes))


if __name__ == "__main__":
    main()
