"""The dashboard's HTTP side: pages, ``/api/`` JSON, server-sent events, operator actions.

Read-only unless an operator token was given at start; an action carries it as ``Authorization:
Bearer <token>`` (a header, never a cookie, so another site cannot make a browser send it). Every
action goes through the same client calls as the CLI, with the same checks. Pages are built in the
browser with ``textContent`` only, and the Content-Security-Policy allows scripts from this server
alone, so a job named ``<script>...`` is text. Every asset is served from ``static/`` (no CDN).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from gpuherd.errors import GpuherdError
from services.dashboard.view import DashboardView

STATIC = Path(__file__).parent / "static"
PUSH_EVERY_S = 0.1  # how often an open page's stream looks for a change
KEEPALIVE_S = 15.0
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "frame-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'self'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Actions:
    """What an operator action does, given the checked request: the CLI's own client calls."""

    cancel: Callable[[str, str], Awaitable[None]]
    drain: Callable[[str, str, bool], Awaitable[None]]


@dataclass
class Backend:
    """What the HTTP side needs from the running service."""

    view: DashboardView
    ready: Callable[[], bool]
    services: Callable[[], Awaitable[dict[str, Any]]]
    audit: Callable[[], Awaitable[dict[str, Any]]] | None
    actions: Actions
    metrics: Callable[[], bytes]
    output: Callable[[str], Awaitable[list[dict[str, Any]]]]
    operator_token: str | None = None
    reports_dir: Path | None = None


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json", headers=headers)


def _error(status: int, message: str) -> web.Response:
    return _json({"ok": False, "error": message}, status)


