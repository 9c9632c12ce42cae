"""How far a background process (a decider no decision waits on, the dashboard) yields the CPU, and
how long its reader lets events gather, from its spec unless the command line says otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from apps import registry
from gpuherd.runtime import shell


def test_background_deciders_yield_the_cpu_and_read_in_batches_the_scheduler_does_neither() -> None:
    for name in ("elastic", "memory"):
        args = shell.build_parser(registry.spec(name)).parse_args([])
        assert args.nice > 0 and args.read_linger_ms > 0, name
    analytics = shell.build_parser(registry.spec("analytics")).parse_args([])
    assert analytics.nice > 0 and analytics.read_linger_ms == 0, "predictions re-rank a QSSF queue: read at once"
    scheduler = shell.build_parser(registry.spec("scheduler")).parse_args([])
    assert scheduler.nice == 0 and scheduler.read_linger_ms == 0, "decisions wait on the scheduler"
    given = shell.build_parser(registry.spec("elastic")).parse_args(["--nice", "0", "--read-linger-ms", "0"])
    assert given.nice == 0 and given.read_linger_ms == 0


def test_the_dashboard_yields_the_cpu_and_reads_in_batches_as_its_spec_says() -> None:
    spec = registry.spec("dashboard")
    args = shell.build_parser(spec).parse_args([])
    assert args.nice == spec.nice > 0 and args.read_linger_ms == spec.read_linger_s * 1000 > 0
    given = shell.build_parser(spec).parse_args(["--nice", "0", "--read-linger-ms", "0"])
    assert given.nice == 0 and given.read_linger_ms == 0


def test_yielding_the_cpu_lowers_the_process_priority_by_the_increment() -> None:
    code = (
        "import os; from gpuherd.service_args import yield_cpu; "
        "yield_cpu('t', 3); print(os.getpriority(os.PRIO_PROCESS, 0))"
    )
    before = os.getpriority(os.PRIO_PROCESS, 0)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) == min(before + 3, 19)
