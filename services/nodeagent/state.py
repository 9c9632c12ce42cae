"""What a node agent folds: only what concerns its node.

- its own node (registration, drains, power, health of its GPUs), no other node;
- the live jobs (pending ones for their specs, placed and running ones wherever they run: a job's
  ranks and rendezvous span its nodes); a job that ended is dropped;
- the memory leases of workers on its node.

The core fold (``gpuherd.fold``) does the work, as ``partial``: events naming other nodes are taken
as they are (the scheduler's own fold checked them).
"""

from __future__ import annotations

import msgspec

from gpuherd import events as ev
from gpuherd.fold import ClusterState, NodeState, apply
from gpuherd.fold.leases import Leases, apply_lease

STATE_FORMAT = 1  # of ``AgentState`` in the agent's snapshots: a snapshot of another is not read

# Node events an agent folds only when they are about its own node.
_NODE_EVENTS = (
    ev.NodeRegistered,
    ev.NodeDrained,
    ev.NodeUndrained,
    ev.NodePowerDownRequested,
    ev.NodePowerUpRequested,
    ev.NodeWakeRequested,
    ev.NodePoweredDown,
    ev.NodePoweredUp,
    ev.GpuHealthChanged,
)


class AgentState(ClusterState, kw_only=True, gc=False):
    node: str
    leases: Leases = msgspec.field(default_factory=dict)  # of workers on this node

    @property
    def me(self) -> NodeState | None:
        return self.nodes.get(self.node)


def new_state(node: str) -> AgentState:
    return AgentState(node=node, retain_finished=False, partial=True)


def evolve(state: AgentState, seq: int, event: ev.Event) -> AgentState:
    """Fold ``event`` if it concerns this node (or a live job); note its sequence and time anyway."""
    if isinstance(event, _NODE_EVENTS) and event.node != state.node:
        state.seq = seq
        state.now = max(state.now, event.at)
        return state
    apply(state, seq, event)
    if isinstance(event, ev.MemoryLeaseRequested):
        if event.node == state.node:
            apply_lease(state.leases, event)
    else:
        apply_lease(state.leases, event)  # (other leases are unknown here: their events change nothing)
    return state
