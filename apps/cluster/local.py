"""A whole cluster on one machine: the embedded nats-server (unless a NATS URL is given), each
service and the node agents as separate supervised processes. A process that dies unexpectedly is
restarted (it resumes from its snapshot and the log). Used by ``gpuherd up`` and the benchmarks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
from rich.console import Console

from apps import registry
from gpuherd.errors import GpuherdError
from gpuherd.natsd import NatsServer
from gpuherd.runtime.spec import LocalContext

console = Console(stderr=True)


class Supervised:
    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_dir / f"{name}.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.next_start = 0.0

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def check(self) -> None:
        """Restart the process if it died (with a growing delay if it keeps dying)."""
        if self.proc is None or self.proc.poll() is None:
            return
        now = time.monotonic()
        if self.next_start == 0.0:
            console.print(
                f"[yellow]{self.name} exited with {self.proc.returncode}; restarting (log: {self.log_path})[/yellow]"
            )
            self.next_start = now + min(0.5 * 2**self.restarts, 10.0)
        elif now >= self.next_start:
            self.restarts += 1
            self.next_start = 0.0
            self.start()

    def stop(self, timeout: float = 10.0) -> None:
        stop_together([self], timeout)


def stop_together(procs: list[Supervised], timeout: float = 10.0) -> dict[str, float | None]:
    """SIGTERM every running process at once; SIGKILL those still running after ``timeout``. Each
    process's time from SIGTERM to its exit (None: it had to be killed), by name."""
    running = [p for p in procs if p.proc is not None and p.proc.poll() is None]
    started = time.monotonic()
    for p in running:
        p.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    exit_s: dict[str, float | None] = {}
    left = list(running)
    while left and time.monotonic() - started < timeout:
        for p in list(left):
            if p.proc.poll() is not None:  # type: ignore[union-attr]
                exit_s[p.name] = time.monotonic() - started
                left.remove(p)
        time.sleep(0.01)
    for p in left:
        p.proc.kill()  # type: ignore[union-attr]
        p.proc.wait()  # type: ignore[union-attr]
        exit_s[p.name] = None
    return exit_s


def service_argv(service: str, *args: str) -> list[str]:
    """The command line of ``gpuherd serve SERVICE ARGS`` with this interpreter."""
    return [sys.executable, "-m", "apps", "serve", service, *args]


def refuse_if_in_use(data_dir: Path) -> None:
    """Raise if another ``gpuherd up`` still serves from ``data_dir``: its ``cluster.json`` names a
    live process and its NATS answers (a second nats-server on the same JetStream store corrupts it)."""
    try:
        recorded = msgspec.json.decode((Path(data_dir) / "cluster.json").read_bytes())
        pid, url = int(recorded["pid"]), urlsplit(str(recorded["nats_url"]))
        address = (url.hostname or "127.0.0.1", url.port or 4222)
    except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError):
        return  # (no cluster started here, or its record is unreadable)
    if pid == os.getpid():
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    except PermissionError:
        pass  # (alive: another user's)
    try:
        socket.create_connection(address, timeout=1.0).close()
    except OSError:
        return  # (a process that took its pid since; its NATS is gone)
    raise GpuherdError(
        f"{data_dir} is in use by gpuherd up (pid {pid}, NATS {recorded['nats_url']}): "
        "stop it first (Ctrl-C in its terminal), or give another --data-dir"
    )


RENDEZVOUS_BASE = 29400


class ClusterLayout(msgspec.Struct, kw_only=True):
    """Which agents a local cluster runs."""

    sim_agents: int = 0
    sim_gpus: int = 8
    cpu_agents: int = 0
    cpu_gpus: int = 4
    nvml_agents: int = 0  # at most 1 per machine: the agent owns the machine's GPUs
    policy: str | None = None  # recorded at start when given; else the log's policy stays
    lost_after_s: float = 10.0
    agent_args: tuple[str, ...] = ()  # extra flags for every agent (e.g. a shorter --heartbeat)
    ui_port: int | None = None  # the dashboard's port (0: any free one; None: no dashboard)
    ui_token_file: str | None = None  # the dashboard's operator token (None: read-only)
    # The embedded server's JetStream sync_interval: None is the durable default ("always", unless
    # GPUHERD_UNSAFE_FSYNC is set); "2m" is nats-server's own default (gpuherd up --fast-unsafe-fsync).
    nats_sync: str | None = None


