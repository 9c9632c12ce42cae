"""The dashboard's read model and its HTTP side, on hand-made histories (the live service and the
pages in a browser are tested in tests/e2e/test_dashboard_browser.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpuherd import events as ev
from gpuherd.log import Record
from services.dashboard.server import NATS_STALE_S, Actions, Backend, make_app
from services.dashboard.view import HISTORY_BUCKET_S, DashboardView
from services.scheduler.explain import SchedulerQueue
from tests.helpers import node, submit

TOKEN = "a-token-of-sixteen-chars"


def placed(job: str, node_name: str, gpus: tuple[int, ...], *, at: float, cause: str, attempt: int = 0) -> ev.JobPlaced:
    return ev.JobPlaced(
        id=f"place-{job}-{attempt}",
        at=at,
        source="scheduler",
        cause=cause,
        based_on=1,
        job=job,
        attempt=attempt,
        allocations=(ev.Allocation(node_name, gpus),),
    )


def history() -> list[Record]:
    events: list[ev.Event] = [
        node("n1", 4, island=2, rack="r1"),
        node("n2", 4, rack="r2"),
        submit("a", 4, at=10.0),
        submit("b", 8, at=20.0),
        submit("c", 2, at=30.0),
    ]
    events.append(placed("a", "n1", (0, 1, 2, 3), at=12.0, cause=events[2].id))
    events.append(ev.JobStarted(id="start-a", at=13.0, source="agent.n1", job="a", attempt=0, node="n1"))
    events.append(placed("c", "n2", (0, 1), at=200.0, cause=events[4].id))
    finished = ev.JobFinished(id="fin-a", at=300.0, source="scheduler", job="a", attempt=0, outcome="completed")
    events.append(finished)
    return [Record(seq, event) for seq, event in enumerate(events, 1)]


def folded(queue: Any = None) -> DashboardView:
    view = DashboardView(queue)
    view.fold_all(history())
    return view


def test_the_overview_counts_gpus_and_jobs_and_maps_every_gpu() -> None:
    view = folded()
    o = view.overview()
    assert o["gpus"] == {"free": 6, "busy": 2, "unhealthy": 0, "drained": 0, "powered_off": 0, "lost": 0}
    assert o["jobs"]["waiting"] == 1 and o["jobs"]["placed"] == 1 and o["jobs"]["ended"] == {"completed": 1}
    racks = {r["rack"]: r["nodes"] for r in o["racks"]}
    assert [n["node"] for n in racks["r1"]] == ["n1"]
    assert [[gpu[0] for gpu in island] for island in racks["r1"][0]["islands"]] == [[0, 1], [2, 3]]
    busy = [gpu for island in racks["r2"][0]["islands"] for gpu in island if gpu[1] == "busy"]
    assert busy == [[0, "busy", "c"], [1, "busy", "c"]]
    # Decision latency: each placement against its cause (no stored times here: the events' clock).
    assert sorted(view.latencies) == [2.0, 170.0]


def test_a_job_has_its_timeline_with_causes_and_where_it_ran() -> None:
    view = folded()
    job = view.job("a")
    assert job is not None and job["status"] == "completed"
    assert [e["what"] for e in job["timeline"]] == ["submitted", "placed", "started", "finished"]
    assert job["timeline"][1]["cause"] == job["timeline"][0]["id"]
    assert view.placements["a"] == [(0, ["n1"])]
    assert view.job("nope") is None


def test_a_report_stored_twice_shows_once_in_the_timeline() -> None:
    """A report relay's page and its agent's own append may both hold it (``gpuherd.log.relay``)."""
    records = history()
    started = next(r.event for r in records if isinstance(r.event, ev.JobStarted))
    at = next(n for n, r in enumerate(records) if r.event is started) + 1
    twice = [*records[:at], Record(at + 1, started), *(Record(r.seq + 1, r.event) for r in records[at:])]
    view = DashboardView(None)
    view.fold_all(twice)
    assert [r.seq for r in twice] == list(range(1, len(records) + 2))
    assert [e["what"] for e in view.job("a")["timeline"]] == ["submitted", "placed", "started", "finished"]


def test_jobs_filter_and_sort_and_refuse_an_unknown_sort() -> None:
    view = folded()
    total, rows = view.jobs(status="pending")
    assert total == 1 and rows[0]["job"] == "b"
    assert [r["job"] for r in view.jobs(sort="-gpus")[1]] == ["b", "a", "c"]
    assert [r["job"] for r in view.jobs(sort="order", limit=2)[1]] == ["a", "b"]
    assert view.jobs(name="B")[0] == 1  # a part of the name, any case
    with pytest.raises(ValueError, match="cannot sort jobs by 'colour'"):
        view.jobs(sort="colour")


def test_history_samples_busy_gpus_by_vc_and_the_queue_once_a_bucket() -> None:
    view = folded()
    h = view.history_view()
    # A sample as each bucket with events begins (the state at its start, before its events), and now.
    assert h["at"] == [3 * HISTORY_BUCKET_S, 5 * HISTORY_BUCKET_S, 300.0]
    assert h["queue"] == [2, 1, 1]
    assert h["busy"] == {"default": [4, 6, 2]}  # a; a and c, before a finished; c


def test_the_queue_is_the_schedulers_own_explanation() -> None:
    view = folded(SchedulerQueue())
    q = view.queue_view()
    assert q["policy"] == "fifo"
    [row] = q["waiting"]
    assert row["job"] == "b" and row["position"] == 1 and row["gpus"] == 8
    assert row["kind"] and row["why"]  # the scheduler's words (8 GPUs on one node of 4: never fits here)
    assert view.job("b")["why"] == row["why"]


def test_telemetry_keeps_short_rings_per_gpu_and_per_job() -> None:
    view = folded()
    for n in range(200):
        view.telemetry("n1.gpus", {"node": "n1", "at": n, "gpus": [{"index": 0, "utilization_pct": n}]})
        view.telemetry("n1.job.a", {"job": "a", "at": n, "step": n, "values": {"loss": 1.0 / (n + 1)}})
    samples = next(n for n in view.nodes() if n["node"] == "n1")["gpus"][0]["samples"]
    assert len(samples) == 120 and samples[-1][1] == 199
    assert view.job("a")["progress"][-1]["loss"] == pytest.approx(1 / 200)


@pytest.fixture
async def client() -> AsyncIterator[Any]:
    clients = []

    async def make(token: str | None) -> TestClient:
        async def never(*args: Any) -> None:
            raise AssertionError("an action ran that should have been refused")

        async def no_services() -> dict[str, Any]:
            return {}

        async def no_output(job: str) -> list[dict[str, Any]]:
            return []

        backend = Backend(
            view=folded(),
            ready=lambda: True,
            services=no_services,
            audit=None,
            actions=Actions(cancel=never, drain=never),
            metrics=lambda: b"",
            output=no_output,
            operator_token=token,
        )
        c = TestClient(TestServer(make_app(backend)))
        await c.start_server()
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


async def test_the_api_answers_with_json_and_a_strict_content_policy(client: Any) -> None:
    c = await client(None)
    response = await c.get("/api/jobs?status=pending")
    assert response.status == 200 and response.headers["X-Total-Count"] == "1"
    assert [j["job"] for j in await response.json()] == ["b"]
    assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    assert (await c.get("/api/jobs/nope")).status == 404
    assert (await c.get("/api/jobs?sort=colour")).status == 400
    assert (await c.get("/api/audit", allow_redirects=False)).status == 200
    assert (await c.post("/api/audit")).status == 403  # running it is an operator action
    page = await c.get("/")
    assert page.status == 200 and "gpuherd" in await page.text()
    assert (await c.get("/static/vendor/uPlot.iife.min.js")).status == 200


async def test_actions_are_refused_without_the_token(client: Any) -> None:
    read_only = await client(None)
    response = await read_only.post("/api/nodes/n1/drain")
    assert response.status == 403 and "read-only" in (await response.json())["error"]
    guarded = await client(TOKEN)
    assert (await guarded.post("/api/nodes/n1/drain")).status == 401
    wrong = await guarded.post("/api/jobs/a/cancel", headers={"Authorization": "Bearer not-the-token-at-all"})
    assert wrong.status == 401


async def test_running_the_audit_needs_the_operator_token_as_every_action_does() -> None:
    """POST /api/audit re-runs every decision of the whole log: anyone who could reach the page could
    start it, again and again, while cancel and drain asked for the token."""
    runs: list[float] = []

    async def audit() -> dict[str, Any]:
        runs.append(0.0)
        return {"ok": True, "deciders": {}}

    guarded = _acting(Actions(cancel=_never, drain=_never))
    guarded.audit = audit
    read_only = _acting(Actions(cancel=_never, drain=_never))
    read_only.audit, read_only.operator_token = audit, None
    async with TestClient(TestServer(make_app(read_only))) as c:
        response = await c.post("/api/audit")
        assert response.status == 403 and "read-only" in (await response.json())["error"]
    async with TestClient(TestServer(make_app(guarded))) as c:
        for headers in ({}, {"Authorization": "Bearer not-the-token-at-all"}):
            response = await c.post("/api/audit", headers=headers)
            assert response.status == 401, headers
            assert (await response.json())["error"] == (
                "a valid operator token is needed (Authorization: Bearer <token>)"
            )  # the words cancel and drain answer with
        assert runs == []
        response = await c.post("/api/audit", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 200 and (await response.json())["ok"] is True
        assert len(runs) == 1
        assert await (await c.get("/api/audit")).json() == {"ok": True, "deciders": {}}  # (reading it needs none)
    guarded.audit = None
    async with TestClient(TestServer(make_app(guarded))) as c:
        response = await c.post("/api/audit", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 501  # no deciders handed in: it says so


async def _never(*args: Any) -> None:
    raise AssertionError("an action ran that should not have")


async def test_the_stream_says_when_the_view_changed(client: Any) -> None:
    c = await client(None)
    response = await c.get("/api/stream")
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
    assert first.startswith(b"event: change\ndata: ") and b'"seq": 9' in first
    response.close()


def _sse(message: bytes) -> tuple[str, dict[str, Any]]:
    """A server-sent event's name and its JSON data."""
    fields = dict(line.split(": ", 1) for line in message.decode().strip().split("\n"))
    return fields["event"], json.loads(fields["data"])


