"""The `gpuherd` command end to end: `up` in the background, then submit/jobs/nodes/events/cancel/replay."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GPUHERD = [sys.executable, "-m", "apps"]
ENV = dict(os.environ, GPUHERD_LEADERSHIP_TTL="2", PYTHONUNBUFFERED="1", COLUMNS="200")
ENV.pop("NATS_URL", None)


def cli(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*GPUHERD, "--data-dir", str(data_dir), *args], capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT
    )
    if check and result.returncode != 0:
        raise AssertionError(f"gpuherd {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def wait_for(fn, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
            if value:
                return value
        except (AssertionError, json.JSONDecodeError, FileNotFoundError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.3)


def processes_of(data: Path) -> list[int]:
    """The processes of the local cluster in ``data``: its nats-server (whose config is there) and
    every service and agent (started with its NATS URL)."""
    names = [str(data.resolve())]
    if (data / "cluster.json").exists():
        names.append(json.loads((data / "cluster.json").read_text())["nats_url"] + " ")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # (gone meanwhile)
        if any(name in cmdline for name in names):
            found.append(int(entry.name))
    return found


def kill_processes_of(data: Path) -> None:
    for pid in processes_of(data):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def gpuherd_up(data: Path, *flags: str) -> subprocess.Popen[str]:
    """``gpuherd up`` on ``data`` in the background, its output in a pipe."""
    return subprocess.Popen(
        [*GPUHERD, "--data-dir", str(data), "up", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        cwd=ROOT,
    )


@pytest.fixture
def running_cluster(tmp_path):
    data = tmp_path / "data"
    up = gpuherd_up(data, "--agents", "2", "--gpus-per-node", "4", "--cpu-agents", "1", "--policy", "fifo")
    try:
        wait_for(lambda: (data / "cluster.json").exists(), 30)
        wait_for(lambda: len(json.loads(cli(data, "nodes", "--json").stdout)) == 3, 60)
        yield data, up
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()


def test_cli_round_trip(running_cluster, tmp_path) -> None:
    data, up = running_cluster
    nodes = json.loads(cli(data, "nodes", "--json").stdout)
    assert {n["node"] for n in nodes} == {"node-1", "node-2", "cpu-1"} and all(len(n["gpus"]) == 4 for n in nodes)

    hello = tmp_path / "hello.json"
    hello.write_text(
        json.dumps({"name": "hello", "user": "ana", "gpus": 1, "command": ["python", "-c", "print('hi')"]})
    )
    hello_id = json.loads(cli(data, "submit", str(hello), "--json").stdout)["job_id"]

    short = tmp_path / "short.yaml"
    short.write_text("name: short\nuser: ana\ngpus: 2\nduration_s: 0.5\n")
    job = json.loads(cli(data, "submit", str(short), "--json").stdout)["job_id"]
    long = tmp_path / "long.json"
    long.write_text(json.dumps({"name": "long", "user": "ben", "gpus": 8, "nodes": 2, "duration_s": 600}))
    long_id = json.loads(cli(data, "submit", str(long), "--json").stdout)["job_id"]

    bad = cli(data, "submit", str(ROOT / "examples" / "jobs" / "invalid.yaml"), check=False)
    assert bad.returncode == 2 and "`gpus` must be at least 1, got 0" in bad.stdout

    def status(job_id: str) -> str:
        return next(j["status"] for j in json.loads(cli(data, "jobs", "--json").stdout) if j["job"] == job_id)

    wait_for(lambda: status(job) == "completed")
    wait_for(lambda: status(hello_id) == "completed")
    logs = cli(data, "logs", hello_id).stdout
    assert "attempt 0 on cpu-1: rank-0.log" in logs and "hi" in logs.splitlines()
    no_attempt = cli(data, "logs", hello_id, "--attempt", "7", check=False)
    assert no_attempt.returncode == 2 and f"job {hello_id} has no attempt 7; its attempts: 0" in no_attempt.stdout
    wait_for(lambda: status(long_id) == "running")
    table = cli(data, "jobs").stdout
    assert "long" in table and "running" in table

    cli(data, "cancel", long_id)
    wait_for(lambda: status(long_id) == "cancelled")
    missing = cli(data, "cancel", "jdoesnotexist", check=False)
    assert missing.returncode == 2 and "no job, array or workflow 'jdoesnotexist'" in missing.stdout

    events = [json.loads(line) for line in cli(data, "events", "--job", long_id, "--json").stdout.splitlines()]
    kinds = [e["type"] for e in events if e["type"] != "JobDurationPredicted"]
    assert kinds[:3] == ["JobSubmitted", "JobPlaced", "JobStarted"] and "JobCancelRequested" in kinds
    predicted = [e for e in events if e["type"] == "JobDurationPredicted"]
    assert len(predicted) == 1 and predicted[0]["source"] == "analytics"  # the live analytics service
    assert kinds[-1] == "JobFinished" and events[-1]["outcome"] == "cancelled"
    placed = cli(data, "events", "--type", "JobPlaced", "--node", "node-2", "--json").stdout.splitlines()
    assert any(json.loads(line)["job"] == long_id for line in placed)
    every = [json.loads(line) for line in cli(data, "events", "--json").stdout.splitlines()]
    last = [json.loads(line) for line in cli(data, "events", "--last", "5", "--json").stdout.splitlines()]
    assert last == every[-5:], "the last five events, however many a stored message holds"

    audit = json.loads(cli(data, "replay", "--audit", "--json").stdout)
    assert audit["ok"] and audit["decisions_checked"] >= 2 and audit["mismatches"] == []

    up.send_signal(signal.SIGINT)
    output, _ = up.communicate(timeout=30)
    assert up.returncode == 0 and "stopped" in output


def test_a_second_up_in_a_data_dir_in_use_is_refused(running_cluster) -> None:
    """Two nats-servers on one JetStream store, and --fresh deleting the first's: refused."""
    data, _ = running_cluster
    second = gpuherd_up(data, "--agents", "1", "--fresh")
    try:
        output, _ = second.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        second.send_signal(signal.SIGINT)  # (it started a second cluster: it stops what it started)
        output, _ = second.communicate(timeout=30)
    assert second.returncode == 2 and "is in use by gpuherd up" in output, output
    assert len(json.loads(cli(data, "nodes", "--json").stdout)) == 3, "the first cluster serves on"


