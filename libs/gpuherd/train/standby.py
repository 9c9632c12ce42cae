"""A warm worker for an elastic job: an interpreter with torch already imported, waiting to become
the job's next worker.

Starting a worker is most of a grow's delay: a new Python process importing torch takes seconds
(more while the job's other workers keep the cores busy). So interpreters are started ahead of
time, ``python -m gpuherd.train.standby``, in two places:

- the task's shim keeps one for its job (a grow on a node that already runs the job);
- the node agent keeps a pool of them for every elastic job of the node (a grow onto a node the
  job does not run on yet, or beyond the shim's one), ``services/nodeagent/pool.py``.

When it is warm the standby prints ``gpuherd standby: warm ...`` on its stdout. Whoever holds its
stdin then writes the worker's launch (one JSON line: ``argv``, ``env``, ``cwd``, ``log``, and
optionally ``exit_file``), and the standby becomes that worker: it takes the environment, sends
its output to the worker's log, reads nothing from its old stdin, and runs the script as
``__main__``, as ``python script.py args`` would. Its exit code is the script's; with ``exit_file``
it also writes ``{"code": N}`` there when the script ends (for a supervisor that is not its parent;
a negative N is a death by signal -N, as ``Popen.returncode`` says it).

Neither importing torch nor the rest of the warm-up initialises CUDA (no torch.cuda call, no
backward: see ``warm``), so the worker's ``CUDA_VISIBLE_DEVICES`` (set when it becomes the worker)
still decides which GPU it sees. With ``GPUHERD_WARM_CUDA=1`` in its own
environment the standby creates its CUDA context ahead of time too (on the GPU its own
``CUDA_VISIBLE_DEVICES`` names); it must then only become a worker of that same GPU. Only
``python script.py ...`` commands run this way (the shim and the pool check); anything else starts
as a new process.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

WARM_MARKER = "gpuherd standby: warm"
WARM_CUDA = "GPUHERD_WARM_CUDA"  # "1": create the CUDA context before the worker is known


def become(launch: dict) -> None:
    """Turn this process into the worker ``launch`` describes, then run it."""
    os.environ.clear()
    os.environ.update(launch["env"])
    if launch.get("cwd"):
        os.chdir(launch["cwd"])
    log = os.open(launch["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    nothing = os.open(os.devnull, os.O_RDONLY)  # the old stdin belongs to whoever handed the launch
    os.dup2(nothing, 0)
    os.close(nothing)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))  # read at import by a fresh process; set it here instead
    script = Path(launch["argv"][1])
    sys.argv = [str(script), *launch["argv"][2:]]
    sys.path[0] = str((Path.cwd() / script).resolve().parent)  # as `python script.py` sets it
    exit_file = launch.get("exit_file")
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except KeyboardInterrupt:
        # An unhandled KeyboardInterrupt (SIGINT) ends the interpreter by SIGINT: record a signal
        # death as the agent would (a negative code), not a clean exit.
        code = -signal.SIGINT
        raise
    except BaseException:
        code = 1  # the traceback is printed on the way out, and the interpreter exits with 1
        raise
    finally:
        if exit_file:
            _record_exit(Path(exit_file), code)


def _record_exit(path: Path, code: int) -> None:
    """Write the exit record once (whoever writes first, this process or its parent, is right)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        json.dump({"code": code, "by": "worker"}, f)


def warm() -> None:
    """What a new worker would otherwise do first, slowly: import torch and gpuherd's training
    runtime, and the lazy imports its first optimizer pulls in (torch._dynamo alone takes about a
    second); with ``GPUHERD_WARM_CUDA=1``, create the CUDA context."""
    import torch
    import torch.distributed
    import torch.nn.parallel

    import gpuherd.train.elastic  # noqa: F401 - what an elastic worker imports next

    layer = torch.nn.Linear(2, 1)
    torch.optim.SGD(layer.parameters(), lr=0.1).zero_grad()
    # No backward: the autograd engine's first run starts its device threads, which asks CUDA for its
    # device count (CUDA_VISIBLE_DEVICES is then fixed for the process, and the worker this standby
    # becomes would see the standby's GPUs). A backward imports nothing and takes under a millisecond.
    if os.environ.get(WARM_CUDA) == "1" and torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()


def main() -> None:
    started = time.perf_counter()
    warm()
    print(f"{WARM_MARKER} in {time.perf_counter() - started:.2f}s (pid {os.getpid()})", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return  # nobody needed it before whoever kept it closed its stdin
    become(json.loads(line))


if __name__ == "__main__":
    main()
