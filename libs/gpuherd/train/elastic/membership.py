"""The handoff protocol: one worker's view of the job's generations, and how every rank moves to the
next one together at a step boundary (agree, quiesce, re-form, restore; roll back on failure)."""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gpuherd.jobenv import ElasticPlan
from gpuherd.train.elastic.errors import ElasticError, first_line, is_collective_failure
from gpuherd.train.elastic.plans import PlanSource, RescalePhases
from gpuherd.train.elastic.state import ElasticState
from gpuherd.train.elastic.store import (
    STORE_GENERATION_KEY,
    STORE_RETRY_EVERY_S,
    STORE_TRY_S,
    store_client,
    wait_for_port,
)

Reporter = Callable[[dict[str, Any]], None]


def _report_to_agent(message: dict[str, Any]) -> None:
    from gpuherd import control
    from gpuherd.train.report import send

    send(control.RescaleReport, **message)


class Membership:
    """One worker of an elastic job: which generation it is in, and how it moves to the next.

    A switch happens at a step boundary that every rank of the current generation agrees on, with
    one small all-reduce per step: the newest generation each has seen (max and min must agree) and,
    for a grow, whether every new worker is ready (new workers start, import and connect to the new
    generation's store, hosted by its rank 0, while the old ones keep training). Then every rank
    commits its state in memory, leaves the old group, joins the new one through that generation's
    own store, and takes the source's state. A switch that fails rolls back to the committed state
    and waits for the scheduler's next plan; so does a group broken by a dead peer."""

    def __init__(
        self,
        worker: str,
        plans: PlanSource,
        *,
        backend: str = "gloo",
        device: torch.device | None = None,
        reform_timeout_s: float = 30.0,
        join_timeout_s: float = 300.0,
        recover_timeout_s: float = 120.0,
        poll_s: float = 0.02,
        store_retry_s: float | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        self.worker = worker
        self.plans = plans
        self.backend = backend
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None)
        self.reform_timeout_s = reform_timeout_s
        self.join_timeout_s = join_timeout_s
        self.recover_timeout_s = recover_timeout_s
        self.poll_s = poll_s
        # How long opening or reaching a generation's store is retried before the switch is given up
        # (a port still held by a process that is ending, a host that is late): bounded, so that the
        # scheduler's rollback (a new port) still comes.
        self.store_retry_s = reform_timeout_s if store_retry_s is None else store_retry_s
        self.report = reporter or _report_to_agent
        self.current: ElasticPlan | None = None
        self.left = False
        self.history: list[RescalePhases] = []  # this worker's rescales (as new rank 0 or not)
        self._broken: str | None = None
        self._store: tuple[int, dist.TCPStore] | None = None  # (generation, store) this worker hosts
        self._ddp: tuple[int, torch.nn.Module] | None = None
        self._noticed: dict[int, float] = {}
        self._pending: RescalePhases | None = None
        self._step_times: list[float] = []
        self._unhostable: set[int] = set()  # generations whose store this worker gave up opening
        self._host_failing: dict[int, tuple[float, float]] = {}  # generation -> (first failure, next try)
        self._batch: int | None = None  # the global batch (for the throughput reported at a rescale)

    # -- what the training loop sees ---------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.current.rank_of(self.worker) if self.current is not None else -1

    @property
    def world(self) -> int:
        return self.current.world if self.current is not None else 0

    def ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.current is None:
            raise ElasticError("call sync() first: this worker has not joined a generation yet")
        if self._ddp is None or self._ddp[0] != self.current.generation:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.device.index] if self.device is not None and self.device.type == "cuda" else None
            self._ddp = (self.current.generation, DistributedDataParallel(model, device_ids=device_ids))
        return self._ddp[1]

    def broken(self, reason: str) -> None:
        """The group failed during a step (``ElasticState.guard``): recover at the next sync."""
        self._broken = reason

    def sync(self, state: ElasticState) -> bool:
        now = time.time()
        self._step_times = [*self._step_times[-20:], now]
        if self._pending is not None:
            self._pending.first_step_at = now
            self._complete(self._pending)
            self._pending = None
        if self.left:
            return False
        if self.current is None:
            ok = self._start(state)
        elif self._broken is not None:
            ok = self._recover(state)
        else:
            ok = self._at_boundary(state)
        if ok:
            state._mark()
        return ok

    # -- the steps of a rescale -----------------------------------------------------------------------

    def _newer(self) -> ElasticPlan | None:
        plan = self.plans.latest()
        if plan is None or self.current is None or plan.generation <= self.current.generation:
            return None
        self._noticed.setdefault(plan.generation, time.time())
        return plan

    def _at_boundary(self, state: ElasticState) -> bool:
        assert self.current is not None
        plan = self._newer()
        seen = plan.generation if plan is not None else self.current.generation
        ready = self._ready(plan)
        agreed = torch.tensor([seen, -seen, ready], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            self._broken = f"the step-boundary agreement failed: {first_line(exc)}"
            return self._recover(state)
        newest, oldest, all_ready = (int(v) for v in agreed.cpu())
        if plan is None or newest != -oldest or newest != plan.generation or not all_ready:
            return True  # nothing to do, or not every rank has seen the plan yet, or new workers still start
        return self._switch(state, plan)

    def _ready(self, plan: ElasticPlan | None) -> int:
        """This rank's word on whether the plan's new workers are ready: only the plan's rank 0 (who
        hosts its store) can tell, the others say 0; the all-reduce takes the max."""
        if plan is None:
            return 0
        if not plan.joiners or plan.workers[0] in plan.joiners:
            return 1
        if plan.rank_of(self.worker) != 0:
            return 0
        if plan.generation in self._unhostable:
            return 0
        first, next_try = self._host_failing.get(plan.generation, (0.0, 0.0))
        now = time.monotonic()
        if now < next_try:
            return 0  # training goes on; the store is tried again at a later step boundary
        try:
            store = self._host(plan)
            return int(store.check([f"ready/{j}" for j in plan.joiners]))
        except Exception as exc:
            # The port may still be held (a process that is ending, a connection in TIME_WAIT):
            # try again, at most every half second, for store_retry_s. Then no store, no switch:
            # say so once, and the scheduler commits a rollback generation (a new port) that
            # replaces this plan. Training goes on meanwhile.
            first = first or now
            self._host_failing[plan.generation] = (first, now + STORE_RETRY_EVERY_S)
            if now - first >= self.store_retry_s:
                self._unhostable.add(plan.generation)
                reason = (
                    f"cannot open the store at {plan.addr}:{plan.port} (tried for {now - first:.0f}s): "
                    f"{first_line(exc)}"
                )
                self.report({"event": "failed", "generation": plan.generation, "reason": reason})
            return 0

    def _host(self, plan: ElasticPlan) -> dist.TCPStore:
        """The generation's rendezvous store, hosted by its rank 0 (opened early for a grow, so new
        workers connect while the old ones train)."""
        if self._store is None or self._store[0] != plan.generation:
            self._store = None
            store = dist.TCPStore(
                plan.addr,
                plan.port,
                None,
                True,
                timeout=datetime.timedelta(seconds=self.reform_timeout_s),
                wait_for_workers=False,
            )
            store.set(STORE_GENERATION_KEY, str(plan.generation))
            self._store = (plan.generation, store)
        return self._store[1]

    def _switch(self, state: ElasticState, plan: ElasticPlan) -> bool:
        assert self.current is not None
        phases = self._phases(plan)
        if plan.source != self.current.workers[0] and self.current.world > 1:
            # DDP broadcasts its rank 0's buffers at every forward, so the buffers the job would train
            # on next are the old rank 0's, not the source's own (its BatchNorm statistics are of its
            # shard only): the source takes them before the snapshot, as a run without rescale would.
            try:
                state.adopt_buffers_of(0)
            except Exception as exc:
                if not is_collective_failure(exc):
                    raise
                self._broken = f"taking rank 0's buffers before the switch failed: {first_line(exc)}"
                return self._recover(state)
        snapshot = state.capture()  # every rank is at the same step boundary: the all-reduce said so
        phases.quiesced_at = time.time()
        self._teardown(keep_store=plan)
        if plan.rank_of(self.worker) < 0:
            self._leave(plan)
            return False
        return self._enter(state, plan, snapshot, phases)

    def _phases(self, plan: ElasticPlan) -> RescalePhases:
        before = self.current.world if self.current is not None else 0
        return RescalePhases(
            generation=plan.generation,
            world=plan.world,
            decided_at=plan.decided_at,
            noticed_at=self._noticed.get(plan.generation, time.time()),
            world_before=before,
            samples_per_s_before=self._throughput(self.current),
        )

    def _throughput(self, plan: ElasticPlan | None) -> float | None:
        """Samples per second over the recent steps of the current generation (global batch / median step)."""
        times = self._step_times
        if plan is None or len(times) < 4 or self._batch is None:
            return None
        gaps = sorted(b - a for a, b in itertools.pairwise(times[-11:]))
        median = gaps[len(gaps) // 2]
        return self._batch / median if median > 0 else None

    def _enter(
        self, state: ElasticState, plan: ElasticPlan, snapshot: dict[str, Any] | None, phases: RescalePhases
    ) -> bool:
        """Join ``plan``'s group and take its source's state; on failure roll back and wait for the next plan."""
        joining = self.current is None or snapshot is None
        try:
            self._form(plan, joining=joining)
            phases.reformed_at = time.time()
            source = plan.rank_of(plan.source)
            if source < 0:
                raise ElasticError(f"generation {plan.generation}: its source {plan.source} is not one of its workers")
            held = state.broadcast(snapshot if plan.source == self.worker else None, src=source)
            state.adapt(plan.world, int(held.get("world", 0)))
            phases.restored_at = time.time()
        except Exception as exc:
            return self._failed(state, plan, snapshot, phases, f"{type(exc).__name__}: {first_line(exc)}")
        self.current = plan
        self._batch = state.sampler.global_batch  # after adapt(): an LR-scaling rule resizes the batch
        self._step_times = []  # throughput is measured per generation
        self._store = None if self._store is not None and self._store[0] != plan.generation else self._store
        self.history.append(phases)
        if plan.rank_of(self.worker) == 0 and plan.generation > 0:
            self._pending = phases  # reported once the first step at the new size is done
        return True

    def _form(self, plan: ElasticPlan, *, joining: bool) -> None:
        rank = plan.rank_of(self.worker)
        timeout = datetime.timedelta(seconds=self.join_timeout_s if joining else self.reform_timeout_s)
        store = self._host_patiently(plan) if rank == 0 else self._connect(plan, timeout)
        if self.worker in plan.joiners:
            store.set(f"ready/{self.worker}", "1")
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"g{plan.generation}", store),
            rank=rank,
            world_size=plan.world,
            timeout=timeout,
        )

    def _host_patiently(self, plan: ElasticPlan) -> dist.TCPStore:
        """Open the generation's store, trying again for ``store_retry_s`` while its port is busy."""
        deadline = time.monotonic() + self.store_retry_s
        while True:
            try:
                return self._host(plan)
            except dist.DistError as exc:
                if self._superseded(plan):
                    raise ElasticError(f"a newer plan replaced generation {plan.generation}") from exc
                if time.monotonic() > deadline:
                    raise ElasticError(
                        f"cannot open the store at {plan.addr}:{plan.port} (tried for {self.store_retry_s:.0f}s): "
                        f"{first_line(exc)}"
                    ) from exc
                time.sleep(STORE_RETRY_EVERY_S)

    def _connect(self, plan: ElasticPlan, timeout: datetime.timedelta) -> dist.TCPStore:
        """A client of the generation's store, once its host serves this generation. The host may be
        late (still starting, or retrying a busy port), and until it listens another process may
        hold the port: each try is bounded (a client of something that is not a store would wait
        forever), and tries go on until ``timeout`` or a newer plan."""
        deadline = time.monotonic() + timeout.total_seconds()
        superseded = lambda: self._superseded(plan)  # noqa: E731
        problem = "no answer"
        while True:
            left = deadline - time.monotonic()
            # Poll for the host's port ourselves: the store client backs off for long between tries,
            # and a new worker must be ready the moment the host opens the store.
            wait_for_port(plan.addr, plan.port, max(left, 0.0), self.poll_s, superseded)
            try:
                store = store_client(plan.addr, plan.port, min(max(left, 1.0), STORE_TRY_S), timeout)
                found = store.get(STORE_GENERATION_KEY).decode() if store.check([STORE_GENERATION_KEY]) else None
                if found == str(plan.generation):
                    return store
                problem = "it serves no generation yet" if found is None else f"it serves generation {found}"
            except (dist.DistError, TimeoutError) as exc:
                problem = first_line(exc)
            if superseded():
                raise ElasticError(f"a newer plan replaced generation {plan.generation}")
            if time.monotonic() > deadline:
                raise ElasticError(
                    f"no store for generation {plan.generation} at {plan.addr}:{plan.port} within "
                    f"{timeout.total_seconds():.0f}s: {problem}"
                )
            time.sleep(max(self.poll_s, 0.05))

    def _superseded(self, plan: ElasticPlan) -> bool:
        newest = self.plans.latest()
        return newest is not None and newest.generation > plan.generation

    def _failed(
        self,
        state: ElasticState,
        plan: ElasticPlan,
        snapshot: dict[str, Any] | None,
        phases: RescalePhases,
        reason: str,
    ) -> bool:
        if snapshot is not None:
            state.restore(snapshot)  # back to what was committed at the old size: no progress lost
        self._teardown()
        self.report({"event": "failed", "generation": plan.generation, "reason": reason, "step": state.step})
        following = self._wait(lambda p: p.generation > plan.generation, self.recover_timeout_s)
        if following is None:
            raise ElasticError(
                f"the switch to generation {plan.generation} failed ({reason}) and no new plan came within "
                f"{self.recover_timeout_s:.0f}s"
            )
        if following.rank_of(self.worker) < 0:
            self._leave(following)
            return False
        retry = self._phases(following)
        retry.quiesced_at = phases.quiesced_at or time.time()  # training has stood still since then
        return self._enter(state, following, snapshot, retry)

    def _recover(self, state: ElasticState) -> bool:
        """A peer died: the state is back at the step's start (``guard``); wait for the scheduler's
        plan without the dead worker and re-form with it."""
        assert self.current is not None
        reason, self._broken = self._broken or "the group broke", None
        self._teardown()
        self.report({"event": "peer-lost", "generation": self.current.generation, "reason": reason, "step": state.step})
        following = self._wait(lambda p: p.generation > self.current.generation, self.recover_timeout_s)
        if following is None:
            raise ElasticError(f"{reason}; no plan without the lost worker came within {self.recover_timeout_s:.0f}s")
        if following.rank_of(self.worker) < 0:
            self._leave(following)
            return False
        phases = self._phases(following)
        phases.quiesced_at = time.time()
        return self._enter(state, following, state.capture(), phases)

    def _start(self, state: ElasticState) -> bool:
        """The first sync: the job's first generation (every worker starts together) or joining a
        running job (a grow): connect, say ready, and take the source's state."""
        plan = self._wait(lambda p: p.rank_of(self.worker) >= 0, self.join_timeout_s)
        if plan is None:
            raise ElasticError(f"worker {self.worker} found no plan naming it within {self.join_timeout_s:.0f}s")
        phases = self._phases(plan)
        # Nothing trained at an older size here (the job grew before its first generation formed,
        # or this worker joins): from now on it stands still until its first step at the new size.
        phases.quiesced_at = time.time()
        if self.worker not in plan.joiners:
            return self._enter(state, plan, state.capture(), phases)
        return self._enter(state, plan, None, phases)

    def _leave(self, plan: ElasticPlan) -> None:
        self.left = True
        self.current = plan
        self.report({"event": "left", "generation": plan.generation})

    def _wait(self, wanted: Callable[[ElasticPlan], bool], timeout_s: float) -> ElasticPlan | None:
        deadline = time.monotonic() + timeout_s
        while True:
            plan = self.plans.latest()
            if plan is not None and wanted(plan):
                self._noticed.setdefault(plan.generation, time.time())
                return plan
            if time.monotonic() > deadline:
                return None
            time.sleep(self.poll_s)

    def _teardown(self, keep_store: ElasticPlan | None = None) -> None:
        self._release_ddp()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store is not None and (keep_store is None or self._store[0] != keep_store.generation):
            self._store = None

    def _release_ddp(self) -> None:
        """Let the DDP wrapper's reducer go while its process group is still registered. The training
        loop may still hold the wrapper; if the reducer were the group's last owner, the group's
        destructor would run under the GIL and wait for gloo's threads, which may need the GIL to
        free the last collective's tensors: a deadlock (pytorch/pytorch#56297)."""
        if self._ddp is not None:
            ddp = self._ddp[1]
            for attribute in ("logger", "reducer"):
                if hasattr(ddp, attribute):
                    setattr(ddp, attribute, None)
        self._ddp = None

    def _complete(self, phases: RescalePhases) -> None:
        self.report(
            {
                "event": "completed",
                "generation": phases.generation,
                "world": phases.world,
                "world_before": phases.world_before,
                "samples_per_s_before": phases.samples_per_s_before,
                "times": {
                    "decided": phases.decided_at,
                    "noticed": phases.noticed_at,
                    "quiesced": phases.quiesced_at,
                    "reformed": phases.reformed_at,
                    "restored": phases.restored_at,
                    "first_step": phases.first_step_at,
                },
            }
        )

    def close(self) -> None:
        self._teardown()