def test_the_dashboard_of_a_default_up_takes_the_token_it_made(running_cluster) -> None:
    """A default `up` made its dashboard read-only: its pages could not cancel, drain or run the audit."""
    import urllib.error
    import urllib.request

    data, _ = running_cluster
    url = wait_for(lambda: (data / "dashboard.url").exists() and (data / "dashboard.url").read_text().strip(), 30)
    token = (data / "dashboard.token").read_text().strip()

    def drain(bearer: str | None) -> int:
        request = urllib.request.Request(url + "api/nodes/nosuch/drain", data=b"{}", method="POST")
        request.add_header("Content-Type", "application/json")
        if bearer is not None:
            request.add_header("Authorization", f"Bearer {bearer}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert json.loads(urllib.request.urlopen(url + "api/session", timeout=10).read())["actions"] is True
    assert drain(None) == 401
    assert drain(token) == 404  # past the token: the CLI's own check finds no such node


@pytest.mark.long
def test_demo_runs_and_audits_clean(tmp_path) -> None:
    trace = ROOT.parent / "shared" / "traces" / "philly" / "philly.csv"
    if not trace.exists():
        pytest.skip("../shared/traces/philly/philly.csv is not beside this checkout")
    result = subprocess.run(
        [
            *GPUHERD,
            "--data-dir",
            str(tmp_path / "demo"),
            "up",
            "--agents",
            "2",
            "--gpus-per-node",
            "8",
            "--demo",
            "philly",
            "--demo-jobs",
            "40",
            "--demo-seconds",
            "4",
            "--trace",
            str(trace),
            "--exit-after-demo",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=ENV,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no mismatches" in result.stdout and "mean_queue_s" in result.stdout


def test_operator_commands_and_why(running_cluster, tmp_path) -> None:
    data, _ = running_cluster

    def submit(spec: dict) -> str:
        path = tmp_path / f"{spec['name']}.json"
        path.write_text(json.dumps(spec))
        return json.loads(cli(data, "submit", str(path), "--json").stdout)["job_id"]

    def why(job_id: str) -> dict:
        return json.loads(cli(data, "why", job_id, "--json").stdout)

    cli(data, "vc", "set", "vision", "--quota", "2", "--no-borrow")
    vision = next(v for v in json.loads(cli(data, "vc", "list", "--json").stdout) if v["vc"] == "vision")
    assert vision["gpu_quota"] == 2 and vision["can_borrow"] is False and vision["borrowing"] == 0

    bad = cli(data, "policy", "set", "sjf", "--param", "bogus=1", check=False)
    assert bad.returncode == 2 and "has no parameter bogus" in bad.stdout
    cli(data, "policy", "set", "sjf")
    assert json.loads(cli(data, "policy", "show", "--json").stdout)["policy"] == "sjf"

    bad = cli(data, "elastic", "set", "--param", "min_interval=5", check=False)
    assert bad.returncode == 2 and "known parameters" in bad.stdout
    cli(data, "elastic", "set", "--param", "min_interval_s=5")
    assert json.loads(cli(data, "elastic", "show", "--json").stdout)["min_interval_s"] == 5.0

    cli(data, "drain", "node-1", "--reason", "maintenance")
    cli(data, "drain", "node-2")
    waiting = submit({"name": "waits", "user": "ana", "gpus": 1, "duration_s": 0.5})
    wait_for(lambda: why(waiting).get("kind") == "drained")
    assert "node-1" in why(waiting)["why"]
    path = tmp_path / "never.json"
    path.write_text(json.dumps({"name": "never", "user": "ana", "gpus": 3, "duration_s": 0.5, "vc": "vision"}))
    never = cli(data, "submit", str(path), check=False)
    assert never.returncode == 2 and "could never start" in never.stdout, "more than its VC may ever have"

    cli(data, "undrain", "node-1")
    wait_for(lambda: why(waiting)["status"] == "completed")
    holder = submit({"name": "holder", "user": "ana", "gpus": 2, "duration_s": 60, "vc": "vision"})
    wait_for(lambda: why(holder)["status"] == "running")
    over = submit({"name": "over", "user": "ana", "gpus": 1, "duration_s": 0.5, "vc": "vision"})
    wait_for(lambda: why(over).get("kind") == "quota")
    assert "VC vision uses 2 of its 2 GPUs" in why(over)["why"]
    expected = why(over)["estimated_start"]  # when holder, 60 s long, is expected to end
    assert expected is not None and time.time() - 5 < expected < time.time() + 61
    assert "quota" in cli(data, "jobs").stdout
    nodes = {n["node"]: n for n in json.loads(cli(data, "nodes", "--json").stdout)}
    assert nodes["node-1"]["status"] == "up" and nodes["node-2"]["status"] == "drained"


@pytest.mark.long
def test_profile_command_writes_table_json_and_roofline(tmp_path) -> None:
    env = dict(ENV, XDG_CACHE_HOME=str(tmp_path / "cache"))
    args = ["profile", "examples/train_cnn.py:SmallResNet", "--input", "3,32,32", "--batch", "4"]
    args += ["--warmup", "0", "--repeats", "2", "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "r.png")]
    result = subprocess.run([*GPUHERD, *args], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "layers.0.conv1" in result.stdout and "compute" in result.stdout and "memory" in result.stdout
    profile = json.loads((tmp_path / "p.json").read_text())
    assert profile["model"] == "SmallResNet" and profile["peaks"]["matmul_flops"] > 0
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert (tmp_path / "cache" / "gpuherd" / "peaks.json").exists()  # measured once, then cached
    shown = subprocess.run(
        [*GPUHERD, "profile", "--from", str(tmp_path / "p.json"), "--blocks"], capture_output=True, text=True, env=env
    )
    assert shown.returncode == 0 and "layers.1" in shown.stdout
    bad = subprocess.run(
        [*GPUHERD, "profile", "examples/train_cnn.py:NoSuchModel", "--input", "3"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "has no NoSuchModel" in bad.stdout + bad.stderr


def test_up_stops_what_it_started_when_its_vcs_cannot_be_configured(tmp_path) -> None:
    data = tmp_path / "data"
    vcs = tmp_path / "vcs.yaml"
    vcs.write_text("- {name: vision lab, quota: 4}\n")  # (a VC name has no spaces: the client refuses it)
    try:
        result = cli(data, "up", "--agents", "1", "--vcs", str(vcs), check=False)
        assert result.returncode == 2 and "VC names are" in result.stdout, result.stdout + result.stderr
        assert (data / "cluster.json").exists(), "(the cluster had started)"
        assert processes_of(data) == [], "every process it started is stopped"
    finally:
        kill_processes_of(data)
