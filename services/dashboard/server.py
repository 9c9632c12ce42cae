"""The dashboard's HTTP side: pages, ``/api/`` JSON, server-sent events, operator actions.

Read-only unless an operator token was given at start; an action (cancel, drain, undrain, running
the audit) carries it as ``Authorization: Bearer <token>`` (a header, never a cookie, so another site
cannot make a browser send it). Every action goes through the same client calls as the CLI, with the
same checks. Pages are built in the browser with ``textContent`` only, and the Content-Security-Policy
allows scripts from this server alone, so a job named ``<script>...`` is text. Every asset is served
from ``static/`` (no CDN).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from gpuherd.client import MAX_REASON_CHARS  # (checked here too: a 400 before any client call)
from gpuherd.errors import GpuherdError, LogUnavailable
from gpuherd.security import check_token
from services.dashboard.view import DashboardView

# How long an operator action waits for the log to take it. With NATS frozen or partitioned away the
# append waits on and on, and the page's button said nothing: a 503 says "not yet, try again".
ACTION_TIMEOUT_S = 10.0

STATIC = Path(__file__).parent / "static"
PUSH_EVERY_S = 0.1  # how often an open page's stream looks for a change
# An open page hears from its stream at least this often: a change, or else a beat. Each says how
# long NATS has been silent, and a page that hears nothing for a few beats says its data is stale.
# (A frozen or partitioned NATS keeps every connection open: the stream alone looked live.)
BEAT_S = 1.0
NATS_STALE_S = 3.0  # NATS silent this long (the service asks it every second): the page's data is stale
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
    nats_silent_s: Callable[[], float] = lambda: 0.0  # seconds since NATS last answered


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json", headers=headers)


def _error(status: int, message: str) -> web.Response:
    return _json({"ok": False, "error": message}, status)


def _no_job(job_id: str, ended_kept: int) -> str:
    return (
        f"no job {job_id!r}: see /api/jobs for the ids (the dashboard remembers the latest {ended_kept:,} jobs "
        f"to end; `gpuherd why {job_id}` reads the whole log)"
    )


@web.middleware
async def _secure(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    response = await handler(request)
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Call = Callable[[], Awaitable[None]]


class Routes:
    """One method per route; ``make_app`` lists them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.view = backend.view
        self.audit_lock = asyncio.Lock()

    # -- pages, health, metrics -------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def healthz(self, request: web.Request) -> web.Response:
        return _json({"ok": True, "ready": self.backend.ready(), "seq": self.view.state.seq})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.backend.ready()
        return _json({"ready": ready, "seq": self.view.state.seq}, 200 if ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.backend.metrics(), content_type="text/plain", charset="utf-8")

    async def session(self, request: web.Request) -> web.Response:
        return _json({"actions": self.backend.operator_token is not None, "ready": self.backend.ready()})

    # -- views --------------------------------------------------------------------------------------

    async def overview(self, request: web.Request) -> web.Response:
        return _json(self.view.overview())

    async def queue(self, request: web.Request) -> web.Response:
        return _json(self.view.queue_view())

    async def jobs(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = min(int(q.get("limit", "200")), 5_000)
            offset = max(int(q.get("offset", "0")), 0)
        except ValueError:
            return _error(400, "limit and offset are whole numbers (e.g. ?limit=200&offset=0)")
        if limit < 0:  # a negative slice end would drop jobs from the end of the page instead
            return _error(400, f"limit must be 0 or more, got {limit}")
        try:
            total, rows = self.view.jobs(
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

    async def job(self, request: web.Request) -> web.Response:
        found = self.view.job(request.match_info["job"])
        if found is None:
            return _error(404, _no_job(request.match_info["job"], self.view.ended_kept))
        return _json(found)

    async def output(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job"]
        if job_id not in self.view.state.jobs:
            return _error(404, _no_job(job_id, self.view.ended_kept))
        return _json(await self.backend.output(job_id))

    async def nodes(self, request: web.Request) -> web.Response:
        return _json(self.view.nodes())

    async def vcs(self, request: web.Request) -> web.Response:
        return _json(self.view.vcs())

    async def history(self, request: web.Request) -> web.Response:
        return _json(self.view.history_view())

    async def usage(self, request: web.Request) -> web.Response:
        return _json(self.view.usage_view())

    async def workflows(self, request: web.Request) -> web.Response:
        return _json(self.view.workflow_list())

    async def workflow(self, request: web.Request) -> web.Response:
        found = self.view.workflow(request.match_info["workflow"])
        if found is None:
            return _error(404, f"no workflow {request.match_info['workflow']!r}: see /api/workflows for the ids")
        return _json(found)

    async def services(self, request: web.Request) -> web.Response:
        return _json(await self.backend.services())

    # -- audit and reports --------------------------------------------------------------------------

    async def audit_get(self, request: web.Request) -> web.Response:
        return _json(self.view.last_audit)

    async def audit_run(self, request: web.Request) -> web.Response:
        # An operator action like the others: it re-runs every decision of the whole log, which anyone
        # who could reach the page could otherwise start again and again.
        refused = self._refusal(request)
        if refused is not None:
            return refused
        if self.backend.audit is None:
            return _error(501, "this dashboard was started without the deciders, so it cannot audit")
        if self.audit_lock.locked():
            return _error(409, "an audit is running; its result will be at GET /api/audit")
        async with self.audit_lock:
            self.view.last_audit = await self.backend.audit()
        return _json(self.view.last_audit)

    async def reports(self, request: web.Request) -> web.Response:
        return _json(_report_names(self.backend.reports_dir))

    async def report(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        folder = self.backend.reports_dir
        if folder is None or name not in _report_files(folder):
            return _error(404, f"no report file {name!r}: see /api/reports")
        return web.FileResponse(folder / name)

    # -- live updates -------------------------------------------------------------------------------

    def _link(self) -> dict[str, Any]:
        """What every message of the stream says: the log position, and whether the data is fresh."""
        silent = self.backend.nats_silent_s()
        return {
            "seq": self.view.state.seq,
            "ready": self.backend.ready(),
            "nats_silent_s": round(silent, 1),
            "stale": silent >= NATS_STALE_S,
            "beat_s": BEAT_S,
        }

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: ``change`` (with the log position) whenever the view changed, and a
        ``beat`` after ``BEAT_S`` without one; both say how long NATS has been silent."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        view, sent, said = self.view, -1, time.monotonic()
        try:
            while True:
                view.settle_queue()  # (a reused answer replaced by a current one is a change too)
                if view.version != sent:
                    sent = view.version
                    data = json.dumps({"version": sent} | self._link())
                    await response.write(f"event: change\ndata: {data}\n\n".encode())
                    said = time.monotonic()
                elif time.monotonic() - said >= BEAT_S:
                    await response.write(f"event: beat\ndata: {json.dumps(self._link())}\n\n".encode())
                    said = time.monotonic()
                await asyncio.sleep(PUSH_EVERY_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    # -- operator actions ---------------------------------------------------------------------------

    def _refusal(self, request: web.Request) -> web.Response | None:
        """None if the request may act; else the refusal."""
        token = self.backend.operator_token
        if token is None:
            return _error(403, "this dashboard is read-only: start it with --operator-token-file to allow actions")
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not given or not _is_token(given, token):
            return _error(401, "a valid operator token is needed (Authorization: Bearer <token>)")
        return None

    async def _act(self, request: web.Request, action: Callable[[str], tuple[Call, str]], default: str) -> web.Response:
        """Refused without the token; else ``action(reason)`` gives the client call and what to say
        once made; the client's own checks answer 404 (unknown job or node) or 400, a log that cannot
        take it now 503."""
        refused = self._refusal(request)
        if refused is not None:
            return refused
        try:
            reason = await _reason_of(request)
        except BadBody as exc:
            return _error(400, str(exc))
        if len(reason) > MAX_REASON_CHARS:
            return _error(
                400, f"a reason is at most {MAX_REASON_CHARS} characters (it goes in the log); got {len(reason)}"
            )
        call, done = action(reason or default)
        try:
            await asyncio.wait_for(call(), ACTION_TIMEOUT_S)
        except LogUnavailable as exc:  # (the request was right; the log cannot take it now: try again)
            return _error(503, str(exc))
        except TimeoutError:
            return _error(
                503,
                f"the log did not take it within {ACTION_TIMEOUT_S:g}s (NATS away or slow); it may yet be recorded "
                "when NATS answers: look before you try again",
            )
        except GpuherdError as exc:
            return _error(404 if "no job" in str(exc) or "no node" in str(exc) else 400, str(exc))
        return _json({"ok": True, "done": done})

    async def cancel(self, request: web.Request) -> web.Response:
        job = request.match_info["job"]
        cancel = self.backend.actions.cancel

        async def checked(reason: str) -> None:
            _check_subject_token("job", job)  # a wildcard ('*', '>') would name every job's subject
            await cancel(job, reason)

        def action(reason: str) -> tuple[Call, str]:
            return (lambda: checked(reason)), f"cancel requested for {job}"

        return await self._act(request, action, "cancelled from the dashboard")

    async def drain(self, request: web.Request) -> web.Response:
        return await self._drain(request, undrain=False)

    async def undrain(self, request: web.Request) -> web.Response:
        return await self._drain(request, undrain=True)

    async def _drain(self, request: web.Request, *, undrain: bool) -> web.Response:
        node = request.match_info["node"]
        drain = self.backend.actions.drain
        done = f"{'undrained' if undrain else 'drained'} {node}"
        default = "" if undrain else "drained from the dashboard"

        async def checked(reason: str) -> None:
            _check_subject_token("node", node)  # a wildcard ('*', '>') matched every node's subject: "drained *"
            await drain(node, reason, undrain)

        return await self._act(request, lambda reason: ((lambda: checked(reason)), done), default)


def _check_subject_token(what: str, value: str) -> None:
    """A name that goes in a NATS subject is one token (an error the client's checks give: 400)."""
    try:
        check_token(what, value)
    except ValueError as exc:
        raise GpuherdError(str(exc)) from None


def _is_token(given: str, token: str) -> bool:
    """Whether the header gave the operator token, compared as bytes in constant time. A header that
    is not UTF-8 arrives with its bad bytes as surrogates, which a plain ``encode`` refuses: encoded
    as they came, they are simply not the token."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


class BadBody(Exception):
    """An action's body that cannot be taken as it is (answered 400 with the reason)."""


async def _reason_of(request: web.Request) -> str:
    """The reason an action's JSON body gives (``{"reason": "..."}``); none for a body that is not
    JSON or not text in its charset (the action is still asked for). ``BadBody`` for one nested too
    deep to parse or whose reason is not text."""
    if not request.can_read_body:
        return ""
    try:
        body = await request.json()
    except RecursionError:  # (JSON nested deeper than the parser's stack: "[[[[...")
        raise BadBody('the body nests too deep to be read as JSON; send {"reason": "..."}') from None
    except (ValueError, LookupError):  # not JSON, not text in its charset, or an unknown charset: no reason
        return ""
    reason = str(body.get("reason", "")) if isinstance(body, dict) else ""
    try:
        reason.encode()
    except UnicodeEncodeError as exc:  # JSON's "\ud800": no text, and no event could carry it
        raise BadBody(
            f"the reason is not text: it holds a lone surrogate (\\u{ord(reason[exc.start]):04x}) at "
            f"character {exc.start}"
        ) from None
    return reason


def make_app(backend: Backend) -> web.Application:
    app = web.Application(middlewares=[_secure])
    r = Routes(backend)
    get: dict[str, Handler] = {
        "/": r.index,
        "/healthz": r.healthz,
        "/readyz": r.readyz,
        "/metrics": r.metrics,
        "/api/session": r.session,
        "/api/overview": r.overview,
        "/api/queue": r.queue,
        "/api/jobs": r.jobs,
        "/api/jobs/{job}": r.job,
        "/api/jobs/{job}/output": r.output,
        "/api/nodes": r.nodes,
        "/api/vcs": r.vcs,
        "/api/history": r.history,
        "/api/usage": r.usage,
        "/api/workflows": r.workflows,
        "/api/workflows/{workflow}": r.workflow,
        "/api/services": r.services,
        "/api/audit": r.audit_get,
        "/api/reports": r.reports,
        "/reports/{name}": r.report,
        "/api/stream": r.stream,
    }
    post: dict[str, Handler] = {
        "/api/audit": r.audit_run,
        "/api/jobs/{job}/cancel": r.cancel,
        "/api/nodes/{node}/drain": r.drain,
        "/api/nodes/{node}/undrain": r.undrain,
    }
    for path, handler in get.items():
        app.router.add_get(path, handler)
    for path, handler in post.items():
        app.router.add_post(path, handler)
    app.router.add_static("/static/", STATIC, append_version=False)
    return app


def _report_files(folder: Path) -> set[str]:
    """The files a report folder holds at its top (reports link their plots by bare name)."""
    if not folder.is_dir():
        return set()
    return {p.name for p in folder.iterdir() if p.is_file() and p.suffix in (".html", ".png", ".svg", ".json")}


def _report_names(folder: Path | None) -> list[str]:
    return sorted(n for n in _report_files(folder) if n.endswith(".html")) if folder is not None else []