async def test_the_stream_beats_while_nothing_changes_and_says_when_nats_went_silent(monkeypatch: Any) -> None:
    """A frozen NATS (SIGSTOPped, partitioned) keeps every connection open and the stream simply
    went quiet, as on a quiet cluster: the page's badge said "live" through it. Now the stream beats
    when nothing changes, and every message says how long NATS has been silent."""
    monkeypatch.setattr("services.dashboard.server.BEAT_S", 0.2)
    silent = [0.4]
    backend = _acting(Actions(cancel=_never, drain=_never))
    backend.nats_silent_s = lambda: silent[0]
    async with TestClient(TestServer(make_app(backend))) as c:
        response = await c.get("/api/stream")

        async def heard() -> tuple[str, dict[str, Any]]:
            return _sse(await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5))

        event, data = await heard()
        assert event == "change" and data["seq"] == 9 and data["ready"] is True
        assert data["stale"] is False and data["nats_silent_s"] == 0.4 and data["beat_s"] == 0.2
        started = time.monotonic()
        assert await heard() == ("beat", {k: v for k, v in data.items() if k != "version"})
        assert time.monotonic() - started >= 0.15  # (a beat once nothing was said for BEAT_S)
        silent[0] = NATS_STALE_S + 0.5
        event, data = await heard()
        assert event == "beat" and data["stale"] is True and data["nats_silent_s"] == NATS_STALE_S + 0.5
        silent[0] = 0.1  # NATS answers again
        event, data = await heard()
        assert event == "beat" and data["stale"] is False
        response.close()


