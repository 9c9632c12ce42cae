"""One simulation run: a trace's submissions on a cluster spec under a policy.

The deciders are the production classes, each service taking part as its spec says
(``ServiceSpec.simulated``): the scheduler's, the analytics service's for duration predictions and
energy saving, and, when asked for, the elastic service's and the memory broker's. Trace jobs reach
the scheduler as intake submissions (source ``trace``), judged by the real intake.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import multiprocessing
import operator
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from apps import registry
from apps.sim.cluster import ClusterSpec
from apps.sim.elastic import ElasticRuns, ElasticWorkload, make_elastic
from apps.sim.engine import Simulation, SimulationError, Timer
from apps.sim.model import GPUHERD, SimModel
from gpuherd import events as ev
from gpuherd.log import Record
from gpuherd.runtime.decider import Decider
from gpuherd.scaling import DEFAULT_LATENCY_S
from services.analytics.jobs import JobTable, merge_tables
from services.analytics.predict import UNKNOWN
from services.analytics.traces import Trace
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
    predictor: Mapping[str, Any] | None = None,
    tick_s: float = 300.0,
    **switches: Any,
) -> tuple[list[Decider[Any]], list[Timer]]:
    """The deciders of a simulation and their timers, from every service's spec (``simulated``: its
    part, given the simulation's switches). The switches the built-in services read: ``policy``, the
    scheduler's (its timer every ``tick_s`` while jobs wait); ``predict``, ``estimates``,
    ``predictor`` and ``ces``, the analytics service's (predictions, given estimates, the duration
    model's settings, energy saving on its timer every ``tick_s``); ``elastic`` and ``memory``,
    whether the elastic service and the memory broker take part. The judge of submissions decides
    first, then the others by name."""
    given = {"policy": policy, "predict": predict, "ces": ces, "elastic": elastic, "memory": memory}
    given |= {"estimates": estimates, "tick_s": tick_s, "predictor": predictor, **switches}
    deciders: list[Decider[Any]] = []
    timers: list[Timer] = []
    for spec in sorted(registry.specs(), key=lambda s: (not s.takes_intake, s.name)):
        part = spec.simulated(given) if spec.simulated is not None else None
        if part is None:
            continue
        deciders.append(part.decider)
        timer = spec.timer
        if timer is not None and part.tick_every_s is not None and timer.active(part.decider):
            timers.append(
                Timer(
                    spec.name, timer.tick, part.tick_every_s, needed=timer.needed, on_grid=timer.on_grid, due=timer.due
                )
            )
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
    records: list[Record]  # the log; of a partitioned run, every VC's log one after the other ([]: not kept)
    wall_s: float
    submitted: int
    rejected: int
    logs: dict[str, list[Record]]  # each simulation's log: one ("") or, partitioned, one per VC
    table: Trace  # the job table, folded as the simulation ran (so a run need not keep its log)
    events: int  # records appended, kept or not
    digest: str = ""  # with ``digest``: a hash of every event in order (partitioned: of each VC's, in order)


class _Part(NamedTuple):
    """One simulation's outcome: its log (or none), job table, event count, digest, counts."""

    log: list[Record]
    table: Trace
    events: int
    digest: str
    submitted: int
    rejected: int


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
    keep_log: bool = True,
    digest: bool = False,
    elastic_jobs: ElasticWorkload | None = None,
    predictor: Mapping[str, Any] | None = None,
) -> SimResult:
    """Run ``submissions`` on ``cluster`` under ``policy``, modelled as ``model`` says. A partitioned
    model runs each VC as a cluster of its own, on its own nodes: on ``workers`` processes (default:
    one per core), since nothing passes between them; the logs are the same either way.
    ``keep_log`` False keeps no log (only the job table, built as it runs: far less memory);
    ``digest`` hashes every event (to compare runs without keeping them); ``elastic_jobs`` makes a
    seeded share of the jobs elastic and runs the elastic service. ``estimates`` (intake id -> seconds)
    replace the duration model's predictions; when every job has one, the model is not trained at all
    (the same log, without its cost)."""
    if not tick_s > 0:  # (the virtual clock would never move past a tick of 0 s or less)
        raise SimulationError(f"a clock tick is a number of seconds > 0, got {tick_s}")
    t0 = time.perf_counter()
    predict = predict and (model.predict_always or make_policy(policy).ranks_by_prediction)
    if elastic_jobs is not None:  # a seeded share of the trace's jobs made elastic (the elastic service on)
        submissions, elastic = make_elastic(submissions, elastic_jobs), True
    jobs: Iterable[ev.JobSubmitted] = model.jobs(submissions, cluster.gpus_per_node)
    covered = False  # every job has an estimate: the duration model would go unused
    if predict and estimates is not None:
        jobs = list(jobs)
        covered = all((job.spec.intake_id or "") in estimates for job in jobs)
    params = {**model.policy_params(), **(policy_params or {})}
    run = functools.partial(
        _simulate, policy=policy, predict=predict, ces=ces, tick_s=tick_s, boot_s=boot_s, policy_params=params,
        start=start, elastic=elastic, memory=memory, model=model, estimates=estimates, keep_log=keep_log,
        digest=digest, predictor=predictor, estimates_cover_all=covered,
    )  # fmt: skip
    if not model.partition_vcs:
        parts = {"": run(jobs, cluster, on_submit=on_submit)}
    else:
        by_vc: dict[str, list[ev.JobSubmitted]] = {vc: [] for vc in cluster.vcs}
        outside: list[ev.JobSubmitted] = []
        for job in jobs:
            by_vc.get(job.spec.vc, outside).append(job)
        inputs = {
            vc: (by_vc[vc], ClusterSpec(vcs={vc: spec}, gpus_per_node=cluster.gpus_per_node, island=cluster.island))
            for vc, spec in cluster.vcs.items()
        }
        if outside:  # jobs of a VC the cluster lacks: intake rejects them, as it would live
            first = dict(list(cluster.vcs.items())[:1])
            inputs["(unknown VCs)"] = (outside, msgspec.structs.replace(cluster, vcs=first))
        parts = dict(_partitions(run, inputs, on_submit, workers))
    logs = {vc: part.log for vc, part in parts.items()}
    if len(parts) == 1:
        (only,) = parts.values()
        table, hashed = only.table, only.digest
    else:
        table = merge_tables([p.table for p in parts.values()], name="log")
        hashed = _digest_of(p.digest for p in parts.values()) if digest else ""
    return SimResult(
        policy=policy,
        records=[r for log in logs.values() for r in log],
        wall_s=time.perf_counter() - t0,
        submitted=sum(p.submitted for p in parts.values()),
        rejected=sum(p.rejected for p in parts.values()),
        logs=logs,
        table=table,
        events=sum(p.events for p in parts.values()),
        digest=hashed,
    )


