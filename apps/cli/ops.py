"""Operating a deployment: ``status``, ``log init``, ``security nats-accounts``, dead letters."""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import msgspec
from rich.table import Table

from apps import registry
from apps.cli.common import console, nats_monitor_urls, nats_url_of, open_cli_log, plain
from apps.deployment import COMPOSE_NODES, COMPOSE_SOURCES, accounts
from gpuherd.errors import GpuherdError
from gpuherd.log import HERD_INTAKE, STATUS_BUCKET, open_log
from gpuherd.log.health import nats_overview
from gpuherd.metrics import read_statuses
from gpuherd.security import check_token


def cmd_status(args: argparse.Namespace) -> int:
    async def run() -> dict[str, Any]:
        log_ = await open_cli_log(args)
        try:
            statuses, unreadable = read_statuses(await log_.kv_entries(STATUS_BUCKET))
            nats = await nats_overview(log_, nats_monitor_urls(args))
            return {"services": statuses, "unreadable": unreadable, "nats": nats}
        finally:
            await log_.close()

    view = asyncio.run(run())
    running = {s.service for s in view["services"]}
    expected = registry.required()  # a deployment without one of these is degraded, and status says so
    view["degraded"] = (
        [f"{m} is not running" for m in expected if m not in running]
        + [
            f"{st['name']} has a replica behind"
            for st in view["nats"]["streams"]
            if any(not p["current"] or p["offline"] for p in st["peers"])
        ]
        + [
            f"NATS {d['server']} fsyncs every {d['sync']}: a power cut loses acknowledged jobs"
            for d in view["nats"]["durability"]
            if d["durable"] is False
        ]
    )
    if args.json:
        print(msgspec.json.encode(view).decode())
        return 1 if view["degraded"] else 0
    now = time.time()
    table = Table(title="services", title_justify="left")
    for col in ("service", "role", "folded", "lag", "decisions", "dead", "seen", "metrics"):
        table.add_column(col, justify="right" if col in ("folded", "lag", "decisions", "dead", "seen") else "left")
    for s in view["services"]:
        lag = f"[red]{s.lag}[/red]" if s.lag > 1000 else str(s.lag)
        where = s.metrics_url.removeprefix("http://").removesuffix("/metrics")
        table.add_row(
            s.service,
            s.role,
            str(s.seq),
            lag,
            str(s.decisions),
            str(s.dead_letters),
            f"{now - s.updated_at:.0f}s",
            where,
        )
    for missing in expected:
        if missing not in running:
            table.add_row(missing, "[red]not running[/red]", "", "", "", "", "", "")
    console.print(table)
    for entry in view["unreadable"]:
        console.print(
            f"[yellow]unreadable status entry {plain(entry['key'])}:[/yellow] {plain(entry['error'])}", highlight=False
        )
    nats_view = view["nats"]
    console.print(
        f"NATS: connected to [bold]{nats_view['server']}[/bold] ({nats_view['version']}), "
        f"cluster {nats_view['cluster'] or '(none: a single server)'}",
        highlight=False,
    )
    streams = Table(title="streams", title_justify="left")
    for col in ("stream", "messages", "bytes", "storage", "replicas", "leader", "peers (current / lag)"):
        streams.add_column(col)
    for st in nats_view["streams"]:
        peers = ", ".join(
            f"{p['name']} ({'ok' if p['current'] and not p['offline'] else '[red]behind[/red]'} / {p['lag']})"
            for p in st["peers"]
        )
        streams.add_row(
            st["name"],
            str(st["messages"]),
            _size(st["bytes"]),
            st.get("storage", "?"),
            str(st["replicas"]),
            st["leader"] or "-",
            peers,
        )
    console.print(streams)
    if any(st["name"] == HERD_INTAKE and st.get("storage") == "memory" for st in nats_view["streams"]):
        console.print(
            f"[yellow]{HERD_INTAKE} keeps submissions in memory (GPUHERD_INTAKE_STORAGE=memory):[/yellow] one not "
            "yet judged is lost if every server holding it stops (its client gets no verdict and may resubmit); "
            "accepted jobs are not, their verdicts are in the log",
            highlight=False,
        )
    durability = nats_view["durability"]
    if not durability:
        console.print(
            "durability: unknown (set NATS_MONITOR_URL to the servers' monitoring endpoints, e.g. http://nats-1:8222)",
            highlight=False,
        )
    for d in durability:
        if d["durable"]:
            how = "[green]fsync before every acknowledgement (sync_interval: always)[/green]"
        elif d["durable"] is False:
            how = f"[red]fsync every {d['sync']}: a power cut loses what was acknowledged since[/red]"
        else:
            how = f"[yellow]unknown ({d.get('error', '')})[/yellow]"
        console.print(f"durability of {d['server']}: {how}", highlight=False)
    for problem in view["degraded"]:
        console.print(f"[red]degraded:[/red] {problem}", highlight=False)
    return 1 if view["degraded"] else 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n:.1f} TiB"


def cmd_log_init(args: argparse.Namespace) -> int:
    """Create (or update) the streams and buckets: the deployment's one-shot step, run as admin."""

    async def run() -> list[str]:
        log_ = await open_log(nats_url_of(args), name="gpuherd-init", persistent=False, streams="create")
        try:
            lines = []
            for config in log_.stream_configs():  # type: ignore[attr-defined]
                si = await log_.js.stream_info(config.name)  # type: ignore[attr-defined]
                lines.append(f"{config.name}: {si.config.num_replicas} replica(s), {si.state.messages} messages")
            return lines
        finally:
            await log_.close()

    for line in asyncio.run(run()):
        console.print(line, highlight=False)
    return 0


def cmd_nats_accounts(args: argparse.Namespace) -> int:
    try:
        nodes = [check_token("node", n) for n in _names(args.nodes)]
        sources = [check_token("source", s) for s in _names(args.sources)]
    except ValueError as exc:
        raise GpuherdError(str(exc)) from None
    print(accounts(nodes, sources), end="")
    return 0


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_commands(sub: Any) -> None:
    st = sub.add_parser("status", help="services (role, lag, decisions), the NATS cluster and its streams")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.set_defaults(func=cmd_status)

    lg = sub.add_parser("log", help="the event log's streams")
    lg_sub = lg.add_subparsers(dest="log_command", required=True)
    init = lg_sub.add_parser("init", help="create or update the streams and buckets (as a user allowed to)")
    init.set_defaults(func=cmd_log_init)

    sec = sub.add_parser("security", help="NATS accounts and permissions for each role")
    sec_sub = sec.add_subparsers(dest="security_command", required=True)
    acc = sec_sub.add_parser("nats-accounts", help="print the accounts block of nats-server.conf")
    acc.add_argument("--nodes", default=",".join(COMPOSE_NODES), help="agents' node names, comma-separated")
    acc.add_argument("--sources", default=",".join(COMPOSE_SOURCES), help="submitters' sources, comma-separated")
    acc.set_defaults(func=cmd_nats_accounts)