def test_metrics_say_the_queue_per_vc_and_the_connection_at_every_scrape() -> None:
    from gpuherd.metrics import ServiceMetrics, parse_metrics

    view = folded()
    metrics = ServiceMetrics("dashboard")
    metrics.watch_cluster(lambda: view.state)
    connected = [True]
    metrics.watch_connection(lambda: connected[0])
    scraped = parse_metrics(metrics.render().decode())
    assert scraped['gpuherd_queue_jobs{vc="default"}'] == 1
    assert scraped['gpuherd_queue_gpus{vc="default"}'] == 8
    assert scraped["gpuherd_nats_connected"] == 1
    connected[0] = False
    assert parse_metrics(metrics.render().decode())["gpuherd_nats_connected"] == 0


def test_usage_and_workflows_come_from_the_log_as_gpuherd_usage_has_them() -> None:
    from apps.sim.engine import Simulation
    from gpuherd.fold.accounting import Accounting
    from tests.unit.test_workflows import job, pipeline, simulate

    sim: Simulation = simulate([(1.0, pipeline()), (2.0, job("sweep", duration=5, array={"count": 3}))])
    view = DashboardView(SchedulerQueue())
    view.fold_all(sim.records)
    usage = view.usage_view()
    cli = Accounting(by=("vc", "user")).fold_all(sim.records).report()
    assert usage["total"] == cli["total"] and usage["total"]["gpu_seconds"] == 10 + 60 + 5 + 15
    assert usage["by_vc"] == {"default": [pytest.approx(90 / 3600)]} and usage["at"] == [0.0]
    (listed,) = view.workflow_list()
    assert listed["name"] == "pipe" and listed["status"] == "completed" and listed["steps"] == 3
    graph = view.workflow(listed["workflow"])
    assert graph is not None and [s["step"] for s in graph["steps"]] == ["prep", "train", "eval"]
    assert graph["steps"][1]["depends"] == [{"kind": "afterok", "step": "prep"}]
    assert all(s["status"] == "completed" for s in graph["steps"])
    assert view.workflow("w-none") is None


