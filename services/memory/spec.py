"""The memory broker, as a service: its pure decider (``decide.py``) and this spec are all of it;
the generic shell runs it. It owns memory leases only; GPUs stay the scheduler's, and agents
carry out what it decides."""

from gpuherd import events as ev
from gpuherd.runtime.serve import rules_recorder
from gpuherd.runtime.spec import BACKGROUND_NICE, TimerSpec, switched_decider
from services.memory.decide import MemoryDecider
from services.memory.state import MemoryState

TICK_S = 5.0  # while leases exist: expiries and revocation deadlines fire when due
# Leases are asked for and revoked on a scale of seconds: reading the log in batches up to 20 ms
# apart costs a lease decision at most that, and spares the host a wake-up for every job event.
READ_LINGER_S = 0.02


def _lending(state: MemoryState) -> bool:
    return bool(state.leases)


SPEC = switched_decider(
    MemoryDecider,
    "leases spare neighbor-GPU and host memory",
    TimerSpec(ev.MemoryTicked, TICK_S, needed=_lending),
    tasks=lambda args: [rules_recorder(ev.MemoryBrokerConfigured, lambda state: state.rules, ev.MEMORY_RULES)],
    read_linger_s=READ_LINGER_S,
    nice=BACKGROUND_NICE,
)
