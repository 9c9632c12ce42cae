"""The memory broker, as a service: its pure decider (``decide.py``) and this spec are all of it;
the generic shell runs it. It owns memory leases only; GPUs stay the scheduler's, and agents
carry out what it decides."""

import time
import uuid
from collections.abc import Awaitable

from gpuherd import events as ev
from gpuherd.runtime.decider import params_problem
from gpuherd.runtime.runner import DeciderRunner
from gpuherd.runtime.spec import BACKGROUND_NICE, TimerSpec, switched_decider
from services.memory.decide import MemoryDecider
from services.memory.state import MemoryState

TICK_S = 5.0  # while leases exist: expiries and revocation deadlines fire when due
# Leases are asked for and revoked on a scale of seconds: reading the log in batches up to 20 ms
# apart costs a lease decision at most that, and spares the host a wake-up for every job event.
READ_LINGER_S = 0.02


def _lending(state: MemoryState) -> bool:
    return bool(state.leases)


def rules_recorder(runner: DeciderRunner[MemoryState]) -> Awaitable[None]:
    """Once caught up, record this broker's rules in the log unless it has them (its parameters
    stay): every later lease decision is then audited by the rules it was made by, and a log with
    none recorded reads as the first rules."""

    async def record() -> None:
        await runner.caught_up.wait()
        state = runner.state
        if state.rules == ev.MEMORY_RULES:
            return
        params = dict(state.params or {})
        # Parameters of a command recorded unchecked that do not convert meant the defaults then;
        # recorded again they would be refused, and the rules with them.
        decider: MemoryDecider = runner.decider  # type: ignore[assignment]
        if params_problem(params, decider.convert_params) is not None:
            params = {}
        event = ev.MemoryBrokerConfigured(
            id=f"memory:rules:{uuid.uuid4().hex}", at=time.time(), source="memory", params=params
        )
        await runner.append_input([event])  # fenced, as its decisions

    return record()


SPEC = switched_decider(
    MemoryDecider,
    "leases spare neighbor-GPU and host memory",
    TimerSpec(ev.MemoryTicked, TICK_S, needed=_lending),
    tasks=lambda args: [rules_recorder],
    read_linger_s=READ_LINGER_S,
    nice=BACKGROUND_NICE,
)