async def test_the_jobs_page_refuses_a_negative_or_unreadable_limit(client: Any) -> None:
    c = await client(None)
    for query in ("limit=-1", "limit=-2", "limit=abc", "offset=1.5", "limit=" + "9" * 5000):
        response = await c.get(f"/api/jobs?{query}")
        assert response.status == 400, query
        assert "limit" in (await response.json())["error"], query
    everything = await c.get("/api/jobs?limit=0")
    assert everything.status == 200 and await everything.json() == [] and everything.headers["X-Total-Count"] == "3"


def _acting(actions: Actions) -> Backend:
    """A backend over the test view whose operator actions are ``actions`` (token ``TOKEN``)."""

    async def nothing(*args: Any) -> Any:
        return {}

    return Backend(
        view=folded(),
        ready=lambda: True,
        services=nothing,
        audit=None,
        actions=actions,
        metrics=lambda: b"",
        output=nothing,
        operator_token=TOKEN,
    )


async def test_an_action_with_a_body_that_is_not_text_still_acts() -> None:
    done: list[tuple[str, str]] = []

    async def cancel(job: str, reason: str) -> None:
        done.append((job, reason))

    async def drain(node: str, reason: str, undrain: bool) -> None:
        done.append((node, reason))

    async with TestClient(TestServer(make_app(_acting(Actions(cancel=cancel, drain=drain))))) as c:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        response = await c.post("/api/jobs/b/cancel", data=b"\xff\xfe", headers=auth)
        assert response.status == 200, await response.text()
        odd_charset = auth | {"Content-Type": "application/json; charset=no-such-charset"}
        response = await c.post("/api/nodes/n1/drain", data=b'{"reason": "x"}', headers=odd_charset)
        assert response.status == 200, await response.text()
    assert done == [("b", "cancelled from the dashboard"), ("n1", "drained from the dashboard")]


