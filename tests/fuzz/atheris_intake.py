"""Coverage-guided fuzzing (atheris/libFuzzer) of what comes from outside: intake payloads judged by
the scheduler, and stored bytes decoded as events. Run directly for as long as you like:

    python tests/fuzz/atheris_intake.py -runs=1000000 -dict=tests/fuzz/intake.dict corpus/ tests/fuzz/seeds/

``tests/fuzz/test_atheris.py`` runs it briefly in ``make test-long`` when atheris is installed.
"""

from __future__ import annotations

import contextlib
import sys

import atheris

with atheris.instrument_imports():
    from gpuherd import events as ev
    from gpuherd.errors import EventDecodeError
    from services.scheduler.decide import SchedulerDecider
    from services.scheduler.intake import Submission, judge, node_sizes, submission_key

# The scheduler's own state (intake looks up intake ids and VCs in it), of two nodes and a VC.
_DECIDER = SchedulerDecider()
STATE = _DECIDER.initial_state()
for _seq, _event in enumerate(
    [
        *(
            ev.NodeRegistered(
                id=f"r{name}",
                node=name,
                gpus=tuple(ev.GpuInfo(index=i, uuid=f"{name}-u{i}", model="SIM", memory_mb=81920) for i in range(8)),
                executor="sim",
            )
            for name in ("n1", "n2")
        ),
        ev.VcConfigured(id="vc", vc="vision"),
    ],
    1,
):
    STATE = _DECIDER.evolve(STATE, _seq, _event)
SIZES = node_sizes(STATE)


def one_input(data: bytes) -> None:
    sub = Submission(source="fuzz", seq=1, data=data, at=1.0, msg_id=None)
    submission_key(sub)  # (the runtime asks for it before judging: it must not raise either)
    verdict = judge(STATE, sub, sizes=SIZES)
    if not isinstance(verdict.event, ev.JobSubmitted | ev.JobRejected):
        raise AssertionError(f"intake answered {verdict.event!r}")
    if isinstance(verdict.event, ev.JobRejected) and not verdict.event.reason:
        raise AssertionError("a rejection without a reason")
    with contextlib.suppress(EventDecodeError):
        ev.decode(data)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
