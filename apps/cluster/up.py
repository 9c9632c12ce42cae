"""``gpuherd up``: a local cluster in the foreground, with an optional demo workload; Ctrl-C stops it."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import socket
import stat
import time
from pathlib import Path

import msgspec

from apps.cluster.local import ClusterLayout, LocalCluster, console, refuse_if_in_use
from gpuherd.client import Client, load_data_file
from gpuherd.errors import GpuherdError
from gpuherd.natsd import UNSAFE_SYNC, unsafe_sync_warning


class VcFileEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    quota: int | None = None
    can_borrow: bool = True
    weight: float = 1.0


def load_vc_file(path: str) -> list[VcFileEntry]:
    """VCs for ``gpuherd up --vcs FILE``: a JSON/YAML list (or ``{vcs: [...]}``) of
    ``{name, quota, can_borrow, weight}``."""
    data = load_data_file(path)
    try:
        return msgspec.convert(data.get("vcs") if isinstance(data, dict) else data, list[VcFileEntry])
    except msgspec.ValidationError as exc:
        raise GpuherdError(f"{path}: {exc}; expected a list like [{{name: vision, quota: 16}}]") from None


async def configure_vcs(url: str, vcs: list[VcFileEntry]) -> None:
    client = await Client.connect(url, source="up")
    try:
        for vc in vcs:
            await client.configure_vc(vc.name, gpu_quota=vc.quota, can_borrow=vc.can_borrow, weight=vc.weight)
    finally:
        await client.close()


def _free_or_any(port: int) -> int | None:
    """The dashboard's port: ``port`` if free, else any free one (said); None for no dashboard."""
    if port < 0:
        return None
    if port == 0:
        return 0
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            console.print(f"[yellow]port {port} is taken: the dashboard takes a free one[/yellow]")
            return 0
    return port


def what_to_try(args: argparse.Namespace, dashboard: str | None) -> str:
    """After the demo's report: the cluster keeps serving; where to look and what to type."""
    gpuherd = _command_name()
    if Path(args.data_dir) != Path(".gpuherd"):
        gpuherd += f" --data-dir {args.data_dir}"
    lines = [
        "",
        "[bold]The cluster keeps serving until Ctrl-C[/bold] (which stops every process cleanly).",
        (f"dashboard: {dashboard}" if dashboard else "dashboard: not serving (see its log)")
        + (
            f" (its operator token, for cancel, drain and the audit: {args.ui_token_file})"
            if dashboard and args.ui_token_file
            else ""
        ),
        "try, in another terminal in this folder:",
        f"  {gpuherd} jobs                                   # jobs, where they run, why they wait",
        f"  {gpuherd} why JOB                                # why a job waits, when it should start",
        f"  {gpuherd} usage --by vc,user                     # GPU-hours, ends, queueing (also --per day --csv)",
        f"  {gpuherd} history --limit 20                     # finished jobs, like sacct",
        f"  {gpuherd} submit examples/workflow.yaml          # a 4-step workflow on the cpu agents",
        f"  {gpuherd} jobs --workflow pipeline               # its steps (and the dashboard's Workflows page)",
        f"  {gpuherd} submit examples/jobs/sweep-array.yaml  # an array of 8, at most 2 at once",
        f"  {gpuherd} replay --audit                         # every decision made again",
    ]
    return "\n".join(lines)


def _command_name() -> str:
    """How this command was called, as a person would type it again from here."""
    import sys

    called = Path(sys.argv[0])
    if called.name == "gpuherd":
        on_path = shutil.which("gpuherd")
        if on_path is not None and Path(on_path).resolve() == called.resolve():
            return "gpuherd"
        try:
            return str(called.resolve().relative_to(Path.cwd()))
        except ValueError:
            return str(called)
    return "python -m apps"


def check_demo_trace(args: argparse.Namespace) -> None:
    """The demo's trace, checked before anything starts (a missing one stopped a cluster just started,
    saying "philly.csv not found: pass --trace PATH" of a path that had been passed). ``args.trace``
    becomes the trace found, so that the demo reads the file checked here."""
    if not args.demo:
        return
    from apps.cluster.demo import find_trace

    args.trace = str(find_trace(args.trace))


OPERATOR_TOKEN_FILE = "dashboard.token"


