"""Small asyncio helpers every long-running gpuherd process uses."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from gpuherd.errors import LogUnavailable
from gpuherd.obs import get_logger

log = get_logger("gpuherd.aio")


T = TypeVar("T")


async def patiently(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    patience_s: float,
    transient: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """``call()``, tried again after ``transient`` failures (NATS failing over, a stream electing
    its leader) with a growing pause, for ``patience_s``; then LogUnavailable naming ``what``."""
    deadline = time.monotonic() + patience_s
    delay = 0.1
    while True:
        try:
            return await call()
        except transient as exc:
            if time.monotonic() > deadline:
                raise LogUnavailable(f"{what}: no success within {patience_s:.0f}s ({exc!r})") from exc
            log.warning(f"{what}: failed; retrying", error=repr(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def off_loop(call: Callable[[], T], *, name: str) -> T:
    """``call()`` in a daemon thread of its own, awaited: like ``asyncio.to_thread``, except that
    the process may end while it runs. ``asyncio.run`` joins the default executor's threads at its
    end, so a call blocked in the kernel (a wait for killed processes to be gone, a GPU driver that
    hangs) would hold a stopped process past its exit deadline."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result, error = call(), None
        except BaseException as exc:  # (handed to the awaiting task, not lost in the thread)
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await done


# A task that swallows a cancellation is cancelled again this often, for this long at most, when a
# process stops its loops (``cancel_until_done``): a stopped process ends within a second.
RECANCEL_S = 0.01
STOP_LOOPS_S = 0.5


async def cancel_until_done(
    tasks: Iterable[asyncio.Task[Any]], *, timeout_s: float, retry_s: float = RECANCEL_S
) -> set[asyncio.Task[Any]]:
    """Cancel ``tasks`` and wait for them to end, cancelling again every ``retry_s`` those still
    running, for ``timeout_s`` at most; the ones still running then. A task may swallow a
    cancellation: Python 3.11's ``wait_for`` returns a failure (a timeout) that came with it, and a
    retry loop around it (nats-py's reconnect, a request retried until NATS answers) goes on. One
    cancellation, then waiting, kept a scheduler stopped with SIGTERM running for over an hour."""
    pending = {task for task in tasks if not task.done()}
    deadline = time.monotonic() + timeout_s
    while pending:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(retry_s, left_s))
    return pending


async def run_until_stopped(coroutines: dict[str, Coroutine[Any, Any, None]], stop: asyncio.Event) -> None:
    """Run named coroutines together until ``stop`` is set or one of them fails (its error is raised).
    One that simply returns (a one-off job, like recording a setting at start) ends alone; one
    cancelled from inside ends them all.

    All of them are cancelled and awaited before this returns (one that will not end within
    ``STOP_LOOPS_S`` is left, and said)."""
    tasks = [asyncio.create_task(coro, name=name) for name, coro in coroutines.items()]
    stopper = asyncio.create_task(stop.wait(), name="stop")
    tasks.append(stopper)
    try:
        pending = set(tasks)
        while stopper in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is stopper:
                    continue
                if task.cancelled():
                    return  # cancelled from inside: it died, and the others stop with it
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
    finally:
        left = await cancel_until_done(tasks, timeout_s=STOP_LOOPS_S)
        if left:
            log.warning("loops still running after being stopped", tasks=sorted(t.get_name() for t in left))
        for task in tasks:  # (their errors are retrieved: raised above, or of no interest once stopping)
            if task.done() and not task.cancelled():
                task.exception()


async def serve_until_signal(run: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``run(stop)``; SIGTERM and SIGINT set ``stop`` for a clean shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run(stop)
