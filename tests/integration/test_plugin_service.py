"""A new service is one folder: a spec and one decide function. Installed as a plugin (an entry
point of group ``gpuherd.services``), nothing else is edited, and it appears in the NATS permission
file, in the simulator and in ``gpuherd up``, where it runs and appends its decisions."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps import registry
from apps.cluster.local import ClusterLayout, LocalCluster
from apps.deployment import accounts
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.run import simulate
from gpuherd import events as ev
from gpuherd.client import Client
from gpuherd.errors import SubmissionError
from gpuherd.events.base import uncatalogue
from gpuherd.log import open_log
from gpuherd.runtime.audit import audit

TOY = '''
"""A toy service: says how many jobs wait whenever one is submitted."""

from gpuherd import events as ev
from gpuherd.runtime.decider import CoreFoldDecider
from gpuherd.runtime.spec import ServiceSpec, Simulated


class QueueCounted(ev.Decision, kw_only=True, frozen=True):
    """(The toy's own event: defining it is all it takes to add it to the catalogue.)"""

    job: str
    waiting: int

    def subject(self) -> str:
        return f"herd.cluster.{self.source}"


def decide(state, event):
    return [QueueCounted(job=event.job, waiting=len(state.queue))]


def toy() -> CoreFoldDecider:
    return CoreFoldDecider("toy", decide, follows=frozenset({ev.JobSubmitted}), emits=frozenset({QueueCounted}))


SPEC = ServiceSpec(
    name="toy",
    about="counts waiting jobs",
    role="decider",
    follows=frozenset({ev.JobSubmitted}),
    emits=frozenset({QueueCounted}),
    decider=toy,
    auditable=True,
    simulated=lambda switches: Simulated(toy()),
    local_argv=lambda ctx: [],
)
'''


@pytest.fixture
def toy_installed(tmp_path: Path) -> Iterator[Path]:
    """The toy package and its distribution's metadata (what ``pip install`` would leave), on the
    path of this process and of the processes it starts."""
    site = tmp_path / "site"
    (site / "toyherd").mkdir(parents=True)
    (site / "toyherd" / "__init__.py").write_text("")
    (site / "toyherd" / "spec.py").write_text(textwrap.dedent(TOY))
    meta = site / "toyherd-0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: toyherd\nVersion: 0.1\n")
    (meta / "entry_points.txt").write_text("[gpuherd.services]\ntoy = toyherd.spec:SPEC\n")
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), old) if p)
    registry.rediscover()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        sys.modules.pop("toyherd.spec", None)
        sys.modules.pop("toyherd", None)
        uncatalogue("QueueCounted")
        registry.rediscover()


def test_a_plugin_service_is_found_secured_and_simulated(toy_installed: Path) -> None:
    toy = registry.spec("toy")
    assert toy.name in registry.required() and toy.name in registry.auditable()
    conf = accounts()
    assert "user: toy," in conf and '"herd.cluster.toy"' in conf, "its NATS user may append what it emits"

    def job(name: str, at: float) -> ev.JobSubmitted:
        spec = ev.JobSpec(name=name, user="ana", gpus=4, duration_s=100.0, vc="a")
        return ev.JobSubmitted(job=name, spec=spec, at=at, intake_source="t")

    cluster = ClusterSpec(vcs={"a": VcSpec(nodes=1)}, gpus_per_node=4)
    result = simulate([job("j1", 0.0), job("j2", 1.0), job("j3", 2.0)], cluster, "fifo")
    counted = [r.event for r in result.records if type(r.event).__name__ == "QueueCounted"]
    assert len(counted) == 3 and counted[-1].waiting >= 1, counted
    report = audit(result.records, registry.make_decider("toy"))
    assert report.ok and report.decisions_checked == 3


async def submit_once_a_node_is_up(client: Client, spec: dict, timeout: float = 60.0) -> str:
    """Submit, again while the scheduler says no node has registered yet (the cluster's start returns
    once its processes run; on a slow machine the agent's registration may still be on its way)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return await client.submit(spec)
        except SubmissionError as exc:
            if "no GPU nodes have registered" not in str(exc) or asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.5)


@pytest.mark.slow
async def test_a_plugin_service_runs_in_gpuherd_up(toy_installed: Path, tmp_path: Path) -> None:
    layout = ClusterLayout(sim_agents=1, sim_gpus=2, lost_after_s=10.0)
    cluster = LocalCluster(tmp_path / "cluster", layout)
    url = await asyncio.to_thread(cluster.start)
    try:
        assert "toy" in {p.name for p in cluster.procs}
        client = await Client.connect(url, source="test")
        try:
            job = await submit_once_a_node_is_up(client, {"name": "j", "user": "ana", "gpus": 1, "duration_s": 1.0})
        finally:
            await client.close()
        log_ = await open_log(url, name="test-reader", persistent=False)
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                records = await log_.read_all()
                counted = [r.event for r in records if type(r.event).__name__ == "QueueCounted"]
                if counted or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.3)
        finally:
            await log_.close()
        assert [e.job for e in counted] == [job] and counted[0].source == "toy"
    finally:
        await asyncio.to_thread(cluster.stop)


def test_a_plugin_service_that_cannot_start_leaves_no_process_of_gpuherd_up_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: object) -> list[str]:
        raise RuntimeError("the plugin cannot say how it starts")

    specs = registry.specs
    plugin = dataclasses.replace(registry.spec("dashboard"), name="zz-broken", local_argv=broken)
    monkeypatch.setattr(registry, "specs", lambda: [*specs(), plugin])
    cluster = LocalCluster(tmp_path / "cluster", ClusterLayout(sim_agents=1))
    try:
        with pytest.raises(RuntimeError, match="cannot say how it starts"):
            cluster.start()
        assert cluster.server is not None and cluster.server.proc is not None
        assert cluster.server.proc.poll() is not None, "the embedded nats-server is stopped"
    finally:
        cluster.stop()