async def test_drain_refuses_a_node_name_that_is_a_subject_wildcard() -> None:
    drained: list[str] = []

    async def drain(node: str, reason: str, undrain: bool) -> None:
        drained.append(node)

    async def nothing(*args: Any) -> None:
        return None

    async with TestClient(TestServer(make_app(_acting(Actions(cancel=nothing, drain=drain))))) as c:
        for name in ("*", ">", "%2A"):
            response = await c.post(f"/api/nodes/{name}/drain", headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status == 400 and "subject token" in (await response.json())["error"], name
    assert drained == []


def test_a_vc_s_borrowed_gpus_are_its_use_beyond_its_quota_now() -> None:
    """A job's ``borrowed`` is frozen when it is placed; once its VC's older job ends the VC is back
    within its quota and borrows nothing, whatever that job borrowed then."""
    events: list[ev.Event] = [
        node("n1", 4),
        node("n2", 4),
        ev.VcConfigured(id="quota", at=1.0, source="op", vc="vision", gpu_quota=4),
        submit("a", 4, at=10.0, vc="vision"),
        submit("b", 4, at=11.0, vc="vision"),
    ]
    events.append(placed("a", "n1", (0, 1, 2, 3), at=12.0, cause=events[3].id))
    borrowing = msgspec.structs.replace(placed("b", "n2", (0, 1, 2, 3), at=13.0, cause=events[4].id), borrowed=4)
    view = DashboardView(None)
    view.fold_all([Record(seq, event) for seq, event in enumerate([*events, borrowing], 1)])
    (vision,) = (vc for vc in view.vcs() if vc["vc"] == "vision")
    assert (vision["in_use"], vision["borrowed"]) == (8, 4)
    ended = ev.JobFinished(id="fin-a", at=20.0, source="scheduler", job="a", attempt=0, outcome="completed")
    view.fold_all([Record(len(events) + 2, ended)])
    (vision,) = (vc for vc in view.vcs() if vc["vc"] == "vision")
    assert (vision["in_use"], vision["borrowed"]) == (4, 0)


# -- the queue as the scheduler explains it, kept current -------------------------------------------


class FakeClock:
    """The explainer's clock (``time.monotonic``), moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def explainer_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    import types

    from services.scheduler import explain

    clock = FakeClock()
    monkeypatch.setattr(explain, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


class Log:
    """A view over a growing log, one event at a time."""

    def __init__(self, view: DashboardView) -> None:
        self.view = view
        self.seq = 0

    def add(self, *events: ev.Event) -> None:
        for event in events:
            self.seq += 1
            self.view.fold(self.seq, event)


def _running(job: str, node_name: str, gpus: tuple[int, ...], at: float, cause: str) -> list[ev.Event]:
    start = ev.JobStarted(id=f"start-{job}", at=at, source=f"agent.{node_name}", job=job, attempt=0, node=node_name)
    return [placed(job, node_name, gpus, at=at, cause=cause), start]


def _waiting(view: DashboardView) -> dict[str, dict[str, Any]]:
    return {row["job"]: row for row in view.queue_view()["waiting"]}


def test_a_job_placed_since_the_last_answer_is_not_shown_waiting_once_the_log_stops(
    explainer_clock: FakeClock,
) -> None:
    """The explainer reuses its answer for a moment while the log moves; the view must not keep that
    answer as the one for the log's new position (nothing asks again until the log moves)."""
    view = DashboardView(SchedulerQueue())
    log = Log(view)
    log.add(node("n1", 4), submit("x", 4, at=1.0, duration=100.0), *_running("x", "n1", (0, 1, 2, 3), 1.0, "s-x"))
    log.add(submit("a", 4, at=2.0))
    waits = _waiting(view)["a"]["why"]
    explainer_clock.now = 0.1  # x ends and a is placed: moments after the answer above
    log.add(ev.JobFinished(id="fin-x", at=50.0, source="scheduler", job="x", attempt=0, outcome="completed"))
    log.add(placed("a", "n1", (0, 1, 2, 3), at=50.0, cause="fin-x"))
    view.queue_view()
    explainer_clock.now = 10.0  # the log has not moved since
    assert _waiting(view) == {}
    assert view.queue_answer().seq == view.state.seq, "the answer for the log as it is"
    assert view.job("a")["why"] != waits


def test_a_job_submitted_just_after_another_gets_an_estimate_that_does_not_stay_unknown(
    explainer_clock: FakeClock,
) -> None:
    view = DashboardView(SchedulerQueue())
    log = Log(view)
    log.add(node("n1", 4), submit("x", 4, at=0.0, duration=100.0), *_running("x", "n1", (0, 1, 2, 3), 0.0, "s-x"))
    log.add(submit("a", 4, at=1.0, duration=10.0))
    assert _waiting(view)["a"]["estimated_start"] == 100.0
    explainer_clock.now = 0.6  # b comes within the forecast's reuse, after the pass's
    log.add(submit("b", 4, at=2.0, duration=10.0))
    assert _waiting(view)["b"]["estimated_start"] == 110.0
    explainer_clock.now = 10.0
    assert _waiting(view)["b"]["estimated_start"] == 110.0
    assert view.job("b")["estimated_start"] == 110.0


def test_pages_are_told_when_a_reused_answer_was_replaced_by_a_current_one(explainer_clock: FakeClock) -> None:
    """A page that was given an answer older than the log asks again only at the next change: the
    view counts a change once the explainer answers for the log as it is."""
    view = DashboardView(SchedulerQueue())
    log = Log(view)
    log.add(node("n1", 4), submit("x", 4, at=1.0, duration=100.0), *_running("x", "n1", (0, 1, 2, 3), 1.0, "s-x"))
    log.add(submit("a", 4, at=2.0))
    view.queue_view()
    assert not view.settle_queue(), "a current answer: nothing to tell"
    explainer_clock.now = 0.1
    log.add(submit("b", 1, at=3.0))
    view.queue_view()  # (reused: the explainer answered a moment ago)
    version = view.version
    assert not view.settle_queue() and view.version == version, "still the reused answer"
    explainer_clock.now = 10.0
    assert view.settle_queue() and view.version == version + 1
    assert not view.settle_queue() and view.version == version + 1, "told once"
    assert set(_waiting(view)) == {"a", "b"}


async def test_an_open_page_s_stream_says_when_a_reused_answer_was_replaced(explainer_clock: FakeClock) -> None:
    view = DashboardView(SchedulerQueue())
    log = Log(view)
    log.add(node("n1", 4), submit("x", 4, at=1.0, duration=100.0), *_running("x", "n1", (0, 1, 2, 3), 1.0, "s-x"))

    async def nothing(*args: Any) -> Any:
        return {}

    backend = Backend(view, lambda: True, nothing, None, Actions(nothing, nothing), lambda: b"", nothing)
    async with TestClient(TestServer(make_app(backend))) as c:
        response = await c.get("/api/stream")
        await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
        view.queue_view()
        explainer_clock.now = 0.1
        log.add(submit("a", 4, at=2.0))
        await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)  # (the log moved)
        assert "a" not in _waiting(view), "the explainer's answer of a moment ago, reused"
        explainer_clock.now = 10.0
        await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)  # (the current answer: a change)
        assert "a" in _waiting(view)
        response.close()


