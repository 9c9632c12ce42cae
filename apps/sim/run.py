"""One simulation run: a trace's submissions on a cluster spec under a policy.

The deciders are the production classes (``apps.registry``): the scheduler's, the analytics
service's for duration predictions and energy saving, and, when asked for, the elastic service's
and the memory broker's. Trace jobs reach the scheduler as intake submissions (source ``trace``),
judged by the real intake.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec

from apps.sim.cluster import ClusterSpec
from apps.sim.engine import Simulation, Timer
from apps.sim.model import GPUHERD, SimModel
from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.decider import Decider
from services.analytics.ces import CesParams
from services.analytics.decide import AnalyticsDecider
from services.analytics.predict import UNKNOWN
from services.elastic.decide import ElasticDecider
from services.elastic.service import TICK_S as ELASTIC_TICK_S
from services.memory.decide import MemoryDecider
from services.memory.service import TICK_S as MEMORY_TICK_S
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission
from services.scheduler.policy import make_policy

SOURCE = "trace"  # the intake source trace jobs are submitted under


def make_deciders(
    policy: str,
    *,
    predict: bool = True,
    ces: dict[str, Any] | None = None,
    elastic: bool = False,
    memory: bool = False,
    estimates: Mapping[str, float] | None = None,
) -> tuple[list[Decider[Any]], list[Timer]]:
    """The deciders of a simulation and their timers: the scheduler under ``policy`` (its timer every
    ``tick_s``, set by ``simulate``), the analytics decider (predictions, or the ``estimates``
    given, and CES when ``ces`` is given: its parameters, ``{}`` for the defaults), and the elastic
    service and memory broker."""
    deciders: list[Decider[Any]] = [SchedulerDecider(make_policy(policy))]
    if predict or estimates is not None or ces is not None:  # (else it would only fold)
        energy = CesParams(**ces) if ces is not None else None
        deciders.append(AnalyticsDecider(predict=predict or estimates is not None, ces=energy, estimates=estimates))
    timers: list[Timer] = []
    if elastic:
        deciders.append(ElasticDecider())
        timers.append(Timer("elastic", ev.ElasticTicked, ELASTIC_TICK_S, lambda s: s.elastic_running > 0))
    if memory:
        deciders.append(MemoryDecider())
        timers.append(Timer("memory", ev.MemoryTicked, MEMORY_TICK_S, lambda s: bool(s.leases)))
    return deciders, timers


def as_submissions(jobs: Iterable[ev.JobSubmitted]) -> Iterator[Submission]:
    """Trace jobs (``JobSubmitted`` drafts: a spec and a time) as intake submissions; a user or a name
    the trace does not have is ``UNKNOWN`` (intake needs both; the duration model skips it)."""
    encode = msgspec.json.Encoder().encode
    for n, job in enumerate(jobs, 1):
        spec = job.spec
        if not spec.name.strip() or not spec.user.strip():
            spec = msgspec.structs.replace(spec, name=spec.name.strip() or UNKNOWN, user=spec.user.strip() or UNKNOWN)
        yield Submission(source=SOURCE, seq=n, data=encode(spec), at=job.at)


@dataclass
class SimResult:
    policy: str
    records: list[Record]  # the log; of a partitioned run, every VC's log one after the other
    wall_s: float
    submitted: int
    rejected: int
    logs: dict[str, list[Record]]  # each simulation's log: one ("") or, partitioned, one per VC

    @property
    def events(self) -> int:
        return len(self.records)


def simulate(
    submissions: Iterable[ev.JobSubmitted],
    cluster: ClusterSpec,
    policy: str,
    *,
    predict: bool = True,
    ces: dict[str, Any] | None = None,
    tick_s: float = 300.0,
    boot_s: float = 300.0,
    policy_params: dict[str, float] | None = None,
    on_submit: Callable[[int], None] | None = None,
    start: float = 0.0,
    elastic: bool = False,
    memory: bool = False,
    model: SimModel = GPUHERD,
    estimates: Mapping[str, float] | None = None,
    workers: int | None = None,
) -> SimResult:
    """Run ``submissions`` on ``cluster`` under ``policy``, modelled as ``model`` says. A partitioned
    model runs each VC as a cluster of its own, on its own nodes: on ``workers`` processes (default:
    one per core), since nothing passes between them; the logs are the same either way."""
    t0 = time.perf_counter()
    predict = predict and (model.predict_always or make_policy(policy).ranks_by_prediction)
    jobs = model.jobs(submissions, cluster.gpus_per_node)
    params = {**model.policy_params(), **(policy_params or {})}
    run = functools.partial(
        _simulate, policy=policy, predict=predict, ces=ces, tick_s=tick_s, boot_s=boot_s, policy_params=params,
        start=start, elastic=elastic, memory=memory, model=model, estimates=estimates,
    )  # fmt: skip
    if not model.partition_vcs:
        sim = run(jobs, cluster, on_submit=on_submit)
        logs = {"": list(sim.records)}
        submitted, rejected = sim.submitted, sim.rejected
    else:
        by_vc: dict[str, list[ev.JobSubmitted]] = {vc: [] for vc in cluster.vcs}
        outside: list[ev.JobSubmitted] = []
        for job in jobs:
            by_vc.get(job.spec.vc, outside).append(job)
        parts = {
            vc: (by_vc[vc], ClusterSpec(vcs={vc: spec}, gpus_per_node=cluster.gpus_per_node, island=cluster.island))
            for vc, spec in cluster.vcs.items()
        }
        if outside:  # jobs of a VC the cluster lacks: intake rejects them, as it would live
            first = dict(list(cluster.vcs.items())[:1])
            parts["(unknown VCs)"] = (outside, msgspec.structs.replace(cluster, vcs=first))
        logs, submitted, rejected = {}, 0, 0
        for vc, (log, n, refused) in _partitions(run, parts, on_submit, workers):
            logs[vc] = log
            submitted, rejected = submitted + n, rejected + refused
    records = [r for log in logs.values() for r in log]
    return SimResult(
        policy=policy,
        records=records,
        wall_s=time.perf_counter() - t0,
        submitted=submitted,
        rejected=rejected,
        logs=logs,
    )


Part = tuple[list[ev.JobSubmitted], ClusterSpec]
_LOG = msgspec.msgpack.Decoder(list[tuple[int, ev.AnyEvent]])


def _partitions(
    run: Callable[..., Simulation], parts: dict[str, Part], on_submit: Callable[[int], None] | None, workers: int | None
) -> Iterator[tuple[str, tuple[list[Record], int, int]]]:
    """Each VC's simulation: (its log, jobs submitted, rejected), in the VCs' order."""
    workers = min(len(parts), workers or os.cpu_count() or 1)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for vc, (jobs, cluster) in parts.items():
            sim = run(jobs, cluster, on_submit=on_submit)
            yield vc, (list(sim.records), sim.submitted, sim.rejected)
        return
    # Largest first, so the longest run starts at once; logs cross back as msgpack (fast both ways).
    order = sorted(parts, key=lambda vc: -len(parts[vc][0]))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {vc: pool.submit(_simulate_encoded, run, *parts[vc]) for vc in order}
        for vc in parts:
            data, submitted, rejected = futures[vc].result()
            if on_submit is not None:
                on_submit(submitted)
            yield vc, ([Record(seq, event) for seq, event in _LOG.decode(data)], submitted, rejected)


def _simulate_encoded(run: Callable[..., Simulation], jobs: list[ev.JobSubmitted], cluster: ClusterSpec) -> tuple:
    sim = run(jobs, cluster, on_submit=None)  # (its progress is reported when it is done)
    log = msgspec.msgpack.encode([(r.seq, r.event) for r in sim.records])
    return log, sim.submitted, sim.rejected


def _simulate(
    jobs: Iterable[ev.JobSubmitted],
    cluster: ClusterSpec,
    *,
    policy: str,
    predict: bool,
    ces: dict[str, Any] | None,
    tick_s: float,
    boot_s: float,
    policy_params: dict[str, float],
    on_submit: Callable[[int], None] | None,
    start: float,
    elastic: bool,
    memory: bool,
    model: SimModel,
    estimates: Mapping[str, float] | None,
) -> Simulation:
    deciders, timers = make_deciders(
        policy, predict=predict, ces=ces, elastic=elastic, memory=memory, estimates=estimates
    )
    timers = [Timer("scheduler", ev.ClockTicked, tick_s), *timers]
    if ces is not None:
        timers.append(Timer("analytics", ev.AnalyticsTicked, tick_s))
    sim = Simulation(
        deciders,
        timers=timers,
        boot_s=boot_s,
        checkpoint_cost=model.checkpoint_cost if model.checkpoint_costs else None,
        per_moment=model.per_second,
    )
    setup = [
        *cluster.setup_events(),
        ev.PolicyConfigured(policy=policy, backfill=model.backfill, params=dict(policy_params)),
    ]
    sim.setup(setup, at=start)
    sim.run(as_submissions(jobs), on_submit=on_submit)
    return sim