def _digest_of(parts: Iterable[str]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for part in parts:
        h.update(part.encode())
    return h.hexdigest()


Inputs = tuple[list[ev.JobSubmitted], ClusterSpec]
_LOG = msgspec.msgpack.Decoder(list[tuple[int, ev.any_event()]])


def _partitions(
    run: Callable[..., _Part], inputs: dict[str, Inputs], on_submit: Callable[[int], None] | None, workers: int | None
) -> Iterator[tuple[str, _Part]]:
    """Each VC's simulation, in the VCs' order. One that fails (or Ctrl-C) ends the others at once."""
    workers = min(len(inputs), workers or os.cpu_count() or 1)
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for vc, (jobs, cluster) in inputs.items():
            yield vc, run(jobs, cluster, on_submit=on_submit)
        return
    # Largest first, so the longest run starts at once; logs cross back as msgpack (fast both ways).
    # The inputs go to the workers as forked memory (an initializer's arguments are not pickled under
    # fork): pickling every VC's jobs through the pool's queue cost more than a small VC's run.
    order = sorted(inputs, key=lambda vc: -len(inputs[vc][0]))
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_inherit,
        initargs=(run, inputs, os.getpid()),
    )
    try:
        futures = {pool.submit(_simulate_inherited, vc): vc for vc in order}
        finished: dict[str, tuple[bytes, _Part]] = {}
        in_order = iter(inputs)
        next_vc = next(in_order, None)
        # As each finishes, not in the VCs' order: a failure is raised as soon as it happens.
        for future in concurrent.futures.as_completed(futures):
            vc = futures[future]
            finished[vc] = future.result()
            if on_submit is not None:
                on_submit(finished[vc][1].submitted)
            while next_vc in finished:
                data, part = finished.pop(next_vc)
                log = [Record(seq, event) for seq, event in _LOG.decode(data)] if data else []
                yield next_vc, part._replace(log=log)
                next_vc = next(in_order, None)
    except BaseException:  # (a VC failed, Ctrl-C, or the caller stopped early)
        _stop_workers(pool)
        raise
    pool.shutdown()


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End a pool's workers now: ``shutdown`` would wait for the VCs they run, and for every VC not
    begun (Python 3.14's ``kill_workers``)."""
    # (shutdown forgets both.) The pool's manager thread reaps the workers it sees die: joined here
    # at the same time, a worker could stay listed as running after it was gone (two waitpid calls,
    # one of them answered "no such child"), so that thread is let finish first.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()
    if manager is not None:
        manager.join(_STOP_S)
    for process in processes:
        process.join(_STOP_S)


_STOP_S = 10.0  # how long a killed worker may take to be gone
_inherited: tuple[Callable[..., _Part], dict[str, Inputs]] | None = None  # (set in a worker only)
_PR_SET_PDEATHSIG = 1  # (linux/prctl.h)


def _inherit(run: Callable[..., _Part], inputs: dict[str, Inputs], parent: int) -> None:
    """A worker's start: keep what its parent had when it forked, and end when its parent ends."""
    global _inherited
    _die_with_parent(parent)
    _inherited = (run, inputs)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this worker when its parent ends, however it ends (a sweep stops a run
    with SIGTERM, the kernel kills one for want of memory): else the worker, re-parented, would finish
    its VC and then wait for more forever. Linux only; elsewhere a run that ends by an exception
    (a failure, Ctrl-C) still stops its workers (``_partitions``)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # (it ended before the prctl: no signal will come)
        os._exit(1)


def _simulate_inherited(vc: str) -> tuple:
    assert _inherited is not None, "a worker of _partitions' pool"
    run, inputs = _inherited
    jobs, cluster = inputs[vc]
    part = run(jobs, cluster, on_submit=None)  # (its progress is reported when it is done)
    data = msgspec.msgpack.encode([(r.seq, r.event) for r in part.log]) if part.log else b""
    return data, part._replace(log=[])


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
    keep_log: bool,
    digest: bool,
    predictor: Mapping[str, Any] | None,
    estimates_cover_all: bool,
) -> _Part:
    # (The scheduler's tick decides something only while jobs wait: a simulation hears no heartbeats,
    # so it never finds a node lost. It pauses while none does, and keeps its times.)
    deciders, timers = make_deciders(
        policy,
        predict=predict,
        ces=ces,
        elastic=elastic,
        memory=memory,
        estimates=estimates,
        tick_s=tick_s,
        predictor=predictor,
        estimates_cover_all=estimates_cover_all,
    )
    table = JobTable()
    sinks: list[Callable[[Sequence[Record]], None]] = [table.add_records]
    hasher = hashlib.blake2b(digest_size=12)
    if digest:
        encode = msgspec.msgpack.Encoder().encode
        event_of = operator.attrgetter("event")
        # (One update per run of records: the digest of the concatenation is the same.)
        sinks.append(lambda records: hasher.update(b"".join(map(encode, map(event_of, records)))))
    sim = Simulation(
        deciders,
        timers=timers,
        boot_s=boot_s,
        checkpoint_cost=model.checkpoint_cost if model.checkpoint_costs else None,
        per_moment=model.per_second,
        keep_log=keep_log,
        sinks=sinks,
        elastic_runs=ElasticRuns(model.rescale_costs, model.allreduce_bandwidth, DEFAULT_LATENCY_S),
    )
    setup = [
        *cluster.setup_events(),
        ev.PolicyConfigured(policy=policy, backfill=model.backfill, params=dict(policy_params)),
        # The broker's rules, as a live broker records them at start (a log with none reads as the first).
        *([ev.MemoryBrokerConfigured()] if memory else []),
    ]
    sim.setup(setup, at=start)
    sim.run(as_submissions(jobs), on_submit=on_submit)
    hashed = hasher.hexdigest() if digest else ""
    return _Part(list(sim.records), table.trace(), sim.appended, hashed, sim.submitted, sim.rejected)
