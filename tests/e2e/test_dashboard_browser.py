"""The dashboard in a real browser (Debian's headless Chromium driven by Playwright) against a real
`gpuherd up` cluster running real jobs: every view loads and shows the cluster, pages follow the log
without a reload, a job page shows its timeline and output, submitters' words render as text, and
operator actions are refused without the token and work with it.

Screenshots of every view are kept in ``.test-artifacts/dashboard/`` (``GPUHERD_ARTIFACTS`` moves
it). Without Chromium every test here is skipped, and the session's summary says so loudly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuherd.client import Client

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("GPUHERD_ARTIFACTS", ROOT / ".test-artifacts")) / "dashboard"
TOKEN = "operator-token-for-the-browser-test"
XSS_NAME = "<script>alert(1)</script><img src=x onerror=alert(2)>"
# What this machine's closed network needs (no background connections, no sandbox as root).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
UPDATE_WAIT_MS = 10_000  # generous: the machines are shared; the bench measures the real latency

needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="BROWSER TESTS SKIPPED: no chromium on this machine")


def http(url: str, *, method: str = "GET", token: str | None = None, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def wait_for(check: Any, timeout: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`gpuherd up` with sim and cpu agents and a dashboard with an operator token."""
    data = tmp_path_factory.mktemp("dashboard-cluster")
    token_file = data / "token"
    token_file.write_text(TOKEN)
    env = dict(os.environ, GPUHERD_LEADERSHIP_TTL="2", PYTHONUNBUFFERED="1")
    env.pop("NATS_URL", None)
    argv = [sys.executable, "-m", "apps", "--data-dir", str(data / "d"), "up", "--agents", "2"]
    argv += ["--gpus-per-node", "4", "--cpu-agents", "1", "--cpu-gpus", "2", "--ui-port", "0"]
    argv += ["--ui-token-file", str(token_file), "--lost-after", "30"]
    log = open(data / "up.log", "wb")  # noqa: SIM115 - closed below, after the process
    up = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        url_file = data / "d" / "dashboard.url"
        url = wait_for(lambda: url_file.exists() and url_file.read_text().strip(), 90, "the dashboard's URL")
        nats_url = json.loads((data / "d" / "cluster.json").read_text())["nats_url"]
        wait_for(lambda: len(http(url + "api/nodes")[1] or []) == 3, 90, "three nodes on the dashboard")
        yield {"url": url, "nats_url": nats_url, "data": str(data)}
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        log.close()


def submit(nats_url: str, spec: dict[str, Any]) -> str:
    async def run() -> str:
        client = await Client.connect(nats_url, source="browser-test")
        try:
            return await client.submit(spec)
        finally:
            await client.close()

    # (Playwright's sync API runs its own event loop in this thread.)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("BROWSER TESTS SKIPPED: no chromium on this machine")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any, cluster: dict[str, str]) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.dialogs = []  # type: ignore[attr-defined]
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))  # type: ignore[attr-defined]
    page.errors = []  # type: ignore[attr-defined]
    page.on("pageerror", lambda e: page.errors.append(str(e)))  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        context.close()


def shot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


def open_view(page: Any, cluster: dict[str, str], route: str) -> None:
    page.goto(cluster["url"] + "#/" + route)
    page.wait_for_selector("#view[data-view]")
    page.wait_for_selector("#live.on", timeout=UPDATE_WAIT_MS)


@needs_browser
def test_every_view_loads_and_shows_the_cluster(page: Any, cluster: dict[str, str]) -> None:
    from playwright.sync_api import expect

    job = submit(cluster["nats_url"], {"name": "long-sim", "user": "ana", "gpus": 4, "duration_s": 3600})
    big = submit(cluster["nats_url"], {"name": "too-big-for-now", "user": "bo", "gpus": 8, "duration_s": 60})
    open_view(page, cluster, "overview")
    expect(page.locator("[data-testid=heatmap] .gpu")).to_have_count(10)  # 2 x 4 sim + 1 x 2 cpu
    expect(page.locator(f"[data-testid=heatmap] .gpu[data-job='{job}']")).to_have_count(4)
    shot(page, "overview")
    open_view(page, cluster, "queue")
    expect(page.locator("[data-testid=queue-table]")).to_contain_text(big)
    expect(page.locator("[data-testid=queue-table]")).to_contain_text("too-big-for-now")
    shot(page, "queue")
    open_view(page, cluster, "jobs")
    expect(page.locator("[data-testid=jobs-table]")).to_contain_text("long-sim")
    shot(page, "jobs")
    open_view(page, cluster, "nodes")
    expect(page.locator("[data-testid=nodes] .nodecard")).to_have_count(3)
    expect(page.locator("[data-testid=nodes]")).to_contain_text("cpu-1")
    shot(page, "nodes")
    open_view(page, cluster, "vcs")
    expect(page.locator("[data-testid=vcs-table]")).to_contain_text("default")
    shot(page, "vcs")
    open_view(page, cluster, "history")
    expect(page.locator("[data-testid=history-busy]")).to_be_visible()
    shot(page, "history")
    open_view(page, cluster, "services")
    expect(page.locator("[data-testid=services-table]")).to_contain_text("scheduler")
    expect(page.locator("[data-testid=services-table]")).to_contain_text("dashboard")
    shot(page, "services")
    open_view(page, cluster, "audit")
    page.click("[data-testid=run-audit]")  # an operator action: refused until the token is typed
    expect(page.locator("#flash")).to_contain_text("operator token")
    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")
    page.click("[data-testid=run-audit]")
    expect(page.locator("[data-testid=audit-result]")).to_contain_text("Clean", timeout=60_000)
    shot(page, "audit")
    assert page.errors == [], page.errors  # type: ignore[attr-defined]


