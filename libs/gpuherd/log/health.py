"""How NATS is doing, from JetStream's own answers: the server this process is connected to, and
each stream's replicas (who leads, who is current, how far behind). ``gpuherd status`` and the
dashboard's services view show it."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Sequence
from typing import Any


def sync_mode(varz: dict[str, Any]) -> str:
    """How a server's JetStream syncs, from its ``/varz``: "always" (fsync before every
    acknowledgement) or the interval between fsyncs (nats-server's default: 2m)."""
    config = (varz.get("jetstream") or {}).get("config") or {}
    if config.get("sync_always"):
        return "always"
    interval_ns = int(config.get("sync_interval") or 120_000_000_000)
    seconds = interval_ns / 1e9
    return f"{seconds / 60:g}m" if seconds >= 60 and seconds % 60 == 0 else f"{seconds:g}s"


def _varz(url: str, timeout: float) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url.rstrip('/')}/varz", timeout=timeout) as answer:
        return json.load(answer)


async def durability(monitor_urls: Sequence[str], timeout: float = 2.0) -> list[dict[str, Any]]:
    """Each server's sync mode, read from its monitoring endpoint (``server``, ``sync``, ``durable``;
    ``error`` when it could not be read)."""
    out = []
    for url in monitor_urls:
        try:
            varz = await asyncio.to_thread(_varz, url, timeout)
        except (OSError, ValueError) as exc:
            out.append({"server": url, "sync": "unknown", "durable": None, "error": str(exc)})
            continue
        mode = sync_mode(varz)
        out.append({"server": varz.get("server_name") or url, "sync": mode, "durable": mode == "always"})
    return out


async def nats_overview(log_: Any, monitor_urls: Sequence[str] = ()) -> dict[str, Any]:
    """The connected server and each stream's replicas, from JetStream's own stream info; with the
    servers' monitoring endpoints, how each syncs its store (``durability``)."""
    nc = log_.nc
    info = getattr(nc, "_server_info", {}) or {}
    streams = []
    for config in log_.stream_configs():
        try:
            si = await log_.js.stream_info(config.name)
        except Exception as exc:  # a stream missing or without a leader: show it, do not fail the command
            streams.append(
                {
                    "name": config.name,
                    "messages": 0,
                    "bytes": 0,
                    "replicas": 0,
                    "storage": "?",
                    "leader": f"? ({exc!r})",
                    "peers": [],
                }
            )
            continue
        cluster = si.cluster
        peers = [
            {"name": p.name, "current": bool(p.current), "offline": bool(p.offline), "lag": int(p.lag or 0)}
            for p in ((cluster.replicas or []) if cluster else [])
        ]
        streams.append(
            {
                "name": config.name,
                "messages": int(si.state.messages),
                "bytes": int(si.state.bytes),
                "replicas": int(si.config.num_replicas or 1),
                "storage": str(getattr(si.config.storage, "value", si.config.storage) or "file"),
                "leader": cluster.leader if cluster else info.get("server_name", ""),
                "peers": peers,
            }
        )
    return {
        "server": info.get("server_name", nc.connected_url.netloc if nc.connected_url else "?"),
        "version": info.get("version", "?"),
        "cluster": info.get("cluster", ""),
        "streams": streams,
        "durability": await durability(monitor_urls),
    }
