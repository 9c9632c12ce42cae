"""An open job page keeps the job's output between its redraws: the page redraws at every change of
the view (GPU samples and training progress change it several times a second on a busy cluster),
and each redraw asked the agents for the output again and showed "loading output..." until the
answer came. (A headless Chromium against the dashboard's own app; skipped without one.)"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from services.dashboard.server import Actions, Backend, make_app
from tests.unit.test_dashboard_view import folded

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking", "--disable-dev-shm-usage"]
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="BROWSER TESTS SKIPPED: no chromium on this machine")


@pytest.fixture
def busy_dashboard() -> Iterator[tuple[str, list[float]]]:
    """The test view served on a free port from a thread of its own, its version bumped every 50 ms
    (as telemetry does); each output request is counted."""
    asked: list[float] = []
    view = folded()

    async def output(job: str) -> list[dict[str, Any]]:
        asked.append(time.monotonic())
        await asyncio.sleep(0.05)  # (agents take a while to answer)
        return [{"ok": True, "attempt": 0, "node": "n1", "attempts": {"0": {"rank0.log": "hello from job a\n"}}}]

    async def nothing(*args: Any) -> Any:
        return {}

    backend = Backend(
        view=view,
        ready=lambda: True,
        services=nothing,
        audit=None,
        actions=Actions(cancel=nothing, drain=nothing),
        metrics=lambda: b"",
        output=output,
    )
    loop = asyncio.new_event_loop()
    started = threading.Event()
    url: list[str] = []
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        runner = web.AppRunner(make_app(backend), shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url.append(f"http://127.0.0.1:{runner.addresses[0][1]}/")
        started.set()
        try:
            while not stop.is_set():
                view.version += 1
                await asyncio.sleep(0.05)
        finally:
            await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert started.wait(10), "the dashboard did not start"
        yield url[0], asked
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def test_a_job_page_does_not_ask_for_the_output_at_every_redraw(busy_dashboard: tuple[str, list[float]]) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, asked = busy_dashboard
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(url + "#/job/a")
            output = page.locator("[data-testid=output]")
            expect(output).to_contain_text("hello from job a", timeout=10_000)
            began, shown = len(asked), []
            for _ in range(20):  # two seconds of redraws, ten a second
                page.wait_for_timeout(100)
                shown.append(output.text_content())
            redraws = int(page.evaluate("document.body.dataset.seq !== undefined"))
        finally:
            browser.close()
    assert redraws, "the page never heard of a change"
    assert len(asked) - began <= 2, f"{len(asked) - began} output requests in two seconds"
    assert all("hello from job a" in (text or "") for text in shown), shown
