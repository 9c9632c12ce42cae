"""Request-reply over a real nats-server: an answer over the server's max_payload. A job's logs of
200 ranks were 13 MB against NATS's 1 MiB; the publish failed inside the request handler, nothing
answered, and the user saw "no answer within 5s"."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import msgspec

from gpuherd.log import open_log
from gpuherd.output import fetch_output
from services.nodeagent.agent import Agent, reply_limit
from services.nodeagent.executors import TaskKey


class _ManyRanks:
    def attempts(self, job: str) -> list[int]:
        return [0]

    def output(self, key: TaskKey, max_bytes: int) -> dict[str, str]:
        return {f"rank-{r}.log": "x" * min(max_bytes, 65536) for r in range(200)}


async def test_a_logs_reply_of_many_ranks_is_cut_to_fit_and_answered(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="logs-reply", persistent=False)
    node = f"n{uuid.uuid4().hex[:8]}"
    agent = SimpleNamespace(executor=_ManyRanks(), node=node)
    # (as Agent.run serves it)
    stop = await log_.serve_requests(
        f"{node}.logs",
        lambda data: Agent._serve_logs(agent, data, max_reply_bytes=reply_limit(log_)),  # type: ignore[arg-type]
    )
    try:
        (answer,) = await fetch_output(log_, "j1", [(0, [node])])
    finally:
        await stop()
        await log_.close()
    assert answer["ok"] is True, answer.get("error")
    assert "cut from the front" in answer["truncated"]
    assert len(answer["attempts"]["0"]) == 200


async def test_an_answer_the_server_cannot_carry_is_an_error_answer_not_a_timeout(nats_url: str) -> None:
    log_ = await open_log(nats_url, name="big-answer", persistent=False)
    subject = f"big.{uuid.uuid4().hex[:8]}"
    limit = log_.nc.max_payload

    async def too_big(data: bytes) -> bytes:
        return b"x" * (limit + 1)

    stop = await log_.serve_requests(subject, too_big)
    try:
        answer = msgspec.json.decode(await log_.request(subject, b"{}", timeout=5))
    finally:
        await stop()
        await log_.close()
    assert answer == {
        "ok": False,
        "error": f"the answer is {limit + 1} bytes, over the NATS server's limit of {limit} bytes",
    }
