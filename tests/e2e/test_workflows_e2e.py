"""Workflows, arrays, time limits, dependencies and accounting on a live cluster: `gpuherd up` with
two cpu agents running real processes, driven through the CLI.

One cluster runs, side by side: a 3-step workflow (each step starts once the one before completed),
an array of 8 with max_running 2 (never more than 2 at once, read from the agents' run records), a
job its time limit stops (status ``timeout``), and a job whose parent fails (cancelled, with the
reason). Then ``gpuherd usage --json`` must equal the GPU-seconds summed from the run records, and
the audit must re-derive every decision.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_cli import ENV, GPUHERD, ROOT, cli, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(480)]

UP_FLAGS = ("--agents", "0", "--cpu-agents", "2", "--cpu-gpus", "4", "--policy", "fifo", "--ui-port", "-1")


@pytest.fixture
def cpu_cluster(tmp_path: Path) -> Iterator[Path]:
    data = tmp_path / "data"
    up = subprocess.Popen(
        [*GPUHERD, "--data-dir", str(data), "up", *UP_FLAGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    try:
        wait_for(lambda: (data / "cluster.json").exists(), 30)
        wait_for(lambda: len(json.loads(cli(data, "nodes", "--json").stdout)) == 2, 60)
        yield data
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(10)


def submit(data: Path, tmp: Path, spec: dict[str, Any], *flags: str) -> dict[str, Any]:
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    return json.loads(cli(data, "submit", str(path), "--json", *flags).stdout)


def events(data: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cli(data, "events", "--json").stdout.splitlines()]


def statuses(data: Path) -> dict[str, str]:
    return {j["job"]: j["status"] for j in json.loads(cli(data, "jobs", "--json", "--limit", "1000").stdout)}


def run_records(log: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Each attempt as the agents and the scheduler recorded it: its GPUs, its first start, the end of
    each of its tasks (TaskEnded, by the agents), and its end."""
    attempts: dict[tuple[str, int], dict[str, Any]] = {}
    for e in log:
        if e["type"] in ("JobPlaced", "JobStarted", "TaskEnded", "JobFinished", "JobRequeued"):
            a = attempts.setdefault((e["job"], e["attempt"]), {"tasks_ended": []})
            if e["type"] == "JobPlaced":
                a["gpus"] = sum(len(alloc["gpus"]) for alloc in e["allocations"])
                a["placed"] = e["at"]
            elif e["type"] == "JobStarted":
                a.setdefault("started", e["at"])
            elif e["type"] == "TaskEnded":
                a["tasks_ended"].append(e["at"])
            else:
                a["ended"] = e["at"]
    return attempts


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in edges:  # (an end sorts before a start at the same moment)
        now += step
        most = max(most, now)
    return most