def operator_token_file(data_dir: Path) -> Path:
    """The dashboard's operator token of a local cluster: ``data_dir/dashboard.token``, made on the
    first ``up`` (a random 32-character token, readable by this user alone) and kept, so a page that
    remembers the token goes on working after a restart. Without one, a default ``up`` had a read-only
    dashboard: no cancel, drain or audit from the page. A token file that others may read is refused
    rather than used: whoever can read it can act on the cluster."""
    path = data_dir / OPERATOR_TOKEN_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        fd = None
    if fd is None:  # made by an earlier up: kept, if still private and usable
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise GpuherdError(
                f"{path} may be read by other users (mode {mode:o}): make it private (chmod 600 {path}), "
                "delete it for a new token, or pass --ui-token-file"
            )
        if len(path.read_text().strip()) < 16:
            raise GpuherdError(f"{path} holds no usable token (under 16 characters): delete it for a new one")
        return path
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(24) + "\n")
    return path


def run_cluster(args: argparse.Namespace) -> int:
    # What the command line names is read first: nothing starts (nor does --fresh delete anything)
    # for a cluster that would stop at once for a file not there.
    check_demo_trace(args)
    vcs = load_vc_file(args.vcs) if args.vcs else []
    data_dir = Path(args.data_dir)
    refuse_if_in_use(data_dir)  # (before --fresh deletes what it serves from)
    if args.fresh and data_dir.exists():
        shutil.rmtree(data_dir)
    token_file = args.ui_token_file
    if token_file is None and args.ui_port >= 0 and not args.ui_read_only:
        token_file = args.ui_token_file = str(operator_token_file(data_dir))  # (what_to_try names it too)
    layout = ClusterLayout(
        sim_agents=args.agents,
        sim_gpus=args.gpus_per_node,
        cpu_agents=args.cpu_agents,
        cpu_gpus=args.cpu_gpus,
        nvml_agents=1 if args.nvml else 0,
        policy=args.policy,
        lost_after_s=args.lost_after,
        ui_port=_free_or_any(args.ui_port),
        ui_token_file=token_file,
        nats_sync=UNSAFE_SYNC if getattr(args, "fast_unsafe_fsync", False) else None,
    )
    cluster = LocalCluster(data_dir, layout, nats_url=args.nats_url or os.environ.get("NATS_URL"))
    url = cluster.start()
    code = 0
    try:  # (from here on: whatever fails, or a Ctrl-C before the handlers below, stops every process)
        if vcs:
            asyncio.run(configure_vcs(url, vcs))
            console.print(f"configured {len(vcs)} virtual clusters from {args.vcs}")
        if cluster.server is not None:
            console.print(f"embedded nats-server with JetStream at {url} (data in {cluster.data_dir / 'nats'})")
            warning = unsafe_sync_warning(cluster.server.sync)
            if warning:
                console.print(f"[bold red]{warning}[/bold red]", highlight=False)
            else:
                console.print("the log fsyncs before every acknowledgement (sync_interval: always)")
        else:
            console.print(f"using NATS at {url}")
        console.print(
            f"started the scheduler, {args.agents} sim agents x {args.gpus_per_node} GPUs and "
            f"{args.cpu_agents} cpu agents x {args.cpu_gpus} virtual GPUs"
            + (" and an nvml agent" if args.nvml else "")
            + f" (logs in {cluster.log_dir})"
        )

        if layout.ui_port is not None:
            ui = cluster.dashboard_url()
            where = ui or f"not serving yet (see {cluster.log_dir / 'dashboard.log'})"
            access = f" (operator token for its actions: {token_file})" if token_file else " (read-only)"
            console.print(f"dashboard: {where}{access}", highlight=False)
        stopping = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)

        if args.demo:
            from apps.cluster.demo import run_demo

            code = asyncio.run(run_demo(url, args, cluster.supervise_once, lambda: stopping))
            if args.exit_after_demo or stopping:
                return code
            console.print(what_to_try(args, cluster.dashboard_url() if layout.ui_port is not None else None))
        else:
            console.print("cluster is up; Ctrl-C stops it. Try: gpuherd nodes, gpuherd submit job.yaml, gpuherd jobs")
        while not stopping:
            cluster.supervise_once()
            time.sleep(0.5)
    finally:
        console.print("stopping services ...")
        cluster.stop()
        console.print("stopped")
    return code