def test_the_queue_lists_every_waiting_job_including_those_the_next_pass_places() -> None:
    """The scheduler is down or behind: a job that fits is still waiting, and the next pass places
    it. The queue lists it, and its page says so, as ``gpuherd why`` does."""
    view = DashboardView(SchedulerQueue())
    Log(view).add(node("n1", 8), submit("a", 2, at=1.0), submit("b", 16, at=2.0))
    assert view.overview()["jobs"]["waiting"] == 2
    rows = view.queue_view()["waiting"]
    assert [(r["job"], r["position"]) for r in rows] == [("a", 1), ("b", 2)]
    assert rows[0]["kind"] == "next pass"
    assert rows[0]["why"] == "nothing holds it back: it is placed on the scheduler's next pass"
    assert rows[0]["estimated_start"] == 2.0  # now
    page = view.job("a")
    assert page["why"] == rows[0]["why"] and page["position"] == 1


def test_jobs_the_next_pass_places_take_the_positions_the_waiting_ones_leave() -> None:
    view = DashboardView(SchedulerQueue())
    log = Log(view)
    log.add(node("n1", 8), ev.PolicyConfigured(id="p", policy="fifo", backfill=True))
    log.add(submit("a", 2, at=1.0), submit("big", 16, nodes=2, at=2.0), submit("c", 2, at=3.0), submit("d", 8, at=4.0))
    rows = view.queue_view()["waiting"]
    assert sorted(r["position"] for r in rows) == [1, 2, 3, 4]
    kinds = {r["job"]: (r["position"], r["kind"]) for r in rows}
    assert kinds["a"] == (1, "next pass") and kinds["c"] == (3, "next pass")
    assert kinds["big"][0] == 2 and kinds["d"][0] == 4 and "next pass" not in (kinds["big"][1], kinds["d"][1])


def test_a_job_s_progress_is_its_first_rank_s_reports() -> None:
    """Every rank of a job may report its step: the charts follow the first rank (what ends up in
    the job's final metrics), as the agents keep it."""
    view = folded()
    for step in range(1, 401):
        for rank in range(4):
            values = {"loss": 1.0 / step + rank}
            view.telemetry("n1.job.a", {"job": "a", "rank": rank, "at": step, "step": step, "values": values})
    progress = view.job("a")["progress"]
    assert [p["step"] for p in progress] == list(range(101, 401))  # the last 300 steps, once each
    assert progress[-1]["loss"] == pytest.approx(1 / 400)


def test_an_elastic_job_s_progress_is_whichever_rank_reports() -> None:
    """An elastic job's rank 0 is whoever holds it after a rescale: it alone reports, whatever its
    launch rank (as the agents keep it)."""
    view = DashboardView(None)
    elastic = ev.JobSpec(name="e", user="u", gpus=2, elastic=ev.Elastic(min=1, max=4))
    view.fold(1, ev.JobSubmitted(id="s-e", at=0.0, source="t", job="e", spec=elastic, intake_source="t"))
    for step, rank in ((1, 0), (2, 3)):
        view.telemetry("n1.job.e", {"job": "e", "rank": rank, "at": step, "step": step, "values": {"loss": 1.0}})
    assert [p["step"] for p in view.job("e")["progress"]] == [1, 2]


# -- the operator actions' checks and the services page ---------------------------------------------


