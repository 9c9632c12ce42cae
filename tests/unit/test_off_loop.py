"""``off_loop``: a blocking call in a thread that does not hold its process past its end."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from gpuherd.aio import off_loop


async def test_the_result_and_the_error_of_the_call_reach_the_awaiting_task() -> None:
    assert await off_loop(lambda: 41 + 1, name="answer") == 42

    def fail() -> None:
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        await off_loop(fail, name="fail")


def test_a_process_ends_while_a_call_off_its_loop_still_blocks() -> None:
    """What ``asyncio.to_thread`` cannot: asyncio.run joins its threads, so a call blocked for 20 s
    (a wait for killed processes, a hung driver) held the stopping process that long."""
    script = textwrap.dedent(
        """
        import asyncio, time
        from gpuherd.aio import off_loop

        async def main():
            try:
                await asyncio.wait_for(off_loop(lambda: time.sleep(20), name="blocked"), 0.2)
            except TimeoutError:
                pass

        asyncio.run(main())
        """
    )
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=15)
    assert time.monotonic() - started < 10, "the process waited for the blocked call"
