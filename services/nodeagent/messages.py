"""What a job's processes (and their shim) tell their node agent (``gpuherd.control``), turned into
events: rescales done or failed, workers that died, leases given back, profiles; progress goes
to telemetry, and the leader rank's last report into the part's ``TaskEnded``. A worker that left
at a rescale makes the agent reconcile its job (a generation may need a new worker on its GPU)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import msgspec

from gpuherd import control
from gpuherd import events as ev
from gpuherd.errors import UNDECODABLE
from gpuherd.fold import ACTIVE
from gpuherd.log import TelemetryBus
from gpuherd.obs import get_logger
from services.nodeagent.executors import Executor, TaskKey
from services.nodeagent.leases import LeaseHoldings
from services.nodeagent.reconcile import checked_rescale, launch_for
from services.nodeagent.state import AgentState
from services.nodeagent.taskfiles import WorkerDeath
from services.nodeagent.writer import AgentWriter

log = get_logger("gpuherd.nodeagent")

MAX_GRAD_BYTES = 2**64 - 1  # a profile's gradient bytes, in all: what a snapshot's integers hold


class JobMessages:
    def __init__(
        self,
        node: str,
        state: Callable[[], AgentState],
        executor: Executor,
        writer: AgentWriter,
        telemetry: TelemetryBus,
        *,
        holdings: LeaseHoldings | None = None,
        reconcile_job: Callable[[str], None] | None = None,
    ) -> None:
        self.node = node
        self.holdings = holdings  # what borrowers hold on lender GPUs, for the memory reports
        # Asks the agent to reconcile a job soon: a worker of it left (None: no agent to ask).
        self.reconcile_job = reconcile_job
        self._state = state
        self.executor = executor
        self.writer = writer
        self.telemetry = telemetry
        self.progress: dict[TaskKey, dict[str, float]] = {}  # the latest report of each task's first rank

    def on_message(self, message: control.AgentMessage) -> None:
        key = TaskKey(message.job, message.attempt)
        if isinstance(message, control.Progress):
            self._on_progress(key, message)
        elif isinstance(message, control.RescaleReport):
            self._on_rescale(key, message)
        elif isinstance(message, control.WorkerExit):
            self._on_worker_exit(key, message)
        elif isinstance(message, control.LeaseReleased):
            self._on_lease_released(message)
        elif isinstance(message, control.LeaseHeld):
            self._on_lease_held(message)
        elif isinstance(message, control.ProfileReady) and key in self.executor.running():
            self._on_profile(key, message)

    def forget(self, job: str, current: int | None) -> None:
        """The job's attempts other than ``current`` ended: their reports are no longer needed."""
        self.progress = {k: v for k, v in self.progress.items() if k.job != job or k.attempt == current}

    def _on_progress(self, key: TaskKey, message: control.Progress) -> None:
        job = self._state().jobs.get(key.job)
        if job is None or key not in self.executor.running() or self.node not in job.nodes:
            return
        first = launch_for(job, self.node, resume=False, elapsed_s=0.0).rank_offset
        if job.spec.elastic is not None or message.rank == first:  # (an elastic job's rank 0 is whoever holds it)
            self.progress[key] = {"step": float(message.step), **message.values}
        payload = msgspec.json.encode(
            {"job": key.job, "attempt": key.attempt, "rank": message.rank, "step": message.step}
            | {"values": message.values, "at": message.at, "node": self.node}
        )
        self.writer.soon(self.telemetry.publish_telemetry(f"{self.node}.job.{key.job}", payload))

    def _on_rescale(self, key: TaskKey, message: control.RescaleReport) -> None:
        """A worker's word on a rescale: the new rank 0's first step at the new size, or a failed switch."""
        generation = str(message.generation)
        stamp = self.writer.stamp
        if message.event == "completed":
            checked = self._checked_rescale(key, message)
            if checked is None:
                return
            world, world_before, samples_per_s_before = checked
            event: ev.Event = ev.RescaleCompleted(
                **stamp("rescaled", key.job, str(key.attempt), generation),
                job=key.job,
                attempt=key.attempt,
                generation=message.generation,
                node=self.node,
                world=world,
                world_before=world_before,
                # Every phase, so pause and total can always be told (a stamp the worker lacks
                # takes the next one's: complete_phase_times).
                times=ev.complete_phase_times(message.times, fallback=message.at or self.writer.clock()),
                samples_per_s_before=samples_per_s_before,
            )
        elif message.event == "failed":
            event = ev.RescaleFailed(
                **stamp("rescale-failed", key.job, str(key.attempt), generation),
                job=key.job,
                attempt=key.attempt,
                generation=message.generation,
                node=self.node,
                reason=message.reason[:500],
                step=message.step,
            )
        else:
            log.info("elastic worker", job=key.job, message=message.event, generation=generation, reason=message.reason)
            if message.event == "left":
                self._on_left(key)
            return
        self.writer.append_soon(event)

    def _on_left(self, key: TaskKey) -> None:
        """A worker left at a rescale (its ``left-<gpu>.json`` is in the task's folder by now): a
        generation that names its GPU again (a rollback of that shrink, which may have reached the
        agent before the worker left) needs a new worker there, which reconciling starts now rather
        than at the job's next event."""
        job = self._state().jobs.get(key.job)
        if self.reconcile_job is not None and job is not None and job.attempt == key.attempt:
            self.reconcile_job(key.job)

    def _checked_rescale(self, key: TaskKey, message: control.RescaleReport) -> tuple[int, int, float | None] | None:
        """The report's worlds and throughput as the log may record them (``checked_rescale``), or
        None to drop it; what is changed is said."""
        reported = (message.world, message.world_before, message.samples_per_s_before)
        checked = checked_rescale(self._state().jobs.get(key.job), *reported)
        if checked is None:
            log.warning("dropped a rescale report with impossible worlds", job=key.job, reported=reported)
        elif checked != reported:
            log.warning("a rescale report's worlds or throughput changed", job=key.job, reported=reported, kept=checked)
        return checked

    def _on_worker_exit(self, key: TaskKey, message: control.WorkerExit) -> None:
        """The shim saw an elastic worker die outside a rescale (a leaving worker exits with 0)."""
        job = self._state().jobs.get(key.job)
        death = WorkerDeath(gpu=message.gpu, code=message.code, reason=message.reason)
        event = self.writer.events.worker_lost(job, key.attempt, death, self.writer.clock()) if job else None
        if event is None:
            return  # the attempt is ending, or not a worker of the current generation, or known already
        log.warning("elastic worker died", job=key.job, gpu=message.gpu, code=message.code)
        self.writer.append_soon(event)

    def _on_lease_released(self, message: control.LeaseReleased) -> None:
        if message.lease not in self._state().leases:
            log.warning("ignored a lease release for no lease of this node", lease=message.lease)
            return
        event = ev.MemoryLeaseReleased(
            **self.writer.stamp("released", message.lease, str(message.at)),
            lease=message.lease,
            job=message.job,
            gpus=message.gpus,
            reason=message.reason,
            node=self.node,
        )
        log.info("lease released", lease=message.lease, gpus=message.gpus)
        self.writer.append_soon(event)

    def _on_lease_held(self, message: control.LeaseHeld) -> None:
        lease = self._state().leases.get(message.lease)
        if lease is None or lease.job != message.job or lease.attempt != message.attempt:
            log.warning("ignored what a runtime holds of no lease of its own here", lease=message.lease)
            return
        if self.holdings is not None:
            self.holdings.said(message.lease, message.held_mb)

    def pass_profile_request(self, event: ev.ProfileRequested) -> None:
        """Leave the request where the job's leader rank looks for it (a request for a job not
        running here, or on an executor without processes, is not this agent's to answer)."""
        job = self._state().jobs.get(event.job)
        if job is None or job.status not in ACTIVE or self.node not in job.nodes:
            return
        key = TaskKey(job.job, job.attempt)
        if self.executor.request_profile(key, event.id, event.steps):
            log.info("profile requested", job=job.job, attempt=job.attempt, steps=event.steps)

    def _on_profile(self, key: TaskKey, message: control.ProfileReady) -> None:
        data = self.executor.profile_result(key, message.file)
        try:
            profile = msgspec.json.decode(data) if data is not None else None
        except UNDECODABLE:
            profile = None
        if not isinstance(profile, dict):
            log.warning("ignored a profile report without a readable profile", job=key.job, file=message.file)
            return
        if (problem := _profile_problem(profile)) is not None:
            log.warning("ignored a profile report with numbers no reader can use", job=key.job, problem=problem)
            return
        event = ev.ProfileReported(
            **self.writer.stamp("profile", key.job, str(key.attempt), str(message.rank), message.request),
            job=key.job,
            attempt=key.attempt,
            node=self.node,
            rank=message.rank,
            request=message.request,
            profile=profile,
        )
        self.writer.append_soon(event)


