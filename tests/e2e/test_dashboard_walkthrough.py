"""A walk through the dashboard as its users see it, in a real browser (the fixtures and skip rules of
``test_dashboard_browser.py``: Debian's headless Chromium against a real `gpuherd up` cluster).

What the walk found: the History and Usage plots and a job's progress charts were empty boxes (each
redraw destroyed the charts it had just drawn); node cards were narrower than their GPU rows, which
ran over the next card and off the page; on a phone the header took half the screen and every page
scrolled sideways; and every page load logged a 404 (no favicon) in the console.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_dashboard_browser import (  # noqa: F401 - fixtures, used by name
    CHROMIUM_ARGS,
    UPDATE_WAIT_MS,
    browser,
    cluster,
    needs_browser,
    open_view,
    shot,
    submit,
)

pytestmark = pytest.mark.slow

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
