"""How NATS is doing, from JetStream's own answers: the server this process is connected to, and
each stream's replicas (who leads, who is current, how far behind). ``gpuherd status`` and the
dashboard's services view show it."""

from __future__ import annotations

from typing import Any


async def nats_overview(log_: Any) -> dict[str, Any]:
    """The connected server and each stream's replicas, from JetStream's own stream info."""
    nc = log_.nc
    info = getattr(nc, "_server_info", {}) or {}
    streams = []
    for config in log_.stream_configs():
        try:
            si = await log_.js.stream_info(config.name)
        except Exception as exc:  # a stream missing or without a leader: show it, do not fail the command
            streams.append(
                {"name": config.name, "messages": 0, "bytes": 0, "replicas": 0, "leader": f"? ({exc!r})", "peers": []}
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
                "leader": cluster.leader if cluster else info.get("server_name", ""),
                "peers": peers,
            }
        )
    return {
        "server": info.get("server_name", nc.connected_url.netloc if nc.connected_url else "?"),
        "version": info.get("version", "?"),
        "cluster": info.get("cluster", ""),
        "streams": streams,
    }
