"""The agent's control socket: how a job's processes talk to their node agent.

A Unix datagram socket in the abstract namespace (no file to clean up, no
path-length limit). A process sends one message per datagram, of the typed
protocol in ``gpuherd.control``; one that does not validate is logged and
dropped. Datagrams need no connection, so a job keeps running, unbothered,
while its agent restarts.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from gpuherd.control import AgentMessage, MessageError, decode_message
from gpuherd.events import stable_id
from gpuherd.obs import get_logger

log = get_logger("gpuherd.nodeagent.control")


def control_address(data_dir: str, node: str) -> str:
    """The address for ``GPUHERD_AGENT_ADDR``: stable across agent restarts on one data folder."""
    return f"unix-abstract:gpuherd-{node}-{stable_id(data_dir, node, length=10)}"


def _socket_name(address: str) -> bytes:
    scheme, _, name = address.partition(":")
    if scheme != "unix-abstract" or not name:
        raise ValueError(f"unsupported control address {address!r}")
    return b"\0" + name.encode()


OnMessage = Callable[[AgentMessage], None]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, on_message: OnMessage) -> None:
        self.on_message = on_message

    def datagram_received(self, data: bytes, addr: object) -> None:
        try:
            message = decode_message(data)
        except MessageError as exc:
            log.warning("ignored a malformed control message", size=len(data), error=str(exc))
            return
        self.on_message(message)


class ControlSocket:
    def __init__(self, address: str, on_report: OnMessage) -> None:
        self.address = address
        self.on_report = on_report
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(_socket_name(self.address))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(self.on_report), sock=sock)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
