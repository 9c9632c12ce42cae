"""The nemesis' intake client: submits jobs at a steady rate and records every acknowledgement.

Run on the client host (``python -m apps.nemesis.client CONFIG.json``). Each submission has an
``intake_id`` of its own and is retried with the same id until the scheduler answers (a retry is
a no-op by design). A verdict ``ok`` with a job id is an *acknowledgement*: the checker holds the
cluster to every one of them. The records are JSON lines, written and flushed as they come (the
file is the client's own memory, read by the checker from outside).

Each job is a real process on a cpu agent (``JOB_SCRIPT``): it writes its run record (start, a
tick every 50 ms, end; monotonic clock, which no clock skew touches) to a file of its own in
``runs_dir``, so the checker sees what really ran where and when.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

from gpuherd.client import Client

JOB_SCRIPT = """
import os, sys, time
d = os.environ["NEMESIS_RUNS"]
job, attempt = os.environ["GPUHERD_JOB_ID"], os.environ.get("GPUHERD_ATTEMPT", "0")
node, gpus = os.environ.get("GPUHERD_NODE", "?"), os.environ.get("GPUHERD_VIRTUAL_GPUS", "")
duration = float(sys.argv[1])
out = open(os.path.join(d, f"{job}.{attempt}.{node}.{os.getpid()}"), "a", buffering=1)
start = time.monotonic()
out.write(f"start {start:.3f} {gpus}\\n")
while time.monotonic() - start < duration:
    time.sleep(0.05)
    out.write(f"tick {time.monotonic():.3f}\\n")
out.write(f"end {time.monotonic():.3f}\\n")
"""


def job_spec(i: int, run: str, rng: random.Random, runs_dir: str) -> dict:
    duration = round(rng.uniform(0.4, 1.6), 2)
    return {
        "name": f"nem{i}",
        "user": rng.choice(["ann", "bob", "cy"]),
        "gpus": rng.choice([1, 1, 1, 2]),
        "command": ["python", "-c", JOB_SCRIPT, str(duration)],
        "env": {"NEMESIS_RUNS": runs_dir},
        "intake_id": f"{run}-{i}",
    }


async def submit_all(config: dict) -> None:
    rng = random.Random(config["seed"])
    out = open(config["out"], "a", buffering=1)  # noqa: SIM115 - the whole run's record
    client = await Client.connect(config["url"], source="nemesis", persistent=True)
    slots = asyncio.Semaphore(config.get("in_flight", 64))
    give_up_at = time.monotonic() + config["give_up_after_s"]

    async def one(spec: dict) -> None:
        sent = time.monotonic()
        try:
            while time.monotonic() < give_up_at:
                try:
                    job = await client.submit(spec, timeout=15.0, attempt_timeout=3.0)
                except Exception as exc:  # no verdict yet (a fault): the same intake id again
                    if "no verdict" not in str(exc) and "cannot reach" not in str(exc):
                        out.write(json.dumps({"intake": spec["intake_id"], "rejected": str(exc)}) + "\n")
                        return
                    continue
                record = {"intake": spec["intake_id"], "job": job, "sent": sent, "acked": time.monotonic()}
                out.write(json.dumps(record) + "\n")
                return
            out.write(json.dumps({"intake": spec["intake_id"], "unanswered": True}) + "\n")
        finally:
            slots.release()

    start = time.monotonic()
    tasks = []
    for i in range(config["count"]):
        delay = start + i / config["rate"] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        spec = job_spec(i, config["run"], rng, config["runs_dir"])  # in order: the same specs every run
        await slots.acquire()
        tasks.append(asyncio.create_task(one(spec)))
    await asyncio.gather(*tasks)
    await client.close()
    out.write(json.dumps({"done": True}) + "\n")
    out.close()


def main(argv: list[str] | None = None) -> None:
    config = json.loads(Path((argv or sys.argv[1:])[0]).read_text())
    asyncio.run(submit_all(config))


if __name__ == "__main__":
    main()