@needs_browser
def test_a_workflow_shows_as_a_graph_and_usage_as_plots(page: Any, cluster: dict[str, str]) -> None:
    from playwright.sync_api import expect

    steps = [
        {"name": "prep", "duration_s": 1},
        {"name": "train", "duration_s": 2, "depends_on": {"afterok": ["prep"]}},
        {"name": "eval", "duration_s": 1, "depends_on": {"afterok": ["train"]}},
    ]
    workflow = submit(cluster["nats_url"], {"workflow": "pipe", "user": "gus", "gpus": 1, "steps": steps})
    open_view(page, cluster, "workflows")
    expect(page.locator("[data-testid=workflows-table]")).to_contain_text(workflow)
    open_view(page, cluster, f"workflow/{workflow}")
    graph = page.locator("[data-testid=workflow-graph]")
    expect(graph.locator("rect")).to_have_count(3)
    expect(graph.locator("line")).to_have_count(2)  # prep -> train -> eval
    expect(graph.locator("[data-step=eval]")).to_have_attribute("data-status", "completed", timeout=60_000)
    shot(page, "workflow")
    open_view(page, cluster, "usage")
    expect(page.locator("[data-testid=usage-vc]")).to_be_visible()
    expect(page.locator("[data-testid=usage-table]")).to_contain_text("gus")
    shot(page, "usage")
    assert page.errors == [], page.errors  # type: ignore[attr-defined]


@needs_browser
def test_an_open_page_follows_placements_and_ends_without_a_reload(page: Any, cluster: dict[str, str]) -> None:
    from playwright.sync_api import expect

    open_view(page, cluster, "overview")
    page.evaluate("window.__sameDocument = true")
    job = submit(cluster["nats_url"], {"name": "short-sim", "user": "cy", "gpus": 1, "duration_s": 3})
    expect(page.locator(f"[data-testid=heatmap] .gpu[data-job='{job}']")).to_have_count(1, timeout=UPDATE_WAIT_MS)
    expect(page.locator(f"[data-testid=heatmap] .gpu[data-job='{job}']")).to_have_count(0, timeout=UPDATE_WAIT_MS)
    assert page.evaluate("window.__sameDocument") is True  # followed by the event stream, never reloaded


@needs_browser
def test_a_job_page_shows_its_timeline_and_output(page: Any, cluster: dict[str, str]) -> None:
    from playwright.sync_api import expect

    command = [sys.executable, "-c", "print('hello from a gpuherd job')"]
    job = submit(cluster["nats_url"], {"name": "hello", "user": "dee", "gpus": 1, "command": command})
    wait_for(lambda: http(cluster["url"] + f"api/jobs/{job}")[1].get("status") == "completed", 90, "the job to end")
    open_view(page, cluster, f"job/{job}")
    timeline = page.locator("[data-testid=timeline]")
    for what in ("submitted", "placed", "started", "finished"):
        expect(timeline).to_contain_text(what)
    expect(page.locator("[data-testid=output]")).to_contain_text("hello from a gpuherd job", timeout=UPDATE_WAIT_MS)
    shot(page, "job")


@needs_browser
def test_submitters_words_render_as_text(page: Any, cluster: dict[str, str]) -> None:
    from playwright.sync_api import expect

    job = submit(cluster["nats_url"], {"name": XSS_NAME, "user": "<b>eve</b>", "gpus": 1, "duration_s": 2})
    open_view(page, cluster, "jobs")
    expect(page.locator("[data-testid=jobs-table]")).to_contain_text(XSS_NAME)
    open_view(page, cluster, f"job/{job}")
    expect(page.locator(".facts")).to_contain_text(XSS_NAME)
    expect(page.locator(".facts")).to_contain_text("<b>eve</b>")
    assert page.locator("#view script, #view img").count() == 0
    assert page.dialogs == []  # type: ignore[attr-defined]


@needs_browser
def test_actions_need_the_operator_token(page: Any, cluster: dict[str, str]) -> None:
    from playwright.sync_api import expect

    url = cluster["url"]
    assert http(url + "api/nodes/node-1/drain", method="POST")[0] == 401
    assert http(url + "api/nodes/node-1/drain", method="POST", token="wrong-token-wrong-token")[0] == 401
    assert http(url + "api/audit", method="POST")[0] == 401  # (it re-runs every decision of the log)
    assert http(url + "api/jobs/nope/cancel", method="POST", token=TOKEN)[0] == 404  # the CLI's own check
    status, body = http(url + "api/nodes/nope/drain", method="POST", token=TOKEN)
    assert status == 404 and "no node" in body["error"]

    open_view(page, cluster, "nodes")
    page.click("[data-testid=drain-node-2]")  # no token typed yet: refused, nothing changes
    expect(page.locator("#flash")).to_contain_text("operator token")
    expect(page.locator("[data-node=node-2] .badge").first).to_have_text("up")
    page.fill("#token", TOKEN)
    page.dispatch_event("#token", "change")
    page.click("[data-testid=drain-node-2]")
    expect(page.locator("[data-node=node-2] .badge").first).to_have_text("drained", timeout=UPDATE_WAIT_MS)
    page.click("[data-testid=undrain-node-2]")
    expect(page.locator("[data-node=node-2] .badge").first).to_have_text("up", timeout=UPDATE_WAIT_MS)

    job = submit(cluster["nats_url"], {"name": "to-cancel", "user": "fay", "gpus": 1, "duration_s": 3600})
    open_view(page, cluster, f"job/{job}")
    page.click("[data-testid=cancel]")
    wait_for(lambda: http(url + f"api/jobs/{job}")[1]["status"] == "cancelled", 60, "the job to be cancelled")
