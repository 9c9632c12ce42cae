"""A walk through the dashboard as its users see it, in a real browser (the fixtures and skip rules of
``test_dashboard_browser.py``: Debian's headless Chromium against a real `gpuherd up` cluster).

What the walk found: the History and Usage plots and a job's progress charts were empty boxes (each
redraw destroyed the charts it had just drawn); node cards were narrower than their GPU rows, which
ran over the next card and off the page; on a phone the header took half the screen and every page
scrolled sideways; every page load logged a 404 (no favicon) in the console. Users' reviews found
more: at 1,280 px, where the nav wraps to two rows, a long table's sticky header cells sat under the
page header; and with NATS frozen the badge said "live" (a dashboard and NATS of its own here).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuherd.client import Client
from gpuherd.natsd import NatsServer
from tests.e2e.test_dashboard_browser import (  # noqa: F401 - fixtures, used by name
    CHROMIUM_ARGS,
    ROOT,
    UPDATE_WAIT_MS,
    browser,
    cluster,
    needs_browser,
    open_view,
    shot,
    submit,
    wait_for,
)
from tests.integration.procs import FAST_ENV

pytestmark = [pytest.mark.slow, pytest.mark.long]  # (browser walks: make test-long, to keep make test short)

PHONE = {"width": 390, "height": 800}


def _page(browser: Any, viewport: dict[str, int]) -> Iterator[Any]:  # noqa: F811 - the fixture's name
    context = browser.new_context(viewport=viewport)
    page = context.new_page()
    page.errors = []  # type: ignore[attr-defined]
    page.on("pageerror", lambda e: page.errors.append(str(e)))  # type: ignore[attr-defined]
    page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))  # type: ignore[attr-defined]
    try:
        yield page
    finally:
        context.close()


@pytest.fixture
def desk(browser: Any, cluster: dict[str, str]) -> Iterator[Any]:  # noqa: F811
    yield from _page(browser, {"width": 1280, "height": 900})


@pytest.fixture
def phone(browser: Any, cluster: dict[str, str]) -> Iterator[Any]:  # noqa: F811
    yield from _page(browser, PHONE)


def sideways(page: Any) -> int:
    """How far the page scrolls sideways (0: it fits its window)."""
    return page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")


@needs_browser
def test_history_and_usage_draw_their_plots_and_keep_them_when_the_log_moves(
    desk: Any,
    cluster: dict[str, str],  # noqa: F811
) -> None:
    from playwright.sync_api import expect

    submit(cluster["nats_url"], {"name": "for-the-plots", "user": "hal", "gpus": 1, "duration_s": 2})
    open_view(desk, cluster, "history")
    expect(desk.locator("#view .uplot")).to_have_count(2, timeout=UPDATE_WAIT_MS)  # busy by VC, waiting jobs
    seq = desk.evaluate("document.body.dataset.seq")
    submit(cluster["nats_url"], {"name": "moves-the-log", "user": "hal", "gpus": 1, "duration_s": 1})
    for _ in range(UPDATE_WAIT_MS // 100):  # (wait_for_function evaluates a string: the page's CSP forbids it)
        if desk.evaluate("document.body.dataset.seq") != seq:
            break
        desk.wait_for_timeout(100)
    assert desk.evaluate("document.body.dataset.seq") != seq, "the page did not follow the log"
    desk.wait_for_timeout(500)  # (the redraw that follows)
    expect(desk.locator("#view .uplot")).to_have_count(2)
    expect(desk.locator("#view .uplot canvas")).to_have_count(2)
    open_view(desk, cluster, "usage")
    expect(desk.locator("#view .uplot")).to_have_count(2, timeout=UPDATE_WAIT_MS)  # by VC, by user
    shot(desk, "walkthrough-usage")
    assert desk.errors == [], desk.errors  # type: ignore[attr-defined]


@needs_browser
def test_node_cards_hold_their_gpu_rows(desk: Any, cluster: dict[str, str]) -> None:  # noqa: F811
    from playwright.sync_api import expect

    job = submit(cluster["nats_url"], {"name": "on-a-card", "user": "ivy", "gpus": 2, "duration_s": 3600})
    open_view(desk, cluster, "nodes")
    expect(desk.locator(f"[data-testid=nodes] a.joblink:text-is('{job}')")).to_have_count(2, timeout=UPDATE_WAIT_MS)
    shot(desk, "walkthrough-nodes")
    over = desk.evaluate(
        "[...document.querySelectorAll('.nodecard')].filter(c => c.scrollWidth > c.clientWidth)"
        ".map(c => `${c.dataset.node}: ${c.scrollWidth} > ${c.clientWidth}`)"
    )
    assert over == [], over
    assert sideways(desk) == 0


@needs_browser
def test_a_phone_shows_every_page_without_sideways_scrolling(phone: Any, cluster: dict[str, str]) -> None:  # noqa: F811
    command = [sys.executable, "-c", "print('a line from a job on a phone')"]
    job = submit(cluster["nats_url"], {"name": "phone-job", "user": "jo", "gpus": 1, "command": command})
    routes = ["overview", "queue", "jobs", "nodes", "vcs", "workflows", "history", "usage", "services", f"job/{job}"]
    for route in routes:
        open_view(phone, cluster, route)
        phone.wait_for_timeout(300)
        shot(phone, f"walkthrough-phone-{route.split('/')[0]}")
        assert sideways(phone) == 0, (route, sideways(phone))
        header = phone.evaluate("document.querySelector('header').getBoundingClientRect().height")
        assert header < PHONE["height"] / 4, (route, header)  # the links wrap in rows, not one word per line
    phone.evaluate("window.scrollTo(0, 400)")
    assert phone.evaluate("document.querySelector('header').getBoundingClientRect().bottom") <= 0  # it scrolls away
    assert phone.errors == [], phone.errors  # type: ignore[attr-defined]


def submit_many(nats_url: str, specs: list[dict[str, Any]]) -> list[str]:
    """Submit every spec through one client (not a connection each)."""

    async def run() -> list[str]:
        client = await Client.connect(nats_url, source="browser-test")
        try:
            return [await client.submit(spec) for spec in specs]
        finally:
            await client.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (Playwright's sync API holds this thread's loop)
        return pool.submit(asyncio.run, run()).result()


# Where the page header and a table's sticky header cells are, scrolled (bounding rects).
STICKY_RECTS = """(() => {
  const header = document.querySelector('header').getBoundingClientRect();
  const cells = [...document.querySelectorAll('[data-testid=jobs-table] thead th')].map((th) => {
    const r = th.getBoundingClientRect();
    const seen = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    return { top: r.top, bottom: r.bottom, seen: th.contains(seen) };
  });
  return { header: header.bottom, cells, scrolled: window.scrollY };
})()"""


@needs_browser
def test_a_long_tables_header_cells_stick_below_the_page_header_where_the_nav_wraps(
    desk: Any,
    cluster: dict[str, str],  # noqa: F811
) -> None:
    """At 1,280 px (the token field and the badge beside the links) the nav wraps to two rows, and
    the table's header cells stuck 45 px from the top: under the page header, which hid them."""
    from playwright.sync_api import expect

    rows = [{"name": f"row-{n}", "user": "lin", "gpus": 1, "duration_s": 1} for n in range(60)]
    submit_many(cluster["nats_url"], rows)
    open_view(desk, cluster, "jobs?user=lin")
    expect(desk.locator("[data-testid=jobs-table] tbody tr")).to_have_count(60, timeout=UPDATE_WAIT_MS)
    header = desk.evaluate("document.querySelector('header').getBoundingClientRect().height")
    assert header > 60, f"the header is {header}px high: its nav no longer wraps at 1,280 px, the case tested here"
    desk.evaluate("window.scrollTo(0, 900)")
    desk.wait_for_timeout(300)
    rects = desk.evaluate(STICKY_RECTS)
    shot(desk, "walkthrough-sticky")
    assert rects["scrolled"] >= 900
    for cell in rects["cells"]:
        assert cell["top"] >= rects["header"] - 0.5, rects  # not under the page header
        assert cell["top"] <= rects["header"] + 0.5, rects  # stuck right below it
        assert cell["seen"], rects
    assert desk.errors == [], desk.errors  # type: ignore[attr-defined]


