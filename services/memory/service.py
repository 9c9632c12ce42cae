"""The live memory broker: the memory decider on the log, with a clock tick so that lease
expiries and revocation deadlines fire when due even when nothing else happens. It owns memory
leases only; GPUs stay the scheduler's, and agents carry out what it decides."""

from __future__ import annotations

from gpuherd import events as ev
from gpuherd.decider import decider_service_main
from services.memory.decide import MemoryDecider
from services.memory.policy import params_from


def main(argv: list[str] | None = None) -> None:
    decider_service_main(
        argv,
        MemoryDecider(),
        description="gpuherd neighbor-GPU memory broker",
        configured=ev.MemoryBrokerConfigured,
        convert=params_from,
        example='{"lease_term_s": 300}',
        tick_s=5.0,
    )
