"""A node agent told to stop stops at once, whatever it waits for as it starts: taking its node
(each try waits for NATS up to a request timeout) and loading its snapshot (retried for 60 s) ran
outside of anything that listened for the stop."""

from __future__ import annotations

import asyncio

import pytest

from gpuherd.log import InProcessLog, Leadership
from services.nodeagent.agent import Agent
from services.nodeagent.executors.sim import SimExecutor

pytestmark = pytest.mark.timeout(30)

STOPS_WITHIN_S = 1.0


async def never_answered(asked: asyncio.Event) -> None:
    asked.set()
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


class UnansweredLeadership(InProcessLog):
    """NATS stops answering as the agent asks for its node (the question waits for ever)."""

    def __init__(self) -> None:
        super().__init__(duplicate_window=0)
        self.asked = asyncio.Event()

    def leadership(self, name: str, holder: str) -> Leadership:
        lead = super().leadership(name, holder)

        async def try_acquire() -> bool:
            await never_answered(self.asked)
            return False

        lead.try_acquire = try_acquire  # type: ignore[method-assign]
        return lead


class UnansweredSnapshot(InProcessLog):
    """NATS stops answering once the agent holds its node (its snapshot's read waits for ever)."""

    def __init__(self) -> None:
        super().__init__(duplicate_window=0)
        self.asked = asyncio.Event()

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        await never_answered(self.asked)
        return None


@pytest.mark.parametrize("log_of", [UnansweredLeadership, UnansweredSnapshot])
async def test_an_agent_stopped_as_it_starts_returns_at_once(log_of: type[UnansweredLeadership]) -> None:
    log = log_of()
    agent = Agent(log, "n1", SimExecutor(gpus=2))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await asyncio.wait_for(log.asked.wait(), 5)
        stop.set()
        await asyncio.wait_for(asyncio.shield(task), STOPS_WITHIN_S)
        assert not agent.caught_up.is_set()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
