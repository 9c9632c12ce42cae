"""Several simulations of one input at once: a sweep of policies runs each policy in a forked
process of its own, up to one per core, and hands each result back as it finishes.

The runs share nothing (each folds its own states from the same inputs), so a sweep's results are
those of the runs one after the other; only its wall time changes. Forked, a run inherits its
inputs (a trace, a cluster) instead of receiving them pickled: only its result crosses back, and
its progress, in batches.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import queue as queues
import signal
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from apps.sim.engine import SimulationError

R = TypeVar("R")
Progress = Callable[[int], None]  # a run reports the submissions it has made, n at a time
PROGRESS_EVERY = 2_000  # submissions a forked run makes between two progress messages
_POLL_S = 1.0  # how often the sweep looks for a run that died without a word
_STOP_S = 10.0  # how long a run told to stop may take to end before it is killed


def workers_for(runs: int, workers: int | None = None) -> int:
    """Runs at a time: ``workers`` (None or 0: one per core), never more than there are runs."""
    return max(1, min(runs, workers or os.cpu_count() or 1))


def cores_each(at_once: int) -> int:
    """The cores each of ``at_once`` runs at a time may give its own workers (a model that splits the
    cluster by VC runs its VCs on the cores too): the machine's, shared among the runs."""
    return max(1, (os.cpu_count() or 1) // at_once)


def sweep(
    names: Sequence[str],
    run: Callable[[str, Progress], R],
    *,
    workers: int | None = None,
    on_progress: Callable[[str, int], None] | None = None,
) -> Iterator[tuple[str, R]]:
    """``run(name, progress)`` for each name, ``workers`` at a time (default one per core), each in a
    forked process; (name, result) as each finishes. A run that fails raises ``SimulationError``
    with its traceback; the runs still going are stopped, as they are when the caller stops early."""
    names = list(dict.fromkeys(names))
    at_once = workers_for(len(names), workers)
    report = on_progress or (lambda name, n: None)
    if at_once <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for name in names:
            yield name, run(name, lambda n, name=name: report(name, n))
        return
    context = multiprocessing.get_context("fork")
    messages = context.Queue()
    waiting = collections.deque(names)
    running: dict[str, BaseProcess] = {}
    try:
        while waiting or running:
            while waiting and len(running) < at_once:
                name = waiting.popleft()
                process = context.Process(target=_run_forked, args=(run, name, messages), name=f"gpuherd-sim-{name}")
                process.start()
                running[name] = process
            try:
                kind, name, payload = messages.get(timeout=_POLL_S)
            except queues.Empty:
                _check_alive(running)
                continue
            if kind == "progress":
                report(name, payload)
            elif kind == "done":
                running.pop(name).join()
                yield name, payload
            else:
                raise SimulationError(f"the simulation of {name} failed:\n{payload}")
    finally:
        _stop(running.values())
        messages.close()
        messages.join_thread()


def _stop(processes: Iterable[BaseProcess]) -> None:
    """Stop runs still going: SIGTERM, which ends a run at once (``_run_forked``) and with it the
    workers it runs a partitioned model's VCs on (``run._partitions``); SIGKILL for one that has not
    ended within ``_STOP_S`` (one stopped by Ctrl-Z, say)."""
    processes = list(processes)
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _STOP_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _check_alive(running: dict[str, BaseProcess]) -> None:
    for name, process in running.items():
        if process.exitcode is not None and process.exitcode != 0:
            raise SimulationError(
                f"the simulation of {name} died (exit code {process.exitcode}; -9 is often the kernel "
                "ending it for want of memory: run fewer at a time)"
            )


def _run_forked(run: Callable[[str, Progress], Any], name: str, messages: Any) -> None:
    # The sweep stops a run with SIGTERM, which must end it whatever handler it inherited (one that
    # only set a flag would leave it running). Ctrl-C reaches it as it reaches the sweep: SIGINT to
    # the terminal's process group, which the run stays in.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    made = 0

    def progress(n: int) -> None:
        nonlocal made
        made += n
        if made >= PROGRESS_EVERY:
            messages.put(("progress", name, made))
            made = 0

    try:
        result = run(name, progress)
    except BaseException:  # (told to the sweep, which raises it there with this traceback)
        messages.put(("failed", name, traceback.format_exc()))
        return
    if made:
        messages.put(("progress", name, made))
    messages.put(("done", name, result))
