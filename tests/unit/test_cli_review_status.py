"""``gpuherd status`` with a status entry it cannot read (garbled, or written by another version of a
service) lists the others and says which entry it skipped and why, as the dashboard's services page
does: it stopped with a msgspec traceback, showing nothing of the deployment it was asked about."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec
import pytest

from apps.cli import common, ops
from gpuherd.log import STATUS_BUCKET
from gpuherd.log.inprocess import InProcessLog
from gpuherd.metrics import ServiceStatus


@pytest.fixture
def statuses(monkeypatch: pytest.MonkeyPatch) -> InProcessLog:
    log_ = InProcessLog()

    async def opened(args: argparse.Namespace) -> InProcessLog:
        return log_

    async def overview(log: Any, urls: Any = ()) -> dict[str, Any]:
        return {"server": "n", "version": "2", "cluster": None, "streams": [], "durability": []}

    monkeypatch.setattr(ops, "open_cli_log", opened)
    monkeypatch.setattr(ops, "nats_overview", overview)
    monkeypatch.setattr(common.console, "_width", 300)
    return log_


async def _put(log_: InProcessLog) -> None:
    good = ServiceStatus(service="scheduler", instance="h-1", role="leader", seq=7)
    await log_.kv_put(STATUS_BUCKET, "scheduler.h-1", msgspec.json.encode(good))
    await log_.kv_put(STATUS_BUCKET, "elastic.h-2", b"{not json")
    await log_.kv_put(STATUS_BUCKET, "memory.h-3", b'{"service": "memory", "role": 3}')


@pytest.mark.parametrize("as_json", [False, True])
def test_status_skips_an_unreadable_entry_and_says_which(statuses: InProcessLog, capsys: Any, as_json: bool) -> None:
    import asyncio

    asyncio.run(_put(statuses))
    code = ops.cmd_status(argparse.Namespace(json=as_json, nats_url=None, data_dir=".gpuherd"))
    assert code == 1  # (degraded: elastic and memory are not seen running)
    out = capsys.readouterr().out
    if as_json:
        view = msgspec.json.decode(out)
        assert [s["service"] for s in view["services"]] == ["scheduler"]
        assert sorted(u["key"] for u in view["unreadable"]) == ["elastic.h-2", "memory.h-3"]
        assert all(u["error"] for u in view["unreadable"])
    else:
        assert "scheduler" in out and "elastic.h-2" in out and "memory.h-3" in out, out
