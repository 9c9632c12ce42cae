"""The event catalogue: every fact gpuherd records, as small msgspec Structs, one module per aggregate.

- ``base``: ``Event``, ``Decision``, ``Command``, the catalogue (``EVENT_TYPES``), upcaster
  registration, ids;
- ``values``: what events carry (GPUs, job specs, allocations, memory shares);
- ``nodes``, ``jobs``, ``elastic``, ``leases``, ``cluster``: the events of each aggregate, with the
  upcasters of their old versions beside them;
- ``codec``: the tagged union of all of them, ``encode`` and ``decode`` (upcasting on read).

Defining an event class is all it takes to add one: the class registers itself in ``EVENT_TYPES``
when its module is imported, and this package imports every aggregate module, then exports every
catalogued class by name. ``from gpuherd import events as ev`` gives all of it (``ev.JobPlaced``).
"""

from gpuherd.events import cluster, elastic, jobs, leases, nodes  # noqa: F401 - each registers its events
from gpuherd.events.base import (
    EVENT_TYPES,
    Command,
    Decision,
    Event,
    catalogue,
    reported_by,
    stable_id,
    upcaster,
    worker_id,
)
from gpuherd.events.cluster import SCHEDULING_RULES, TICK_ONLY_TIMEOUT_S, Tick, leadership_subject
from gpuherd.events.codec import Unreadable, any_event, decode, encode, upcast
from gpuherd.events.elastic import ELASTIC_RULES, RESCALE_PHASES, complete_phase_times
from gpuherd.events.jobs import INTAKE_RULES
from gpuherd.events.leases import MEMORY_RULES
from gpuherd.events.values import (
    DEPENDENCY_KINDS,
    MAX_ELASTIC_WORLD,
    MAX_OUTPUT_TAIL,
    MEMORY_TIERS,
    OUTCOMES,
    Allocation,
    ArrayMember,
    ArraySpec,
    Dependencies,
    DependencyKind,
    Elastic,
    GpuInfo,
    JobSpec,
    Locality,
    LrScaling,
    MemoryNeeds,
    MemoryShare,
    MemoryTier,
    Outcome,
    PartOutcome,
    Rendezvous,
    RescaleKind,
    Scaling,
    WorkflowMember,
    declared_gpus,
    workers_of,
)

globals().update(EVENT_TYPES)  # every catalogued event by its name: ev.JobPlaced, ...

__all__ = [
    "ELASTIC_RULES",
    "DEPENDENCY_KINDS",
    "EVENT_TYPES",
    "INTAKE_RULES",
    "MAX_ELASTIC_WORLD",
    "MAX_OUTPUT_TAIL",
    "MEMORY_RULES",
    "MEMORY_TIERS",
    "OUTCOMES",
    "RESCALE_PHASES",
    "SCHEDULING_RULES",
    "TICK_ONLY_TIMEOUT_S",
    "Allocation",
    "ArrayMember",
    "ArraySpec",
    "Command",
    "Decision",
    "Dependencies",
    "DependencyKind",
    "Elastic",
    "Event",
    "GpuInfo",
    "JobSpec",
    "Locality",
    "LrScaling",
    "MemoryNeeds",
    "MemoryShare",
    "MemoryTier",
    "Outcome",
    "PartOutcome",
    "Rendezvous",
    "RescaleKind",
    "Scaling",
    "Tick",
    "Unreadable",
    "WorkflowMember",
    "any_event",
    "catalogue",
    "complete_phase_times",
    "declared_gpus",
    "decode",
    "encode",
    "leadership_subject",
    "reported_by",
    "stable_id",
    "upcast",
    "upcaster",
    "worker_id",
    "workers_of",
    *sorted(EVENT_TYPES),
]
