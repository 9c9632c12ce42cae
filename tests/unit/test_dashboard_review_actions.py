"""An operator action the log cannot take right now (NATS restarting, no quorum) is answered 503,
which says "try again", with the log's reason: it was a 400, which says the request itself is wrong
and is not to be sent again."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from gpuherd.errors import LogUnavailable
from services.dashboard.server import Actions, make_app
from tests.unit.test_dashboard_view import TOKEN, _acting


async def test_an_action_the_log_cannot_take_now_is_a_503() -> None:
    async def unavailable(*args: object) -> None:
        raise LogUnavailable("no quorum for HERD: retry")

    app = make_app(_acting(Actions(cancel=unavailable, drain=unavailable)))
    async with TestClient(TestServer(app)) as client:
        for path in ("/api/jobs/b/cancel", "/api/nodes/n1/drain", "/api/nodes/n1/undrain"):
            response = await client.post(path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert response.status == 503, (path, response.status)
            assert "no quorum" in (await response.json())["error"]


async def test_an_action_the_log_does_not_answer_is_a_503_in_bounded_time(monkeypatch) -> None:
    """NATS frozen (SIGSTOP) or partitioned: the append waited for as long as it lasted, and the page's
    button said nothing meanwhile."""
    never = asyncio.Event()

    async def hangs(*args: object) -> None:
        await never.wait()

    monkeypatch.setattr("services.dashboard.server.ACTION_TIMEOUT_S", 0.2)
    app = make_app(_acting(Actions(cancel=hangs, drain=hangs)))
    async with TestClient(TestServer(app)) as client:
        for path in ("/api/jobs/b/cancel", "/api/nodes/n1/drain"):
            response = await asyncio.wait_for(client.post(path, headers={"Authorization": f"Bearer {TOKEN}"}), 5)
            assert response.status == 503, (path, response.status)
            assert "did not take it within 0.2s" in (await response.json())["error"]
