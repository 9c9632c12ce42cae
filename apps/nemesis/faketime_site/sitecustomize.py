"""Loaded (through PYTHONPATH) only into the nemesis' processes that run under libfaketime.

libfaketime 0.9.10 (Debian 12) with FAKETIME_DONT_FAKE_MONOTONIC=1 makes clock_nanosleep on the
monotonic clock fail with EINVAL, which breaks ``time.sleep``. The wall clock is what the clock
fault skews; a sleep only needs to last as long, which ``select`` does without that call.
"""

import select
import time


def _sleep(seconds: float, _select=select.select) -> None:
    if seconds > 0:
        _select([], [], [], seconds)


time.sleep = _sleep
