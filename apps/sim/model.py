"""How a simulation models the cluster: gpuherd's own model by default (what runs live), or that of
another simulator, switch by switch, to compare results on the same input.

Each switch, with gpuherd's default (what runs live) -> the ``helios`` model:

- ``partition_vcs``: VCs are quotas over one shared pool of nodes -> each VC alone on its own nodes.
- ``backfill``: on (a later job may start if it ends before the head's reservation) -> off
  (allocation stops at the first job that does not fit).
- ``consolidate``: a job's GPUs may spread over nodes where none has room for all -> a job of up to
  a node's GPUs on one node, a larger one on whole nodes.
- ``per_second``: each end and arrival decided as it happens -> all ends, then all arrivals of one
  second, then one pass; durations in whole seconds.
- ``checkpoint_costs``: each preemption costs a restore of ``RESTART_S`` (3.5 s: what
  ``bench/bench_elastic.py`` measures for a restart of the example CNN from its checkpoint) ->
  7 s (1 GPU), 30 s (up to 8) or 60 s (more). ``--checkpoint-cost S`` sets one cost for every size
  (0: a preempted job resumes where it stopped, at no cost).
- ``preemption_grace_s`` / ``unlimited_preemptions``: 30 s from the checkpoint signal to the stop,
  at most 2 preemptions of a job per hour -> 0 s, no limit.
- ``predict_always``: every job's duration predicted (as live) -> only under a policy that ranks
  by predictions (QSSF); trace jobs declare their durations, which FIFO, SJF and SRTF use.

Estimates for QSSF (a job -> seconds file, ``load_estimates``) replace the duration model's
predictions with given ones; they are an input, not a switch of the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec
import pandas as pd

from apps.sim.elastic import RescaleCosts
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from gpuherd.scaling import DEFAULT_BANDWIDTH_BYTES_PER_S
from services.analytics.traces import job_id_for


class SimModelError(GpuherdError):
    """A model or an estimates file that cannot be used."""


class SimModel(msgspec.Struct, frozen=True, kw_only=True):
    partition_vcs: bool = False
    backfill: bool = True
    consolidate: bool = False
    per_second: bool = False
    # (largest job in GPUs, restore seconds), smallest first: a preempted job's cost by its size
    checkpoint_costs: tuple[tuple[int, float], ...] = ()
    preemption_grace_s: float | None = None  # None: the cluster's default
    unlimited_preemptions: bool = False
    # Duration predictions for every job (as live), or only under a policy that ranks by them
    predict_always: bool = True
    # Elastic jobs that declare their scaling run by it: work in samples, each rescale's measured cost
    # (warm or cold), gradients all-reduced at this bandwidth per worker.
    rescale_costs: RescaleCosts = RescaleCosts()
    allreduce_bandwidth: float = DEFAULT_BANDWIDTH_BYTES_PER_S

    def checkpoint_cost(self, gpus: int) -> float:
        for largest, seconds in self.checkpoint_costs:
            if gpus <= largest:
                return seconds
        return self.checkpoint_costs[-1][1] if self.checkpoint_costs else 0.0

    def policy_params(self) -> dict[str, float]:
        params: dict[str, float] = {}
        if self.preemption_grace_s is not None:
            params["preemption_grace_s"] = self.preemption_grace_s
        if self.unlimited_preemptions:
            params["max_preemptions_per_hour"] = 1e9
        return params

    def with_switches(self, **switches: object) -> SimModel:
        """This model with the switches given (None: unchanged)."""
        chosen = {k: v for k, v in switches.items() if v is not None}
        return msgspec.structs.replace(self, **chosen) if chosen else self

    def jobs(self, submissions: Iterable[ev.JobSubmitted], gpus_per_node: int) -> Iterator[ev.JobSubmitted]:
        """The trace's jobs as this model sees them."""
        for job in submissions:
            spec = job.spec
            changes: dict[str, object] = {}
            if self.per_second and spec.duration_s is not None:
                changes["duration_s"] = float(max(1, math.ceil(spec.duration_s)))
            if self.consolidate and spec.nodes is None:
                if spec.gpus <= gpus_per_node:
                    changes["nodes"] = 1
                elif spec.gpus % gpus_per_node == 0:
                    changes["nodes"] = spec.gpus // gpus_per_node  # whole nodes
                # (a larger job of another size, e.g. 12 GPUs, is placed as gpuherd places it)
            if changes:
                job = msgspec.structs.replace(job, spec=msgspec.structs.replace(spec, **changes))
            yield job


# A restart from a checkpoint: bench_elastic's restart baseline of the example CNN (3-4 s).
RESTART_S = 3.5

GPUHERD = SimModel(checkpoint_costs=((1 << 30, RESTART_S),))
HELIOS = SimModel(
    partition_vcs=True,
    backfill=False,
    consolidate=True,
    per_second=True,
    checkpoint_costs=((1, 7.0), (8, 30.0), (1 << 30, 60.0)),
    preemption_grace_s=0.0,
    unlimited_preemptions=True,
    predict_always=False,
)
MODELS = {"gpuherd": GPUHERD, "helios": HELIOS}


def load_estimates(path: str | Path) -> dict[str, float]:
    """A CSV of ``job_id,estimate_s`` (the trace's job ids): each job's intake id -> its estimate."""
    try:
        table = pd.read_csv(path, usecols=["job_id", "estimate_s"], dtype={"job_id": str})
    except (OSError, ValueError) as exc:
        raise SimModelError(f"{path}: not an estimates file with columns job_id,estimate_s ({exc})") from None
    table = table.dropna()
    return {job_id_for(str(j)): float(s) for j, s in zip(table["job_id"], table["estimate_s"], strict=True)}
