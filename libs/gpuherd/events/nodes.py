"""Events of a node (subject ``herd.node.<node>``): registration, drains, loss, health, power, memory use."""

from __future__ import annotations

from typing import Any, ClassVar

from gpuherd.events.base import Command, Decision, Event, command_upcaster, upcaster
from gpuherd.events.values import GpuInfo


class NodeRegistered(Event, kw_only=True, frozen=True):
    """An agent announced its node and inventory (again after every agent start).

    v1 described a homogeneous node (``gpu_count``, ``gpu_model``,
    ``gpu_memory_mb``); v2 lists every GPU with its UUID and NVLink peers.
    """

    VERSION: ClassVar[int] = 2
    v: int = 2
    node: str
    gpus: tuple[GpuInfo, ...]
    rack: str = ""
    executor: str = "sim"
    boot_id: str = ""
    address: str = ""  # where peers reach this node (a job's rendezvous, when it leads the gang)
    port_range: tuple[int, int] | None = None  # [first, last] ports the scheduler may give to rendezvous here
    host_memory_mb: int = 0  # the node's RAM (0: not said); the memory broker lends part of it as pinned host tier

    def subject(self) -> str:
        return f"herd.node.{self.node}"


@upcaster("NodeRegistered", 1)
def _node_registered_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    count = int(raw.pop("gpu_count"))
    model = raw.pop("gpu_model", "unknown")
    memory_mb = int(raw.pop("gpu_memory_mb", 0))
    node = raw["node"]
    # v1 agents knew nothing of UUIDs or NVLink: derive stable ids, no peers.
    raw["gpus"] = [{"index": i, "uuid": f"{node}-gpu{i}", "model": model, "memory_mb": memory_mb} for i in range(count)]
    raw["v"] = 2
    return raw


class NodeDrained(Command, kw_only=True, frozen=True):
    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodeUndrained(Command, kw_only=True, frozen=True):
    node: str

    def subject(self) -> str:
        return f"herd.node.{self.node}"


command_upcaster("NodeDrained")
command_upcaster("NodeUndrained")


class NodeLost(Decision, kw_only=True, frozen=True):
    """The scheduler decided the node is gone (its heartbeats stopped); its jobs are requeued."""

    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class GpuHealthChanged(Event, kw_only=True, frozen=True):
    """An agent saw a GPU turn unhealthy (XID error, uncorrected ECC, fell off the bus) or recover."""

    node: str
    index: int
    healthy: bool
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


# ---------------------------------------------------------------------------
# jobs


class GpuMemoryReported(Event, kw_only=True, frozen=True):
    """A node's GPUs' memory in use (MiB, by GPU index), written by its agent when a GPU's use moved
    by more than its reporting step (or the borrowers' part of it changed). Folded into the view of
    spare memory the broker lends from: a state change worth recording, unlike the telemetry
    stream's every sample.

    v2: ``borrowed_mb``, by GPU index, the part of ``used_mb`` that borrowers on the node had
    allocated of their leases' shares on that GPU when it was sampled (as their runtimes told the
    agent before the sample); None where the agent cannot tell (v1 reports, an agent that has not
    heard since its start from a borrower that held shares). A share granted but not yet allocated
    is then not mistaken for use, which hid an owner's or strays' growth from the broker."""

    VERSION: ClassVar[int] = 2
    v: int = 2
    node: str
    used_mb: tuple[int, ...]
    borrowed_mb: tuple[int, ...] | None = None

    def subject(self) -> str:
        return f"herd.node.{self.node}"


@upcaster("GpuMemoryReported", 1)
def _gpu_memory_reported_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    return {**raw, "borrowed_mb": None, "v": 2}  # v1 agents did not know what borrowers allocated


class NodePowerDownRequested(Decision, kw_only=True, frozen=True):
    """Cluster energy saving: forecast demand does not need this node for a while. Its agent
    drains it (no new work; running parts end on their own), then powers it down."""

    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodePowerUpRequested(Decision, kw_only=True, frozen=True):
    """Energy saving (the analytics service): forecast demand is back. The agent stops draining the
    node, or powers it on.

    v1 was also written by the scheduler for waiting jobs; those upcast to ``NodeWakeRequested``."""

    VERSION: ClassVar[int] = 2
    v: int = 2
    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


@upcaster("NodePowerUpRequested", 1)
def _node_power_up_requested_v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("source") == "scheduler":
        raw["type"] = "NodeWakeRequested"
        raw["v"] = 1
    else:
        raw["v"] = 2
    return raw


class NodeWakeRequested(Decision, kw_only=True, frozen=True):
    """The scheduler: jobs wait for GPUs that only powered-down nodes have. The agent stops draining
    the node, or powers it on (as for ``NodePowerUpRequested``)."""

    node: str
    reason: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodePoweredDown(Event, kw_only=True, frozen=True):
    """The agent drained its node and ran its power-down hook: the node is off."""

    node: str
    cause: str = ""  # the request it carried out

    def subject(self) -> str:
        return f"herd.node.{self.node}"


class NodePoweredUp(Event, kw_only=True, frozen=True):
    """The node is on and serving again (its power-up hook succeeded)."""

    node: str
    cause: str = ""

    def subject(self) -> str:
        return f"herd.node.{self.node}"


# A ClockTicked with this timeout (and no nodes heard) only marks time: no node can have been
# silent that long, so it declares no loss. Simulations and the analytics timer tick this way.
