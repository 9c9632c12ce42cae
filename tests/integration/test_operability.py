"""Each service's /metrics, /healthz and /readyz, and `gpuherd status`, on running processes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.log import open_log
from gpuherd.metrics import http_get, parse_metrics
from gpuherd.natsd import free_port
from tests.integration.procs import Services, wait_scheduler_ready, wait_state

pytestmark = pytest.mark.slow


def metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels, as printed) in Prometheus text."""
    samples = parse_metrics(text)
    assert name in samples, f"{name} not in the metrics:\n{text[:2000]}"
    return samples[name]


async def test_metrics_health_and_status(local_nats, tmp_path) -> None:
    services = Services(local_nats.url, tmp_path, agents=1, gpus=4)
    services.specs["standby-scheduler"] = list(services.specs["scheduler"])
    ports = {name: free_port() for name in services.specs}
    for name, spec in services.specs.items():
        spec += ["--metrics-port", str(ports[name])]
    services.start("scheduler")
    services.start("agent-1")
    log = await open_log(local_nats.url, name="test")
    client = await Client.connect(local_nats.url, source="ops")
    try:
        await wait_scheduler_ready(log)
        await wait_state(log, lambda s: len(s.nodes) == 1, 30)
        services.start("standby-scheduler")
        jobs = [await client.submit({"name": f"m{i}", "user": "u", "gpus": 1, "duration_s": 0.2}) for i in range(3)]
        await wait_state(log, lambda s: all(s.jobs[j].status == "completed" for j in jobs), 30)
        await asyncio.sleep(0.5)

        status, text = await http_get(ports["scheduler"], "/metrics")
        assert status == 200
        assert metric(text, "gpuherd_events_consumed_total") >= 10
        assert metric(text, 'gpuherd_decisions_total{type="JobPlaced"}') == 3
        assert metric(text, "gpuherd_decision_latency_seconds_count") >= 3
        assert metric(text, 'gpuherd_jobs{state="completed"}') == 3
        assert metric(text, 'gpuherd_gpus{state="free"}') == 4
        assert metric(text, 'gpuherd_intake_submissions_total{verdict="accepted"}') == 3
        assert metric(text, "gpuherd_leader") == 1
        finished = [r.seq async for r in log.read() if isinstance(r.event, ev.JobFinished)]
        # (read at scrape time: the scheduler has folded the ends it decided, not only as of its last status)
        assert metric(text, "gpuherd_folded_sequence") >= max(finished)
        for path in ("/healthz", "/readyz"):
            status, body = await http_get(ports["scheduler"], path)
            assert status == 200 and json.loads(body)["role"] == "leader"
        for _ in range(50):  # a standby: alive, but not ready (it does not lead)
            try:
                standby_health = await http_get(ports["standby-scheduler"], "/healthz")
                break
            except OSError:
                await asyncio.sleep(0.2)
        assert standby_health[0] == 200
        assert (await http_get(ports["standby-scheduler"], "/readyz"))[0] == 503
        status, text = await http_get(ports["agent-1"], "/metrics")
        assert status == 200 and metric(text, "gpuherd_events_consumed_total") >= 10
        assert (await http_get(ports["agent-1"], "/nope"))[0] == 404

        await asyncio.sleep(5.5)  # one status period: every process has said where it stands
        out = subprocess.run(
            [sys.executable, "-m", "apps", "status", "--json"],
            env={**services.env, "NATS_URL": local_nats.url, "NATS_MONITOR_URL": local_nats.monitor_url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        view = json.loads(out.stdout)
        roles = sorted((s["service"], s["role"]) for s in view["services"])
        assert ("scheduler", "leader") in roles and ("scheduler", "standby") in roles and ("agent-n1", "agent") in roles
        leader = next(s for s in view["services"] if s["role"] == "leader")
        assert leader["lag"] == 0 and leader["decisions"] >= 6 and str(ports["scheduler"]) in leader["metrics_url"]
        assert {s["name"] for s in view["nats"]["streams"]} >= {"HERD", "HERD_INTAKE", "HERD_DEAD"}
        assert [(d["sync"], d["durable"]) for d in view["nats"]["durability"]] == [("always", True)]
        assert out.returncode == 1, "elastic, memory and analytics are not running: status says degraded"
    finally:
        await client.close()
        await log.close()
        services.stop_all()
