"""A warm standby for an elastic job's next worker: an interpreter with torch already imported.

Starting a worker is most of a grow's delay: a new Python process importing torch takes seconds
(more while the job's other workers keep the cores busy). The task's shim therefore keeps one
``python -m gpuherd.train.standby`` ready. When a grow adds a worker, the shim writes the worker's
launch (one JSON line: ``argv``, ``env``, ``cwd``, ``log``) to the standby's stdin, and the
standby becomes that worker: it takes the environment, sends its output to the worker's log and
runs the script as ``__main__``, as ``python script.py args`` would. Its exit code is the
script's.

Importing torch does not initialise CUDA, so the worker's ``CUDA_VISIBLE_DEVICES`` (set when it
becomes the worker) still decides which GPU it sees. Only ``python script.py ...`` commands run
this way (the shim checks); anything else starts as a new process.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path


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
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))  # read at import by a fresh process; set it here instead
    script = Path(launch["argv"][1])
    sys.argv = [str(script), *launch["argv"][2:]]
    sys.path[0] = str((Path.cwd() / script).resolve().parent)  # as `python script.py` sets it
    runpy.run_path(str(script), run_name="__main__")


def warm() -> None:
    """What a new worker would otherwise do first, slowly: import torch, and the lazy imports its
    first optimizer and first backward pull in (torch._dynamo alone takes about a second)."""
    import torch
    import torch.distributed
    import torch.nn.parallel

    layer = torch.nn.Linear(2, 1)
    torch.optim.SGD(layer.parameters(), lr=0.1).zero_grad()
    layer(torch.zeros(1, 2)).sum().backward()


def main() -> None:
    warm()
    line = sys.stdin.readline()
    if not line.strip():
        return  # the task ended before a grow needed this standby
    become(json.loads(line))


if __name__ == "__main__":
    main()