def _profile_problem(profile: dict[str, Any]) -> str | None:
    """Why a profile's numbers the elastic service models a job by (``step_s`` per ``batch_size``
    samples, each layer's ``grad_bytes``) cannot be recorded, if they cannot: it divides by the time
    per sample and keeps the gradient bytes' sum in its snapshots. Fields left out are the readers'
    to miss."""
    step_s, batch = profile.get("step_s"), profile.get("batch_size")
    if step_s is not None and not _is_positive_finite(step_s):
        return f"step_s is {step_s!r}, not a positive, finite number of seconds"
    if batch is not None and not (_is_count(batch, 2**63) and batch >= 1):
        return f"batch_size is {batch!r}, not a count of samples"
    if step_s is not None and batch is not None and not step_s / batch > 0:
        return f"a step of {step_s}s over {batch} samples is no time per sample (it rounds to 0)"
    layers = profile.get("layers")
    total = 0
    for n, layer in enumerate(layers if isinstance(layers, list) else []):
        grad_bytes = layer.get("grad_bytes", 0) if isinstance(layer, dict) else 0
        if not _is_count(grad_bytes, MAX_GRAD_BYTES + 1):
            return f"layers[{n}].grad_bytes is {grad_bytes!r}, not a count of bytes"
        total += grad_bytes
    if total > MAX_GRAD_BYTES:
        return f"the layers' grad_bytes add up to {total}, beyond 2**64-1"
    return None


def _is_count(value: Any, below: int) -> bool:
    """An integer (no bool) within 0..below-1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < below


def _is_positive_finite(value: Any) -> bool:
    """A number (no bool) above 0 that a float holds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int beyond any float
        return False
