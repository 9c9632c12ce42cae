"""Cluster energy saving through NATS: a power-down request drains the node, the agent runs the
power hook once its last job ends and records the node off; a job that needs the node makes the
scheduler ask for power, and the agent boots it with the hook."""

from __future__ import annotations

import sys

import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.fold.invariants import violations
from gpuherd.log import open_log
from gpuherd.runtime.audit import audit
from services.scheduler.decide import SchedulerDecider
from tests.integration.procs import Services, wait_scheduler_ready, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HOOK = """import sys
with open(sys.argv[1], "a") as f:
    f.write(" ".join(sys.argv[2:]) + "\\n")
"""


async def test_power_down_drains_then_demand_powers_up(local_nats, tmp_path) -> None:
    hook_log = tmp_path / "power.txt"
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)
    services = Services(
        local_nats.url,
        tmp_path,
        agents=1,
        gpus=2,
        agent_args=("--power-hook", f"{sys.executable} {hook} {hook_log}"),
    )
    services.start_all()
    log = await open_log(local_nats.url, name="test")
    client = await Client.connect(local_nats.url, source="test")
    try:
        await wait_state(log, lambda s: "n1" in s.nodes, 30)
        await wait_scheduler_ready(log)
        busy = await client.submit({"name": "busy", "user": "u", "gpus": 2, "duration_s": 3.0, "intake_id": "busy"})
        await wait_state(log, lambda s: s.jobs[busy].status == "running", 30)

        # What the analytics service appends when forecast demand does not need the node.
        await log.append([ev.NodePowerDownRequested(id="ces-1", source="analytics", node="n1", reason="test")])
        state = await wait_state(log, lambda s: s.nodes["n1"].power == "draining", 10)
        assert state.jobs[busy].status == "running"  # a drain never stops running work
        state = await wait_state(log, lambda s: s.nodes["n1"].power == "off", 30)
        assert state.jobs[busy].status == "completed"
        assert hook_log.read_text().splitlines() == ["down n1"]

        later = await client.submit({"name": "later", "user": "u", "gpus": 1, "duration_s": 0.5, "intake_id": "l"})
        state = await wait_state(log, lambda s: s.jobs[later].status == "completed", 60)
        assert state.nodes["n1"].power == "on"
        assert hook_log.read_text().splitlines() == ["down n1", "up n1"]

        records = await log.read_all()
        kinds = [type(r.event) for r in records]
        order = [ev.NodePowerDownRequested, ev.NodePoweredDown, ev.NodeWakeRequested, ev.NodePoweredUp]
        assert [k for k in kinds if k in order] == order
        up = next(r.event for r in records if isinstance(r.event, ev.NodeWakeRequested))
        assert up.source == "scheduler" and "wait" in up.reason
        assert violations(records) == []
        report = audit(records, SchedulerDecider())
        assert report.ok, report.mismatches[:3]
        assert services.crashed() == []
    finally:
        await client.close()
        await log.close()
        services.stop_all()
