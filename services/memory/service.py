"""The live memory broker: the memory decider on the log, with a clock tick so that lease
expiries and revocation deadlines fire when due even when nothing else happens. It owns memory
leases only; GPUs stay the scheduler's, and agents carry out what it decides."""

from __future__ import annotations

import argparse

from gpuherd import events as ev
from gpuherd.decider import decider_service_main, decider_service_parser
from services.memory.decide import MemoryDecider
from services.memory.policy import params_from

DESCRIPTION = "gpuherd neighbor-GPU memory broker"
EXAMPLE = '{"lease_term_s": 300}'
TICK_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    return decider_service_parser("memory", description=DESCRIPTION, example=EXAMPLE, tick_s=TICK_S)


def main(argv: list[str] | None = None) -> None:
    decider_service_main(
        argv,
        MemoryDecider(),
        description=DESCRIPTION,
        configured=ev.MemoryBrokerConfigured,
        convert=params_from,
        example=EXAMPLE,
        tick_s=TICK_S,
    )
