"""The task shim: one small supervisor process per task (a job attempt's part on this node).

The agent starts ``python -m services.nodeagent.shim TASK_DIR`` in a session of
its own; the shim starts the job's processes in one process group, waits, and
writes how they ended to ``TASK_DIR/exit.json``. Everything the agent needs
to find the task again lives in ``TASK_DIR``, so an agent restart loses
nothing: the new agent adopts a live shim, or reads the exit record of one
that finished while no agent was there.

Three rules make "nothing runs twice at the same time" hold:
- one rank failing stops the other ranks of the task (they would hang in a collective);
- on SIGTERM the shim sends SIGTERM to the whole process group, waits the
  grace period, then SIGKILLs the group (so no grandchild survives either);
- **fencing**: the agent touches ``alive_file`` after every heartbeat the log
  accepted. If it goes stale for ``fence_after_s`` (agent dead, or cut off from
  the log) the shim stops the task itself. The scheduler declares a node lost
  only after a longer silence, so by then nothing of the task is left to run
  next to its requeued attempt.

This module uses only the standard library: it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.1


def write_json(path: Path, data: object) -> None:
    """Write atomically: a reader sees the old file or the whole new one."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Shim:
    def __init__(self, task_dir: Path) -> None:
        self.dir = task_dir
        spec = json.loads((task_dir / "task.json").read_text())
        self.procs_spec: list[dict] = spec["procs"]
        self.cwd: str | None = spec.get("cwd")
        self.alive_file = Path(spec["alive_file"])
        self.fence_after_s = float(spec["fence_after_s"])
        self.kill_grace_s = float(spec["kill_grace_s"])
        self.stop_reason: str | None = None
        self.checkpoint_grace_s = 0.0
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pgid: int | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        if self.stop_reason is not None:
            return
        request = {}  # stays empty when stopped by hand rather than by the agent
        with contextlib.suppress(FileNotFoundError, ValueError):
            request = json.loads((self.dir / "stop.json").read_text())
        self.checkpoint_grace_s = float(request.get("checkpoint_grace_s", 0.0))
        self.stop_reason = request.get("reason") or f"stopped by the agent ({signal.Signals(signum).name})"

    def launch(self) -> str | None:
        """Start every rank in one new process group; the reason if one could not start."""
        for rank, proc in enumerate(self.procs_spec):
            with open(proc["log"], "ab", buffering=0) as log:
                try:
                    child = subprocess.Popen(
                        proc["argv"],
                        env=proc["env"],
                        cwd=self.cwd,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        process_group=0 if self.pgid is None else self.pgid,
                    )
                except OSError as exc:
                    reason = f"cannot start {proc['argv'][0]!r}: {exc.strerror or exc}"
                    log.write(f"gpuherd: {reason}\n".encode())
                    return f"local rank {rank}: {reason}"
            if self.pgid is None:
                self.pgid = child.pid
            self.procs.append(child)
        return None

    def signal_group(self, sig: int) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)

    def fenced(self) -> bool:
        try:
            age = time.time() - self.alive_file.stat().st_mtime
        except FileNotFoundError:
            age = float("inf")
        if age > self.fence_after_s:
            self.stop_reason = f"fenced: the agent was out of contact with the log for {age:.1f}s"
            return True
        return False

    def checkpoint(self, grace_s: float) -> None:
        """Preemption: SIGUSR1 asks the ranks to save a checkpoint and exit; wait up to ``grace_s``."""
        self.signal_group(signal.SIGUSR1)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)

    def stop_all(self, grace_s: float) -> None:
        self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(POLL_S)
        self.signal_group(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        started_at = time.time()
        write_json(self.dir / "shim.json", {"pid": os.getpid(), "started_at": started_at})
        failure = self.launch() if self.stop_reason is None else None
        info = {"pid": os.getpid(), "pgid": self.pgid, "pids": [p.pid for p in self.procs], "started_at": started_at}
        write_json(self.dir / "shim.json", info | {"launched_at": time.time()})
        first_failure: tuple[int, int] | None = None  # (local rank, exit code)
        if failure is not None:
            self.stop_all(self.kill_grace_s)
        else:
            while True:
                codes = [p.poll() for p in self.procs]
                if all(c is not None for c in codes):
                    break
                bad = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
                if bad is not None:
                    first_failure = bad
                    self.stop_all(self.kill_grace_s)
                    break
                if self.stop_reason is not None:
                    if self.checkpoint_grace_s > 0:
                        self.checkpoint(self.checkpoint_grace_s)
                    self.stop_all(self.kill_grace_s)
                    break
                if self.fenced():
                    self.stop_all(min(self.kill_grace_s, 2.0))
                    break
                time.sleep(POLL_S)
            self.signal_group(signal.SIGKILL)  # whatever the ranks left behind (workers, helpers)
        codes = [p.returncode for p in self.procs]
        if failure is None and first_failure is None:
            first_failure = next(((r, c) for r, c in enumerate(codes) if c != 0), None)
        if failure is None and first_failure is not None and self.stop_reason is None:
            rank, code = first_failure
            failure = f"local rank {rank} {describe_exit(code)}"
        write_json(
            self.dir / "exit.json",
            {
                "codes": codes,
                "failure": failure,
                "failed_rank": None if first_failure is None else first_failure[0],
                "stopped": self.stop_reason,
                "ended_at": time.time(),
            },
        )
        return 0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not start"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m services.nodeagent.shim TASK_DIR")
    raise SystemExit(Shim(Path(sys.argv[1])).run())


if __name__ == "__main__":
    main()
