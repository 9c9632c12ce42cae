"""``gpuherd up``: a whole cluster on one machine.

Starts the embedded nats-server (unless NATS_URL is set), then each service
and ``--agents`` node agents as separate processes, and supervises them: a
process that dies unexpectedly is restarted (it resumes from its snapshot
and the log). Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
from rich.console import Console

from gpuherd.natsd import NatsServer

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
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def service_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def agent_process(
    node: str,
    executor: str,
    gpus: int,
    rack: str,
    url: str,
    args: argparse.Namespace,
    env: dict[str, str],
    *,
    port_block: int = 0,
) -> Supervised:
    """A node agent on this machine. Local agents share one host, so each leads rendezvous on
    ports of its own block, and their peers reach them on the loopback address."""
    data_dir = Path(args.data_dir).resolve()
    argv = service_argv(
        "services.nodeagent",
        *("--nats-url", url, "--node", node, "--executor", executor, "--gpus", str(gpus), "--rack", rack),
        *("--data-dir", str(data_dir / "agents" / node), "--address", "127.0.0.1"),
    )
    if executor != "sim":
        first = RENDEZVOUS_BASE + 100 * port_block
        argv += ["--island", str(max(1, gpus // 2)), "--rendezvous-ports", f"{first}-{first + 99}"]
    return Supervised(f"agent-{node}", argv, data_dir / "logs", env)


RENDEZVOUS_BASE = 29400


def run_cluster(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir)
    if args.fresh and data_dir.exists():
        shutil.rmtree(data_dir)
    log_dir = data_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    server: NatsServer | None = None
    url = args.nats_url or os.environ.get("NATS_URL")
    if not url:
        server = NatsServer(data_dir / "nats", log_file=log_dir / "nats-server.log").start()
        url = server.url
        console.print(f"embedded nats-server with JetStream at {url} (data in {data_dir / 'nats'})")
    else:
        console.print(f"using NATS at {url}")
    (data_dir / "cluster.json").write_bytes(msgspec.json.encode({"nats_url": url, "pid": os.getpid()}))

    env = dict(os.environ, NATS_URL=url, PYTHONUNBUFFERED="1")
    procs = [
        Supervised(
            "scheduler",
            service_argv(
                "services.scheduler", "--nats-url", url, "--policy", args.policy, "--lost-after", str(args.lost_after)
            ),
            log_dir,
            env,
        )
    ]
    for i in range(1, args.agents + 1):
        procs.append(agent_process(f"node-{i}", "sim", args.gpus_per_node, f"rack-{(i - 1) // 4 + 1}", url, args, env))
    for i in range(1, args.cpu_agents + 1):
        name = f"cpu-{i}"
        procs.append(agent_process(name, "cpu", args.cpu_gpus, "rack-cpu", url, args, env, port_block=i))
    for p in procs:
        p.start()
    console.print(
        f"started the scheduler, {args.agents} sim agents x {args.gpus_per_node} GPUs and "
        f"{args.cpu_agents} cpu agents x {args.cpu_gpus} virtual GPUs (logs in {log_dir})"
    )

    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def supervise_once() -> None:
        for p in procs:
            p.check()

    code = 0
    try:
        if args.demo:
            from gpuherd.demo import run_demo

            code = asyncio.run(run_demo(url, args, supervise_once, lambda: stopping))
        else:
            console.print("cluster is up; Ctrl-C stops it. Try: gpuherd nodes, gpuherd submit job.yaml, gpuherd jobs")
            while not stopping:
                supervise_once()
                time.sleep(0.5)
    finally:
        console.print("stopping services ...")
        for p in reversed(procs):
            p.stop()
        if server is not None:
            server.stop()
        console.print("stopped")
    return code