async def test_an_action_refuses_a_reason_too_long_for_the_log() -> None:
    cancelled: list[str] = []

    async def cancel(job: str, reason: str) -> None:
        cancelled.append(job)

    async def drain(node: str, reason: str, undrain: bool) -> None:
        cancelled.append(node)

    async with TestClient(TestServer(make_app(_acting(Actions(cancel=cancel, drain=drain))))) as c:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for path in ("/api/jobs/b/cancel", "/api/nodes/n1/drain"):
            response = await c.post(path, json={"reason": "x" * 1_000_000}, headers=auth)
            assert response.status == 400, path
            assert "reason" in (await response.json())["error"]
        ok = await c.post("/api/jobs/b/cancel", json={"reason": "x" * 500}, headers=auth)
        assert ok.status == 200, await ok.text()
    assert cancelled == ["b"]


async def test_cancel_refuses_a_job_id_that_is_a_subject_wildcard() -> None:
    cancelled: list[str] = []

    async def cancel(job: str, reason: str) -> None:
        cancelled.append(job)

    async def nothing(*args: Any) -> None:
        return None

    async with TestClient(TestServer(make_app(_acting(Actions(cancel=cancel, drain=nothing))))) as c:
        for job in ("*", ">", "%2A", "a.b"):
            response = await c.post(f"/api/jobs/{job}/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status == 400 and "subject token" in (await response.json())["error"], job
    assert cancelled == []


async def test_the_services_page_skips_a_malformed_status_entry_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuherd.log import STATUS_BUCKET
    from gpuherd.log.inprocess import InProcessLog
    from gpuherd.metrics import ServiceStatus
    from services.dashboard import service
    from services.dashboard.service import Dashboard, Tools

    monkeypatch.setattr(service, "Client", lambda *args, **kwargs: None)  # (no NATS: no action is taken here)

    log_ = InProcessLog()
    good = ServiceStatus(service="scheduler", instance="h-1", role="leader", seq=7)
    await log_.kv_put(STATUS_BUCKET, "scheduler.h-1", msgspec.json.encode(good))
    await log_.kv_put(STATUS_BUCKET, "elastic.h-2", b"{not json")
    await log_.kv_put(STATUS_BUCKET, "memory.h-3", b'{"service": "memory", "role": 3}')
    answer = await Dashboard(log_, tools=Tools()).services()
    assert [s["service"] for s in answer["services"]] == ["scheduler"]
    assert sorted(u["key"] for u in answer["unreadable"]) == ["elastic.h-2", "memory.h-3"]
    assert all(u["error"] for u in answer["unreadable"])


def test_the_view_forgets_the_oldest_ended_jobs_beyond_those_it_keeps_and_nothing_else() -> None:
    from tests.unit.test_workflows import job, pipeline, simulate

    records = simulate([(1.0, pipeline()), (2.0, job("sweep", duration=5, array={"count": 3}))]).records
    full, kept = DashboardView(SchedulerQueue()), DashboardView(SchedulerQueue(), ended_kept=2)
    full.fold_all(records)
    kept.fold_all(records)
    ended = [r.event.job for r in records if isinstance(r.event, ev.JobFinished)]
    assert len(ended) == 6 == len(full.state.jobs)
    assert set(kept.state.jobs) == set(ended[-2:]), "the two that ended last"
    for gone in ended[:-2]:
        assert kept.job(gone) is None
        assert all(gone not in per_job for per_job in (kept.timelines, kept.placements, kept.leases, kept.rescales))
    for remembered in ended[-2:]:
        assert kept.job(remembered) == full.job(remembered)
    assert kept.jobs()[0] == 2
    # What covers every job still does: the counts of ended jobs, and the usage page.
    assert kept.overview()["jobs"]["ended"] == full.overview()["jobs"]["ended"] == {"completed": 6}
    assert kept.overview()["jobs"]["forgotten"] == 4 and full.overview()["jobs"]["forgotten"] == 0
    assert kept.usage_view() == full.usage_view()
    # A workflow keeps the steps whose jobs it remembers, and goes once it remembers none.
    for _, steps in kept.workflows.values():
        assert steps and all(ids and set(ids) <= set(kept.state.jobs) for ids in steps.values())
    assert len(kept.workflow_list()) == len(kept.workflows)


def test_jobs_that_have_not_ended_are_never_forgotten_and_a_forgotten_job_s_late_event_keeps_nothing() -> None:
    view = DashboardView(ended_kept=0)
    view.fold_all(history())  # a ended; c placed; b waits
    assert set(view.state.jobs) == {"b", "c"} and view.forgotten == 1
    late = ev.TaskEnded(id="late-a", at=400.0, source="agent.n1", job="a", attempt=0, node="n1", outcome="completed")
    view.fold(99, late)
    assert "a" not in view.timelines and "a" not in view.state.jobs


def test_the_dashboard_refuses_a_negative_number_of_ended_jobs_to_keep() -> None:
    from services.dashboard.service import build_parser

    with pytest.raises(ValueError, match="0 or more"):
        DashboardView(ended_kept=-1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ended-kept", "-1"])
    assert build_parser().parse_args(["--ended-kept", "5"]).ended_kept == 5


def test_a_stale_attempt_s_end_does_not_make_the_view_forget_a_job_that_waits_again() -> None:
    events = [
        node("n1", 4),
        submit("a", 4, at=10.0),
        submit("other", 1, at=11.0),
        ev.JobPlaced(id="p-a-0", at=12.0, job="a", attempt=0, allocations=(ev.Allocation("n1", (0, 1, 2, 3)),)),
        ev.JobStarted(id="s-a-0", at=13.0, job="a", attempt=0, node="n1"),
        ev.JobRequeued(id="r-a-0", at=20.0, job="a", attempt=0, reason="preempted"),
        # (Of attempt 0, already requeued: the fold ignores it.)
        ev.JobFinished(id="f-a-0", at=21.0, job="a", attempt=0, outcome="failed"),
        ev.JobFinished(id="f-other", at=22.0, job="other", attempt=0, outcome="cancelled"),
    ]
    view = DashboardView(ended_kept=1)
    view.fold_all([Record(seq, event) for seq, event in enumerate(events, 1)])
    assert "a" in view.state.queue and "a" in view.state.jobs, "a waits: it was forgotten as if it had ended"
    assert view.forgotten == 0 and view.vcs()


def test_a_workflow_whose_timed_out_step_was_forgotten_still_says_it_timed_out() -> None:
    from tests.unit.test_workflows import simulate

    steps = [
        {"name": "prep", "gpus": 1, "duration_s": 10, "time_limit_s": 5},
        {"name": "train", "gpus": 1, "duration_s": 30, "depends_on": {"afterany": ["prep"]}},
    ]
    records = simulate([(1.0, {"workflow": "pipe", "user": "ana", "intake_id": "p-1", "steps": steps})]).records
    full, kept = DashboardView(SchedulerQueue()), DashboardView(SchedulerQueue(), ended_kept=1)
    full.fold_all(records)
    kept.fold_all(records)
    (whole,) = full.workflow_list()
    (remembered,) = kept.workflow_list()
    assert whole["status"] == remembered["status"] == "timeout"
    assert whole["states"] == remembered["states"] == {"timeout": 1, "completed": 1}
    graph = kept.workflow(remembered["workflow"])
    assert graph is not None and [s["step"] for s in graph["steps"]] == ["train"], "a step it remembers no job of goes"


async def test_the_dashboards_audit_reads_the_log_a_chunk_at_a_time_and_reports_as_the_audit_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It read the whole log into the dashboard's memory; a long-running dashboard asked for an
    audit of a year's log would have held a year's log."""
    from apps.registry import specs
    from gpuherd.log.inprocess import InProcessLog
    from gpuherd.runtime.audit import audit
    from services.dashboard import service
    from services.dashboard.service import Dashboard, Tools
    from tests.unit.test_workflows import job, pipeline, simulate

    monkeypatch.setattr(service, "Client", lambda *args, **kwargs: None)  # (no NATS: no action is taken here)
    monkeypatch.setattr(service, "AUDIT_CHUNK", 7)  # (many chunks)
    records = simulate([(1.0, pipeline()), (2.0, job("sweep", duration=5, array={"count": 3}))]).records
    log_ = InProcessLog()
    for record in records:
        assert (await log_.append([record.event])).seqs == (record.seq,)
    answer = await Dashboard(log_, tools=Tools.from_peers(specs())).audit()
    expected = {s.name: audit(records, s.decider()) for s in specs() if s.auditable and s.decider is not None}
    assert answer["ok"] and answer["events"] == len(records) and set(answer["deciders"]) == set(expected)
    for name, report in expected.items():
        assert answer["deciders"][name] == msgspec.to_builtins(report) | {"ok": True}, name
    assert sum(report.decisions_checked for report in expected.values()) > 10