class LocalCluster:
    """An embedded nats-server (unless ``nats_url``), the scheduler and node agents on this machine,
    each a supervised process. Used by ``gpuherd up`` and by the benchmarks."""

    def __init__(self, data_dir: Path, layout: ClusterLayout, *, nats_url: str | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.layout = layout
        self.url = nats_url or ""
        self.server: NatsServer | None = None
        self.procs: list[Supervised] = []

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def dashboard_url_file(self) -> Path:
        return self.data_dir / "dashboard.url"

    def dashboard_url(self, timeout: float = 20.0) -> str | None:
        """The dashboard's URL once it serves (None: no dashboard, or not serving within ``timeout``)."""
        if self.layout.ui_port is None:
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.dashboard_url_file.exists() and (url := self.dashboard_url_file.read_text().strip()):
                return url
            self.supervise_once()
            time.sleep(0.1)
        return None

    def start(self) -> str:
        try:
            return self._start()
        except BaseException:  # (a failure or a Ctrl-C half-way: stop what had started, nats-server too)
            self.stop()
            raise

    def _start(self) -> str:
        refuse_if_in_use(self.data_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.url:
            self.server = NatsServer(
                self.data_dir / "nats", log_file=self.log_dir / "nats-server.log", sync=self.layout.nats_sync
            ).start()
            self.url = self.server.url
        cluster = {"nats_url": self.url, "pid": os.getpid()}
        if self.server is not None:  # where `gpuherd status` reads how the embedded server syncs
            cluster["nats_monitor_url"] = self.server.monitor_url
        (self.data_dir / "cluster.json").write_bytes(msgspec.json.encode(cluster))
        # Every process serves /metrics and /healthz on a free port of its own; `gpuherd status` lists them.
        env = dict(os.environ, NATS_URL=self.url, PYTHONUNBUFFERED="1", GPUHERD_METRICS_PORT="0")
        lay = self.layout
        options = {
            "policy": lay.policy,
            "lost_after_s": lay.lost_after_s,
            "ui_port": lay.ui_port,
            "ui_token_file": lay.ui_token_file,
            "url_file": self.dashboard_url_file,
            "agent_args": lay.agent_args,
            "rendezvous_base": RENDEZVOUS_BASE,
        }
        if lay.ui_port is not None:
            self.dashboard_url_file.unlink(missing_ok=True)
        self.procs = []
        for spec in registry.specs():  # every service its spec starts here, then an agent per node
            if spec.role == "agent" or spec.local_argv is None:
                continue
            argv = spec.local_argv(LocalContext(self.url, self.data_dir, options))
            if argv is not None:
                self.procs.append(self._supervised(spec.name, spec.name, argv, env))
        agents = [s for s in registry.specs() if s.role == "agent" and s.local_argv is not None]
        for spec in agents:
            for node in self.nodes():
                argv = spec.local_argv(LocalContext(self.url, self.data_dir, {**options, **node}))  # type: ignore[misc]
                self.procs.append(self._supervised(f"{spec.name}-{node['node']}", spec.name, argv or [], env))
        for p in self.procs:
            p.start()
        return self.url

    def nodes(self) -> list[dict[str, object]]:
        """The layout's nodes: sim, then cpu, then nvml agents (each local agent leads rendezvous on
        ports of its own block)."""
        lay = self.layout
        out: list[dict[str, object]] = []
        for i in range(1, lay.sim_agents + 1):
            out.append(
                {"node": f"node-{i}", "executor": "sim", "gpus": lay.sim_gpus, "rack": f"rack-{(i - 1) // 4 + 1}"}
            )
        for i in range(1, lay.cpu_agents + 1):
            out.append(
                {"node": f"cpu-{i}", "executor": "cpu", "gpus": lay.cpu_gpus, "rack": "rack-cpu", "port_block": i}
            )
        for i in range(1, lay.nvml_agents + 1):
            out.append({"node": f"gpu-{i}", "executor": "nvml", "gpus": 0, "rack": "rack-gpu", "port_block": 50 + i})
        return out

    def _supervised(self, name: str, service: str, argv: list[str], env: dict[str, str]) -> Supervised:
        return Supervised(name, service_argv(service, "--nats-url", self.url, *argv), self.log_dir, env)

    def supervise_once(self) -> None:
        for p in self.procs:
            p.check()

    def stop(self, timeout: float = 10.0) -> dict[str, float | None]:
        """Stop every process (all at once: each releases its lease as it goes), then the embedded
        NATS server; each process's time to exit (None: killed after ``timeout``)."""
        try:
            return stop_together(self.procs, timeout)
        finally:
            if self.server is not None:
                self.server.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