@needs_browser
def test_the_page_names_an_icon_it_serves(desk: Any, cluster: dict[str, str]) -> None:  # noqa: F811
    # Without one the browser asks for /favicon.ico, a 404, logged as an error in the console of every page.
    open_view(desk, cluster, "overview")
    icon = desk.evaluate("document.querySelector('link[rel=icon]')?.href ?? null")
    assert icon is not None and icon.startswith(cluster["url"]), icon
    with urllib.request.urlopen(icon, timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("image/")
    assert desk.errors == [], desk.errors  # type: ignore[attr-defined]


@pytest.fixture
def lone_dashboard(local_nats: NatsServer, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A dashboard process on a NATS server of this test alone (which the test may freeze)."""
    url_file = tmp_path / "dashboard.url"
    argv = [sys.executable, "-m", "apps", "serve", "dashboard", "--nats-url", local_nats.url]
    argv += ["--port", "0", "--url-file", str(url_file)]
    assert local_nats.proc is not None
    with (tmp_path / "dashboard.log").open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **FAST_ENV}, cwd=ROOT)
    try:
        url = wait_for(lambda: url_file.exists() and url_file.read_text().strip(), 30, "the dashboard's URL")
        yield {"url": url, "nats_pid": local_nats.proc.pid, "pid": process.pid}
    finally:
        os.kill(local_nats.proc.pid, signal.SIGCONT)
        os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def desk_alone(browser: Any, lone_dashboard: dict[str, Any]) -> Iterator[Any]:  # noqa: F811
    yield from _page(browser, {"width": 1280, "height": 900})


@needs_browser
def test_the_live_badge_says_the_data_is_stale_while_nats_is_frozen(
    desk_alone: Any, lone_dashboard: dict[str, Any]
) -> None:
    """With NATS SIGSTOPped every connection stays open: the page heard nothing, and said "live". So
    it did with the dashboard itself frozen (or a proxy holding its stream)."""
    from playwright.sync_api import expect

    page = desk_alone
    open_view(page, lone_dashboard, "overview")
    live = page.locator("#live")
    expect(live).to_have_attribute("data-state", "live")
    os.kill(lone_dashboard["nats_pid"], signal.SIGSTOP)
    try:
        expect(live).to_have_attribute("data-state", "stale", timeout=UPDATE_WAIT_MS)
        expect(live).to_contain_text("NATS silent")
        shot(page, "walkthrough-stale")
    finally:
        os.kill(lone_dashboard["nats_pid"], signal.SIGCONT)
    expect(live).to_have_attribute("data-state", "live", timeout=UPDATE_WAIT_MS)  # NATS answers again
    os.kill(lone_dashboard["pid"], signal.SIGSTOP)
    try:
        expect(live).to_have_attribute("data-state", "stale", timeout=UPDATE_WAIT_MS)
        expect(live).to_contain_text("no word from the dashboard")
    finally:
        os.kill(lone_dashboard["pid"], signal.SIGCONT)
    expect(live).to_have_attribute("data-state", "live", timeout=UPDATE_WAIT_MS)
    assert page.errors == [], page.errors  # type: ignore[attr-defined]
