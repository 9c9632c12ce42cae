"""A gpuherd cluster of separate "hosts": Linux network namespaces on one bridge.

Hosts: ``nats1..3`` (a JetStream cluster, each store on its own lazyfs mount), ``sched1..2``
(scheduler replicas), ``agent1..N`` (cpu node agents) and ``client`` (the intake client). Every
host but the NATS ones reaches NATS through its own TCP proxy (``proxy.py``), so its link can be
degraded; every Python process of a host runs under libfaketime with the host's own offset file,
so its wall clock can be skewed. Everything made here (namespaces, veths, the bridge, mounts,
processes; iptables rules live in the namespaces) is removed by ``close()``, which the context
manager calls on any exit, Ctrl-C and SIGTERM included. A driver killed outright (SIGKILL) cannot
clean up: every process it starts dies with it (``setpriv --pdeathsig``), and the next cluster to
start removes what a dead driver's run left (``sweep_dead_runs``: its namespaces, links, mounts).

Needs root, ``ip`` (iproute2), ``nsenter``, ``iptables`` (for partitions), ``fusermount3`` and
``mfusepy`` (for power loss), libfaketime (for clock skew): ``facilities()`` says what is missing.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuherd.natsd import NatsServer

ROOT = Path(__file__).resolve().parents[2]
FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
)
NATS_CLIENT_PORT, NATS_ROUTE_PORT, NATS_MONITOR_PORT = 4222, 6222, 8222
PROXY_BASE = 14220  # a host's proxy listens on 127.0.0.1:14221.. for nats1..


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


# Every process of a run dies with the driver that started it, even one killed outright.
DIE_WITH_DRIVER = ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []
DRIVER_FILE = "nemesis-driver.json"  # what a run made, for a later run to remove if its driver died


def sweep_dead_runs(parent: Path) -> list[str]:
    """Remove what runs whose driver died without cleaning up left under ``parent`` (namespaces,
    links and the bridge named by their tag, stale mounts); what was removed."""
    removed: list[str] = []
    for record in parent.glob(f"*/{DRIVER_FILE}"):
        try:
            run = json.loads(record.read_text())
            os.kill(int(run["pid"]), 0)
            continue  # its driver lives: it is another run going on
        except ProcessLookupError:
            pass
        except (OSError, ValueError, KeyError, TypeError):
            continue
        tag = str(run["tag"])
        mounted = {line.split()[1] for line in Path("/proc/mounts").read_text().splitlines() if len(line.split()) > 1}
        for mount in run.get("mounts", []):
            if mount in mounted:  # (a dead FUSE mount: any look at the path itself fails)
                _run("fusermount3", "-u", "-z", mount, check=False)
                removed.append(mount)
        for ns in _run("ip", "netns", "list", check=False).stdout.split():
            if ns.startswith(f"{tag}-"):
                for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                _run("ip", "netns", "del", ns, check=False)
                removed.append(ns)
        for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(": ", 2)[1].split("@")[0] if ": " in line else ""
            if name.startswith(tag):
                _run("ip", "link", "del", name, check=False)
                removed.append(name)
        with contextlib.suppress(OSError):
            record.unlink()
    return removed


def faketime_lib() -> str | None:
    return next((p for p in FAKETIME_LIBS if Path(p).exists()), None)


def facilities() -> dict[str, str | None]:
    """Each facility the nemesis uses -> None when present, else why it is missing."""
    out: dict[str, str | None] = {}
    root = os.geteuid() == 0
    out["netns"] = None if root and shutil.which("ip") and shutil.which("nsenter") else "needs root, ip and nsenter"
    out["iptables"] = None if shutil.which("iptables") else "iptables missing (Debian: iptables)"
    try:
        import mfusepy  # noqa: F401

        fuse = None if Path("/dev/fuse").exists() and shutil.which("fusermount3") else "no /dev/fuse or fusermount3"
    except (ImportError, OSError) as exc:
        fuse = f"mfusepy/libfuse missing ({exc})"
    out["fuse"] = fuse
    out["faketime"] = None if faketime_lib() else "libfaketime missing (Debian: faketime)"
    return out


@dataclass
class Proc:
    """One process of a host: how to start it again, and the running one."""

    name: str
    host: Host
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(
                [*DIE_WITH_DRIVER, "nsenter", f"--net=/run/netns/{self.host.ns}", "--", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.popen.poll() is None else None

    def signal(self, sig: int, group: bool = False) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)

    def kill(self) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGCONT, group=True)  # a stopped process group must die too
        self.signal(signal.SIGKILL, group=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.signal(signal.SIGCONT, group=True)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    index: int
    dir: Path
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def proxy_socket(self) -> Path:
        return self.dir / "proxy.sock"

    @property
    def clock_file(self) -> Path:
        return self.dir / "faketime"

    def iptables(self, *rule: str) -> None:
        _run("ip", "netns", "exec", self.ns, "iptables", "-w", *rule)


class NemesisCluster:
    """Build with ``with NemesisCluster(root, ...) as cluster:``; see the module's docstring."""

    def __init__(
        self,
        root: Path,
        *,
        agents: int = 4,
        gpus_per_agent: int = 2,
        sync: str | None = None,
        lazyfs: bool = True,
        faketime: bool = True,
        leadership_ttl_s: float = 3.0,
        lost_after_s: float = 9.0,
        fence_after_s: float = 2.5,
    ) -> None:
        self.root = Path(root).resolve()
        self.tag = f"gh{random.randrange(16**4):04x}"  # names of this run's namespaces and links
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.agents = agents
        self.gpus_per_agent = gpus_per_agent
        self.sync = sync
        self.lazyfs = lazyfs
        self.faketime = faketime_lib() if faketime else None
        self.leadership_ttl_s = leadership_ttl_s
        self.lost_after_s = lost_after_s
        self.fence_after_s = fence_after_s
        self.hosts: dict[str, Host] = {}
        self.nats: dict[str, NatsServer] = {}
        self.mounts: list[Path] = []
        self.fs_procs: dict[str, subprocess.Popen[bytes]] = {}
        self.bridge = f"{self.tag}br"
        self.runs_dir = self.root / "runs"
        self.logs = self.root / "logs"
        self._closed = False

    # -- layout --------------------------------------------------------------------------------

    def host_names(self) -> list[str]:
        return [
            "nats1",
            "nats2",
            "nats3",
            "sched1",
            "sched2",
            *(f"agent{i}" for i in range(1, self.agents + 1)),
            "client",
        ]

    @property
    def nats_hosts(self) -> list[Host]:
        return [self.hosts[f"nats{i}"] for i in (1, 2, 3)]

    @property
    def agent_hosts(self) -> list[Host]:
        return [h for n, h in self.hosts.items() if n.startswith("agent")]

    @property
    def scheduler_hosts(self) -> list[Host]:
        return [self.hosts["sched1"], self.hosts["sched2"]]

    def direct_url(self) -> str:
        """NATS from the root namespace (the checker's view), straight to the servers."""
        return ",".join(f"nats://{h.ip}:{NATS_CLIENT_PORT}" for h in self.nats_hosts)

    def proxied_url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{PROXY_BASE + i}" for i in (1, 2, 3))

    # -- life cycle --------------------------------------------------------------------------------

    def __enter__(self) -> NemesisCluster:
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM,)}
        self._previous_handlers = previous
        signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM cleans up like Ctrl-C does
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def build(self) -> None:
        for d in (self.root, self.runs_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        swept = sweep_dead_runs(self.root.parent)  # (runs are folders side by side, each with its record)
        if swept:
            print(f"nemesis: removed what a killed run left: {', '.join(swept)}", file=sys.stderr)
        self._record_driver()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for index, name in enumerate(self.host_names(), start=1):
            host = Host(name, f"{self.tag}-{name}", f"{self.subnet}.{index}", index, self.root / "hosts" / name)
            host.dir.mkdir(parents=True, exist_ok=True)
            host.clock_file.write_text("+0\n")
            self.hosts[name] = host
            veth = f"{self.tag}v{index}"
            _run("ip", "netns", "add", host.ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
            _run("ip", "link", "set", f"{veth}p", "netns", host.ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", host.ns, "link", "set", f"{veth}p", "name", "eth0")
            _run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _run("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.ns, "link", "set", "lo", "up")
        self._start_nats()
        for host in self.hosts.values():
            if not host.name.startswith("nats"):
                self._start_proxy(host)

    def _record_driver(self) -> None:
        record = {"pid": os.getpid(), "tag": self.tag, "mounts": [str(m) for m in self.mounts]}
        (self.root / DRIVER_FILE).write_text(json.dumps(record))

    def env_of(self, host: Host) -> dict[str, str]:
        """A host's processes: its proxy as NATS, short leases, and (when on) its own clock."""
        env = dict(os.environ)
        env |= {
            "PYTHONUNBUFFERED": "1",
            "GPUHERD_LEADERSHIP_TTL": str(self.leadership_ttl_s),
            "GPUHERD_LOG_LEVEL": "INFO",
            "NATS_URL": self.proxied_url(),
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        }
        if self.faketime and not host.name.startswith("nats"):
            # The wall clock is the host's (an offset file the clock fault rewrites); monotonic stays
            # true, as on a real machine whose clock was stepped. libfaketime 0.9.10 breaks
            # time.sleep with an unfaked monotonic clock: sitecustomize.py puts a select-based one in.
            env |= {
                "LD_PRELOAD": self.faketime,
                "FAKETIME_TIMESTAMP_FILE": str(host.clock_file),
                "FAKETIME_CACHE_DURATION": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
                "PYTHONPATH": os.pathsep.join((str(Path(__file__).parent / "faketime_site"), env["PYTHONPATH"])),
            }
        return env

    def add(self, host: Host, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, host, argv, env or self.env_of(host), self.logs / f"{name}.log")
        host.procs[name] = proc
        proc.start()
        return proc

    def _start_nats(self) -> None:
        routes = ", ".join(f"nats-route://{h.ip}:{NATS_ROUTE_PORT}" for h in self.nats_hosts)
        for host in self.nats_hosts:
            store = host.dir / "store"
            if self.lazyfs:
                store = self._mount_lazyfs(host)
            server = NatsServer(
                host.dir,
                host=host.ip,
                port=NATS_CLIENT_PORT,
                monitor_port=NATS_MONITOR_PORT,
                server_name=host.name,
                log_file=self.logs / f"{host.name}.log",
                sync=self.sync,
                store_dir=store,
                wrap=[*DIE_WITH_DRIVER, "nsenter", f"--net=/run/netns/{host.ns}", "--"],
                extra_config=(
                    f'cluster {{ name: "nemesis", listen: "{host.ip}:{NATS_ROUTE_PORT}", routes: [{routes}],'
                    " no_advertise: true }\n"
                ),
            )
            self.nats[host.name] = server
        for server in self.nats.values():
            server.start(timeout=30)

    def _mount_lazyfs(self, host: Host) -> Path:
        backing, mount = host.dir / "store-backing", host.dir / "store"
        mount.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"lazyfs-{host.name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(
            [
                *DIE_WITH_DRIVER,
                sys.executable,
                "-m",
                "apps.nemesis.lazyfs",
                str(backing),
                str(mount),
                str(self.lazyfs_socket(host)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
        log.close()
        self.fs_procs[host.name] = proc
        self.mounts.append(mount)
        self._record_driver()
        deadline = time.monotonic() + 20
        while not os.path.ismount(mount):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lazyfs did not mount {mount} (see {self.logs / f'lazyfs-{host.name}.log'})")
            time.sleep(0.05)
        return mount

    def lazyfs_socket(self, host: Host) -> Path:
        return host.dir / "lazyfs.sock"

    def _start_proxy(self, host: Host) -> None:
        routes = [f"{PROXY_BASE + i}={h.ip}:{NATS_CLIENT_PORT}" for i, h in enumerate(self.nats_hosts, start=1)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the proxy keeps true time: it is the network
        self.add(
            host,
            f"proxy-{host.name}",
            [sys.executable, "-m", "apps.nemesis.proxy", str(host.proxy_socket), *routes],
            env,
        )
        deadline = time.monotonic() + 20
        while not host.proxy_socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy of {host.name} did not start")
            time.sleep(0.05)

    # -- gpuherd ----------------------------------------------------------------------------------

    def start_schedulers(self) -> None:
        for i, host in enumerate(self.scheduler_hosts, start=1):
            argv = [sys.executable, "-m", "services.scheduler", "--nats-url", self.proxied_url()]
            argv += ["--lost-after", str(self.lost_after_s), "--tick", "5", "--instance", f"sched{i}"]
            argv += ["--metrics-port", "9100"]
            self.add(host, f"scheduler-{i}", argv)

    def start_agents(self) -> None:
        for i, host in enumerate(self.agent_hosts, start=1):
            argv = [sys.executable, "-m", "services.nodeagent", "--nats-url", self.proxied_url(), "--node", f"n{i}"]
            argv += ["--executor", "cpu", "--gpus", str(self.gpus_per_agent), "--island", "1"]
            argv += ["--data-dir", str(host.dir / "agent"), "--address", host.ip, "--heartbeat", "0.5"]
            argv += ["--fence-after", str(self.fence_after_s), "--kill-grace", "1", "--warm-workers", "0"]
            argv += ["--metrics-port", "9100"]
            self.add(host, f"agent-{i}", argv)

    def start_client(self, config_path: Path) -> Proc:
        host = self.hosts["client"]
        return self.add(host, "client", [sys.executable, "-m", "apps.nemesis.client", str(config_path)])

    # -- clean-up ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove everything this cluster made; safe to call twice, and after a partial build."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            for proc in host.procs.values():
                with contextlib.suppress(Exception):
                    proc.stop(timeout=3)
        self._kill_leftovers()
        for server in self.nats.values():
            with contextlib.suppress(Exception):
                server.stop(timeout=5)
        for mount in self.mounts:
            _run("fusermount3", "-u", "-z", str(mount), check=False)
        for proc in self.fs_procs.values():
            with contextlib.suppress(Exception):
                proc.wait(5)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.ns, check=False)
            _run("ip", "link", "del", f"{self.tag}v{host.index}", check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        with contextlib.suppress(OSError):
            (self.root / DRIVER_FILE).unlink()
        if hasattr(self, "_previous_handlers"):
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)

    def _kill_leftovers(self) -> None:
        """Processes still in this run's namespaces (task shims and jobs outlive their agent)."""
        for host in self.hosts.values():
            listed = _run("ip", "netns", "pids", host.ns, check=False).stdout.split()
            for pid in listed:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGCONT)
                    os.kill(int(pid), signal.SIGKILL)

    def leftovers(self) -> list[str]:
        """What of this run is still there (empty after ``close``)."""
        out = [ns for ns in _run("ip", "netns", "list", check=False).stdout.split() if ns.startswith(self.tag)]
        out += [line for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines() if self.tag in line]
        out += [str(m) for m in self.mounts if os.path.ismount(m)]
        return out


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