@web.middleware
async def _secure(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    response = await handler(request)
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


def make_app(backend: Backend) -> web.Application:
    app = web.Application(middlewares=[_secure])
    view = backend.view
    audit_lock = asyncio.Lock()

    async def index(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def healthz(request: web.Request) -> web.Response:
        return _json({"ok": True, "ready": backend.ready(), "seq": view.state.seq})

    async def readyz(request: web.Request) -> web.Response:
        ready = backend.ready()
        return _json({"ready": ready, "seq": view.state.seq}, 200 if ready else 503)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=backend.metrics(), content_type="text/plain", charset="utf-8")

    async def overview(request: web.Request) -> web.Response:
        return _json(view.overview())

    async def queue(request: web.Request) -> web.Response:
        return _json(view.queue_view())

    async def jobs(request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = min(int(q.get("limit", "200")), 5_000)
            offset = max(int(q.get("offset", "0")), 0)
            total, rows = view.jobs(
                status=q.get("status") or None,
                user=q.get("user") or None,
                vc=q.get("vc") or None,
                name=q.get("name") or None,
                sort=q.get("sort", "-order"),
                limit=limit,
                offset=offset,
            )
        except ValueError as exc:
            return _error(400, str(exc))
        return _json(rows, headers={"X-Total-Count": str(total)})

    async def job(request: web.Request) -> web.Response:
        found = view.job(request.match_info["job"])
        if found is None:
            return _error(404, f"no job {request.match_info['job']!r}: see /api/jobs for the ids")
        return _json(found)

    async def output(request: web.Request) -> web.Response:
        job_id = request.match_info["job"]
        if job_id not in view.state.jobs:
            return _error(404, f"no job {job_id!r}: see /api/jobs for the ids")
        return _json(await backend.output(job_id))

    async def nodes(request: web.Request) -> web.Response:
        return _json(view.nodes())

    async def vcs(request: web.Request) -> web.Response:
        return _json(view.vcs())

    async def history(request: web.Request) -> web.Response:
        return _json(view.history_view())

    async def services(request: web.Request) -> web.Response:
        return _json(await backend.services())

    async def audit_get(request: web.Request) -> web.Response:
        return _json(view.last_audit)

    async def audit_run(request: web.Request) -> web.Response:
        if backend.audit is None:
            return _error(501, "this dashboard was started without the deciders, so it cannot audit")
        if audit_lock.locked():
            return _error(409, "an audit is running; its result will be at GET /api/audit")
        async with audit_lock:
            view.last_audit = await backend.audit()
        return _json(view.last_audit)

    async def reports(request: web.Request) -> web.Response:
        return _json(_report_names(backend.reports_dir))

    async def report(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        folder = backend.reports_dir
        if folder is None or name not in _report_files(folder):
            return _error(404, f"no report file {name!r}: see /api/reports")
        return web.FileResponse(folder / name)

    async def stream(request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``change`` (with the log position) whenever the view changed."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        sent, quiet = -1, 0.0
        try:
            while True:
                if view.version != sent:
                    sent = view.version
                    data = json.dumps({"version": sent, "seq": view.state.seq, "ready": backend.ready()})
                    await response.write(f"event: change\ndata: {data}\n\n".encode())
                    quiet = 0.0
                elif quiet >= KEEPALIVE_S:
                    await response.write(b": keep-alive\n\n")
                    quiet = 0.0
                await asyncio.sleep(PUSH_EVERY_S)
                quiet += PUSH_EVERY_S
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    def authorized(request: web.Request) -> web.Response | None:
        """None if the request may act; else the refusal."""
        if backend.operator_token is None:
            return _error(403, "this dashboard is read-only: start it with --operator-token-file to allow actions")
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not given or not hmac.compare_digest(given.encode(), backend.operator_token.encode()):
            return _error(401, "a valid operator token is needed (Authorization: Bearer <token>)")
        return None

    async def reason_of(request: web.Request) -> str:
        if not request.can_read_body:
            return ""
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return ""
        return str(body.get("reason", "")) if isinstance(body, dict) else ""

    Action = Callable[[web.Request, str], tuple[Callable[[], Awaitable[None]], str]]

    def operator_action(what: Action, default_reason: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        """A POST that acts: refused without the token, else ``what(request, reason)`` gives the client
        call to make and what to say once made; the client's own checks answer 404 or 400."""

        async def handle(request: web.Request) -> web.Response:
            refused = authorized(request)
            if refused is not None:
                return refused
            call, done = what(request, await reason_of(request) or default_reason)
            try:
                await call()
            except GpuherdError as exc:
                return _error(404 if "no job" in str(exc) or "no node" in str(exc) else 400, str(exc))
            return _json({"ok": True, "done": done})

        return handle

    def cancel(request: web.Request, reason: str) -> tuple[Callable[[], Awaitable[None]], str]:
        job_id = request.match_info["job"]
        return (lambda: backend.actions.cancel(job_id, reason)), f"cancel requested for {job_id}"

    def drain(undrain: bool) -> Action:
        def call(request: web.Request, reason: str) -> tuple[Callable[[], Awaitable[None]], str]:
            node = request.match_info["node"]
            done = f"{'undrained' if undrain else 'drained'} {node}"
            return (lambda: backend.actions.drain(node, reason, undrain)), done

        return call

    async def whoami(request: web.Request) -> web.Response:
        return _json({"actions": backend.operator_token is not None, "ready": backend.ready()})

    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/queue", queue)
    app.router.add_get("/api/jobs", jobs)
    app.router.add_get("/api/jobs/{job}", job)
    app.router.add_get("/api/jobs/{job}/output", output)
    app.router.add_post("/api/jobs/{job}/cancel", operator_action(cancel, "cancelled from the dashboard"))
    app.router.add_get("/api/nodes", nodes)
    app.router.add_post("/api/nodes/{node}/drain", operator_action(drain(False), "drained from the dashboard"))
    app.router.add_post("/api/nodes/{node}/undrain", operator_action(drain(True), ""))
    app.router.add_get("/api/vcs", vcs)
    app.router.add_get("/api/history", history)
    app.router.add_get("/api/services", services)
    app.router.add_get("/api/audit", audit_get)
    app.router.add_post("/api/audit", audit_run)
    app.router.add_get("/api/reports", reports)
    app.router.add_get("/reports/{name}", report)
    app.router.add_get("/api/stream", stream)
    app.router.add_get("/api/session", whoami)
    app.router.add_static("/static/", STATIC, append_version=False)
    return app


def _report_files(folder: Path) -> set[str]:
    """The files a report folder holds at its top (reports link their plots by bare name)."""
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".html", ".png", ".svg", ".json")}


def _report_names(folder: Path | None) -> list[str]:
    return sorted(n for n in _report_files(folder) if n.endswith(".html")) if folder is not None else []
