"""Operator actions the dashboard cannot take are answered 401 or 400, never 500: a token header that
is not UTF-8, a body nested too deep to parse, a reason that is not text (a lone surrogate)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gpuherd import events as ev
from services.dashboard.server import Actions, Backend, make_app
from tests.unit.test_dashboard_view import TOKEN, folded

AUTH = {"Authorization": f"Bearer {TOKEN}"}
AS_JSON = AUTH | {"Content-Type": "application/json"}


@pytest.fixture
async def acting() -> AsyncIterator[tuple[TestClient, list[ev.Event]]]:
    """A dashboard with the operator token whose actions record the event the client would append
    (encoded as the client encodes it, so an event the log cannot hold fails as it would live)."""
    recorded: list[ev.Event] = []

    async def cancel(job: str, reason: str) -> None:
        event = ev.JobCancelRequested(job=job, reason=reason)
        ev.encode(event)
        recorded.append(event)

    async def drain(node: str, reason: str, undrain: bool) -> None:
        event = ev.NodeDrained(node=node, reason=reason)
        ev.encode(event)
        recorded.append(event)

    async def nothing(*args: Any) -> Any:
        return {}

    backend = Backend(
        view=folded(),
        ready=lambda: True,
        services=nothing,
        audit=None,
        actions=Actions(cancel=cancel, drain=drain),
        metrics=lambda: b"",
        output=nothing,
        operator_token=TOKEN,
    )
    async with TestClient(TestServer(make_app(backend))) as client:
        yield client, recorded


async def _raw_post(client: TestClient, path: str, headers: bytes) -> bytes:
    """The status line of a POST sent as raw bytes (an HTTP client will not send a header that is
    not text)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    try:
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: dashboard\r\n" + headers + b"\r\n")
        await writer.drain()
        return await reader.readline()
    finally:
        writer.close()


async def test_a_token_header_that_is_not_utf8_is_refused_with_401(acting: Any) -> None:
    client, recorded = acting
    for token in (b"\xff\xfe", TOKEN.encode() + b"\xff", b"\xed\xa0\x80"):
        status = await _raw_post(client, "/api/jobs/b/cancel", b"Authorization: Bearer " + token + b"\r\n")
        assert status.startswith(b"HTTP/1.1 401 "), (token, status)
    assert recorded == []
    status = await _raw_post(client, "/api/jobs/b/cancel", b"Authorization: Bearer " + TOKEN.encode() + b"\r\n")
    assert status.startswith(b"HTTP/1.1 200 "), status  # (the token itself, sent the same way, acts)


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"reason": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
@pytest.mark.parametrize("path", ["/api/jobs/b/cancel", "/api/nodes/n1/drain"])
async def test_a_body_nested_too_deep_to_parse_is_a_400(acting: Any, body: bytes, path: str) -> None:
    client, recorded = acting
    response = await client.post(path, data=body, headers=AS_JSON)
    assert response.status == 400, await response.text()
    assert "too deep" in (await response.json())["error"]
    assert recorded == []


@pytest.mark.parametrize("path", ["/api/jobs/b/cancel", "/api/nodes/n1/drain"])
async def test_a_reason_with_a_lone_surrogate_is_a_400(acting: Any, path: str) -> None:
    client, recorded = acting
    response = await client.post(path, data=b'{"reason": "stuck \\ud800 job"}', headers=AS_JSON)
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert "surrogate" in error and "\\ud800" in error and "character 6" in error
    assert recorded == []
    # A pair of surrogates is one character (JSON's way to write it): text, taken.
    response = await client.post(path, data=b'{"reason": "stuck \\ud83d\\ude00"}', headers=AS_JSON)
    assert response.status == 200, await response.text()
    assert [e.reason for e in recorded] == ["stuck \U0001f600"]
