"""The node agent, as a service: one process per node, carrying out what the log decides for it.

What it acts on and what it writes are declared here, beside it; its NATS user (``agent-<node>``)
may append only its own node's events (subjects tagged ``.by.<node>``, or its node's own)."""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.log import CONTROL_PREFIX, DEAD_LETTER_PREFIX, LEADERSHIP_BUCKET, SNAPSHOT_BUCKET, STATUS_BUCKET
from gpuherd.log.relay import report_subject
from gpuherd.log.streams import TELEMETRY_PREFIX
from gpuherd.runtime.spec import LocalContext, ServiceSpec
from gpuherd.security import Permissions, appends_of, check_token, inbox, kv_write, read_log
from services.nodeagent import agent

# What it acts on: its jobs' life (placed, started, stopping, resized), its node (lost, power),
# and memory leases of its jobs' workers.
FOLLOWS: frozenset[type[ev.Event]] = frozenset(
    {ev.JobPlaced, ev.JobStarted, ev.TaskEnded, ev.JobFinished, ev.JobRequeued, ev.JobPreempted}
    | {ev.JobCancelRequested, ev.JobResized, ev.RescaleCompleted, ev.WorkerLost, ev.ProfileRequested}
    | {ev.NodeLost, ev.NodePowerDownRequested, ev.NodePowerUpRequested, ev.NodeWakeRequested}
    | {ev.MemoryLeaseGranted, ev.MemoryLeaseRevoked, ev.MemoryLeaseReclaimed}
)
# What it writes, under its node's subjects: its node, its tasks and workers, its jobs' processes'
# reports, and its workers' memory lease requests.
EMITS: frozenset[type[ev.Event]] = frozenset(
    {ev.NodeRegistered, ev.GpuHealthChanged, ev.GpuMemoryReported, ev.NodePoweredDown, ev.NodePoweredUp}
    | {ev.JobStarted, ev.TaskEnded, ev.RescaleCompleted, ev.RescaleFailed, ev.WorkerLost, ev.ProfileReported}
    | {ev.MemoryLeaseRequested, ev.MemoryLeaseRenewed, ev.MemoryLeaseReleased}
)


def permissions(node: str) -> Permissions:
    """``agent-<node>``: its own node's events (appended, or sent to a report relay) and telemetry,
    its leadership, snapshot and status, and it answers questions about its node
    (``herd.ctl.<node>.>``: job output)."""
    check_token("node", node)
    user = f"agent-{node}"
    publish = (
        *appends_of(EMITS, node=node, source=f"agent.{node}"),
        f"{TELEMETRY_PREFIX}.{node}.>",
        report_subject(node),  # (its reports, through a report relay)
        *read_log(),
        f"{DEAD_LETTER_PREFIX}.{user}",
        kv_write(LEADERSHIP_BUCKET, f"agent.{node}"),
        kv_write(SNAPSHOT_BUCKET, f"agent.{node}"),
        kv_write(SNAPSHOT_BUCKET, f"agent.{node}.parts.>"),
        kv_write(STATUS_BUCKET, f"{user}.>"),
    )
    return Permissions(publish=publish, subscribe=(inbox(user), f"{CONTROL_PREFIX}.{node}.>"), allow_responses=True)


def local_argv(ctx: LocalContext) -> list[str]:
    """An agent of a local cluster: its node's flags; local agents share one host, so each leads
    rendezvous on ports of its own block, and their peers reach them on the loopback address."""
    node, executor, gpus = ctx.option("node"), ctx.option("executor", "sim"), ctx.option("gpus", 8)
    argv = ["--node", node, "--executor", executor, "--gpus", str(gpus), "--rack", ctx.option("rack", "")]
    argv += ["--data-dir", str(ctx.data_dir / "agents" / node), "--address", "127.0.0.1"]
    argv += list(ctx.option("agent_args", ()))
    if executor != "sim":
        first = ctx.option("rendezvous_base", 29400) + 100 * ctx.option("port_block", 0)
        argv += ["--island", str(max(1, gpus // 2)), "--rendezvous-ports", f"{first}-{first + 99}"]
    return argv


SPEC = ServiceSpec(
    name="agent",
    about="runs a node's part of every job",
    role="agent",
    follows=FOLLOWS,
    emits=EMITS,
    permissions=permissions,
    main=agent.main,
    parser=agent.build_parser,
    local_argv=local_argv,
    required=False,  # (nodes come and go; `gpuherd status` lists the agents it hears)
)