def test_workflow_array_time_limit_dependencies_and_usage_on_cpu_agents(cpu_cluster: Path, tmp_path: Path) -> None:
    data = cpu_cluster
    sleep = lambda s: ["python", "-c", f"import time; time.sleep({s})"]  # noqa: E731

    # Bad input is refused with its reason, and recorded.
    cli(data, "vc", "set", "default", "--max-time-limit", "1h")
    too_long = cli(data, "submit", "--time-limit", "2h", str(ROOT / "examples/jobs/sim-1gpu.yaml"), check=False)
    assert too_long.returncode == 2 and "above VC default's maximum of 3600s" in too_long.stdout
    cycle = {
        "workflow": "loop",
        "user": "ana",
        "gpus": 1,
        "steps": [
            {"name": "a", "command": sleep(0), "depends_on": {"afterok": ["b"]}},
            {"name": "b", "command": sleep(0), "depends_on": {"afterok": ["a"]}},
        ],
    }
    refused = cli(data, "submit", str(_write(tmp_path, cycle)), check=False)
    assert refused.returncode == 2 and "form a cycle" in refused.stdout

    workflow = submit(
        data,
        tmp_path,
        {
            "workflow": "pipe",
            "user": "ana",
            "gpus": 1,
            "steps": [
                {"name": "prep", "command": sleep(4)},
                {"name": "train", "gpus": 2, "command": sleep(2), "depends_on": {"afterok": ["prep"]}},
                {"name": "eval", "command": sleep(1), "depends_on": {"afterok": ["train"]}},
            ],
        },
    )
    steps = {name: ids[0] for name, ids in workflow["steps"].items()}
    # While the workflow runs, its later steps wait for their dependency, and say so.
    why = json.loads(cli(data, "why", steps["eval"], "--json").stdout)
    assert why["status"] == "pending" and why["kind"] == "dependency", why
    listed = json.loads(cli(data, "jobs", "--workflow", "pipe", "--json").stdout)
    assert [j["job"] for j in listed] == list(steps.values())

    array = submit(
        data,
        tmp_path,
        {"name": "sweep", "user": "ben", "gpus": 1, "command": ["python", "-c", _ELEMENT]},
        "--array",
        "8",
        "--max-running",
        "2",
    )
    limited = submit(
        data, tmp_path, {"name": "forever", "user": "cy", "gpus": 1, "command": sleep(600)}, "--time-limit", "5"
    )
    limited_id = limited["job_id"]
    assert limited_id and "array" not in limited
    parent = submit(
        data, tmp_path, {"name": "parent", "user": "dee", "gpus": 1, "command": ["python", "-c", "raise SystemExit(3)"]}
    )
    child = submit(
        data,
        tmp_path,
        {"name": "child", "user": "dee", "gpus": 1, "command": sleep(0)},
        "--depends",
        f"afterok:{parent['job_id']}",
    )

    # A workflow and an array cancelled as a whole: every job of them not ended yet.
    held = submit(
        data,
        tmp_path,
        {
            "workflow": "held",
            "user": "eve",
            "gpus": 1,
            "steps": [
                {"name": "first", "command": sleep(600)},
                {"name": "second", "command": sleep(0), "depends_on": {"afterany": ["first"]}},
            ],
        },
    )
    idle = submit(data, tmp_path, {"name": "idle", "user": "eve", "gpus": 1, "command": sleep(600)}, "--array", "3")
    assert "cancel requested for 2 of the 2 jobs of held" in cli(data, "cancel", "held").stdout
    assert "cancel requested for 3 of the 3 jobs" in cli(data, "cancel", idle["array"]).stdout
    cancelled_groups = [*held["job_ids"], *idle["job_ids"]]

    everything = [*steps.values(), *array["job_ids"], parent["job_id"], child["job_id"], *cancelled_groups]
    wait_for(lambda: all(statuses(data).get(j) in ("completed", "failed", "cancelled") for j in everything), 240)
    wait_for(lambda: statuses(data)[limited_id] == "timeout", 60)
    now = statuses(data)
    assert [now[j] for j in steps.values()] == ["completed"] * 3
    assert all(now[j] == "completed" for j in array["job_ids"]) and len(array["job_ids"]) == 8
    assert now[parent["job_id"]] == "failed" and now[child["job_id"]] == "cancelled"
    assert all(now[j] == "cancelled" for j in cancelled_groups)

    log = events(data)
    runs = run_records(log)
    # The workflow's steps ran one after the other.
    prep, train, evaluate = (runs[(steps[s], 0)] for s in ("prep", "train", "eval"))
    assert prep["ended"] <= train["placed"] and train["ended"] <= evaluate["placed"]
    # The array: never more than 2 elements placed or running at once (and so never more running).
    elements = [runs[(j, 0)] for j in array["job_ids"]]
    assert most_at_once([(e["placed"], e["ended"]) for e in elements]) <= 2
    assert most_at_once([(e["started"], max(e["tasks_ended"])) for e in elements]) <= 2
    assert "element 5 of 8" in cli(data, "logs", array["job_ids"][5]).stdout
    # The time limit: stopped by the agents (their run record says why), ended as timeout.
    limit = next(e for e in log if e["type"] == "JobTimeLimitReached" and e["job"] == limited_id)
    assert limit["source"] == "scheduler" and limit["limit_s"] == 5.0
    stopped = [e for e in log if e["type"] == "TaskEnded" and e["job"] == limited_id]
    assert stopped and all(e["outcome"] == "stopped" and "time limit of 5s reached" in e["reason"] for e in stopped)
    ran = runs[(limited_id, 0)]
    assert 5.0 <= limit["at"] - ran["started"] < 7.0, "the timer ticks at the deadline, not at its period"
    # The dependant of a failed parent: cancelled, with the reason.
    cancelled = next(e for e in log if e["type"] == "JobFinished" and e["job"] == child["job_id"])
    assert f"dependency afterok:{parent['job_id']} can never be met" in cancelled["reason"]

    # Accounting: exactly the GPU-seconds of the run records.
    expected = sum(a["gpus"] * (a["ended"] - a["started"]) for a in runs.values() if "started" in a)
    usage = json.loads(cli(data, "usage", "--json", "--by", "vc,user").stdout)
    assert usage["total"]["gpu_seconds"] == pytest.approx(expected, rel=1e-9, abs=1e-6)
    assert usage["total"]["jobs"] == {"completed": 11, "failed": 1, "cancelled": 6, "timeout": 1}
    by_user = {row["user"]: row for row in usage["rows"]}
    assert by_user["ben"]["gpu_seconds"] == pytest.approx(sum(e["ended"] - e["started"] for e in elements))
    history = json.loads(cli(data, "history", "--json", "--state", "timeout").stdout)
    assert [h["job"] for h in history] == [limited_id]
    audit = json.loads(cli(data, "replay", "--audit", "--json").stdout)
    assert audit["ok"] and audit["mismatches"] == []


_ELEMENT = "import os, time; print('element', os.environ['GPUHERD_ARRAY_INDEX'], 'of 8'); time.sleep(1.5)"


def _write(tmp: Path, spec: dict[str, Any]) -> Path:
    path = tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    return path
