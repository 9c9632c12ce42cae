"""What reaches a node agent from a job's own processes, or from the spec it runs, is checked
before it can stop anyone's work: a process the shim cannot start (a NUL byte in its arguments,
environment or working directory) is a failed launch, not a dead shim; a rescale or profile
report's numbers that the elastic service would divide by or fail to snapshot are not recorded."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog

from gpuherd import control
from gpuherd import events as ev
from services.elastic.state import ElasticState
from services.elastic.state import evolve as elastic_evolve
from services.nodeagent import taskfiles
from services.nodeagent.executors import TaskKey, TaskLaunch
from services.nodeagent.executors.cpu import CpuExecutor
from services.nodeagent.messages import JobMessages
from services.nodeagent.reconcile import AgentEvents
from services.nodeagent.shim import Shim
from services.nodeagent.state import AgentState, evolve, new_state
from services.nodeagent.taskfiles import ExitRecord, ProcLaunch, TaskDescription
from services.nodeagent.writer import AgentWriter
from tests.helpers import node

# -- the shim: any exception Popen raises is a launch failure ----------------------------------------


def run_shim(tmp_path: Path, proc: ProcLaunch, cwd: str | None = None) -> ExitRecord:
    alive = tmp_path / "alive"
    alive.touch()
    task = TaskDescription(procs=[proc], alive_file=str(alive), fence_after_s=30.0, kill_grace_s=1.0, cwd=cwd)
    (tmp_path / taskfiles.TASK_FILE).write_bytes(msgspec.json.encode(task))
    # The shim takes SIGTERM and SIGINT for its own (it is a process of its own): given back after,
    # or every later test's forked process inherits them (Ctrl-C then only sets the shim's flag).
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert Shim(tmp_path).run() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    record = taskfiles.read(tmp_path / taskfiles.EXIT_FILE, ExitRecord)
    assert record is not None, "the shim wrote its exit record"
    return record


@pytest.mark.parametrize(
    ("argv", "env", "cwd"),
    [
        (["true"], {"A": "a\0b"}, None),
        (["tr\0ue"], {}, None),
        (["true"], {}, "/tmp\0x"),
    ],
)
def test_a_process_popen_refuses_is_a_failed_launch_with_an_exit_record(
    tmp_path: Path, argv: list[str], env: dict[str, str], cwd: str | None
) -> None:
    log = tmp_path / "rank-0.log"
    record = run_shim(tmp_path, ProcLaunch(argv=argv, env=env, log=str(log)), cwd)
    failure = record.failure or ""
    assert failure.startswith("local rank 0: cannot start") and "ValueError: embedded null byte" in failure
    assert record.failed_rank == 0 and record.codes == [] and record.stopped is None
    assert "embedded null byte" in log.read_text(), "the rank's log says why, for the output tail"


def test_a_process_that_starts_is_run_as_before(tmp_path: Path) -> None:
    record = run_shim(tmp_path, ProcLaunch(argv=["true"], env={"A": "b"}, log=str(tmp_path / "rank-0.log")))
    assert record.failure is None and record.codes == [0]


async def test_the_executor_reports_such_a_task_failed_so_the_job_is_not_requeued(tmp_path: Path) -> None:
    """Before, the shim died on ``ValueError``, the executor found no exit record and reported the
    task ``stopped``, and the scheduler requeued the job at every attempt."""
    alive = tmp_path / "alive"
    alive.touch()
    executor = CpuExecutor(tmp_path, gpus=1, island=0, alive_file=alive, fence_after_s=30.0, kill_grace_s=1.0)
    executor.node = "n1"
    spec = ev.JobSpec(name="t", user="u", gpus=1, command=(sys.executable, "-c", "pass"), env={"A": "a\0b"})
    try:
        await executor.start(TaskLaunch(key=TaskKey("j1", 0), spec=spec, gpus=(0,)))
        ended = await asyncio.wait_for(executor.exits.get(), 30)
    finally:
        await executor.shutdown()
    assert ended.outcome == "failed", ended
    assert "ValueError: embedded null byte" in ended.reason and "embedded null byte" in ended.output_tail


# -- what a job's processes report: the rescale and profile numbers the log records -----------------


class _Recording(AgentWriter):
    """The agent's writer, keeping what it would append."""

    def __init__(self) -> None:
        super().__init__(None, AgentEvents("n1"), clock=lambda: 100.0)  # type: ignore[arg-type]
        self.appended: list[ev.Event] = []

    def append_soon(self, event: ev.Event) -> None:
        self.appended.append(event)


class _Running:
    """An executor that runs attempt 0 of job j and holds ``profile`` as its profile file."""

    def __init__(self, profile: bytes = b"") -> None:
        self.profile = profile

    def running(self) -> set[TaskKey]:
        return {TaskKey("j", 0)}

    def profile_result(self, key: TaskKey, name: str) -> bytes:
        return self.profile


ELASTIC_SPEC = ev.JobSpec(name="e", user="u", gpus=2, command=("python", "x.py"), elastic=ev.Elastic(min=1, max=4))
HISTORY: list[ev.Event] = [
    node("n1", 4, executor="cpu", ports=(29500, 29599)),
    ev.JobSubmitted(id="s", source="t", job="j", spec=ELASTIC_SPEC, intake_source="t"),
    ev.JobPlaced(
        id="p",
        source="scheduler",
        job="j",
        attempt=0,
        allocations=(ev.Allocation("n1", (0, 1)),),
        rendezvous=ev.Rendezvous("n1.local", 29500),
    ),
    ev.JobStarted(id="st", source="agent.n1", job="j", attempt=0, node="n1"),
]


def agent_state() -> AgentState:
    state = new_state("n1")
    for seq, event in enumerate(HISTORY, 1):
        evolve(state, seq, event)
    return state


def recorded(message: control.AgentMessage, profile: bytes = b"") -> list[ev.Event]:
    state = agent_state()
    writer = _Recording()
    messages = JobMessages("n1", lambda: state, _Running(profile), writer, None)  # type: ignore[arg-type]
    messages.on_message(message)
    return writer.appended


def rescaled(**fields: Any) -> control.RescaleReport:
    return control.RescaleReport(job="j", attempt=0, event="completed", generation=0, **({"world": 2} | fields))


def elastic_state(events: list[ev.Event]) -> ElasticState:
    """What the elastic service folds of them; its snapshot encodes (a world of 1e23 raised OverflowError)."""
    state = ElasticState()
    for seq, event in enumerate([*HISTORY, *events], 1):
        elastic_evolve(state, seq, event, params_ok=True)
    msgspec.msgpack.encode(state)
    return state


@pytest.mark.parametrize("rate", [0.0, -3.0])
def test_a_rescale_throughput_that_is_not_above_zero_is_not_recorded(rate: float) -> None:
    with structlog.testing.capture_logs() as logs:
        (event,) = recorded(rescaled(world_before=2, samples_per_s_before=rate))
    assert isinstance(event, ev.RescaleCompleted) and event.world == 2 and event.world_before == 2
    assert event.samples_per_s_before is None, "the completion is kept (it gives GPUs back), the number is not"
    assert any(entry["log_level"] == "warning" and "throughput" in entry["event"] for entry in logs)


@pytest.mark.parametrize(("world", "before"), [(10**23, 2), (2, 10**23), (0, 2), (-1, 2), (2, -1), (2**31 + 1, 1)])
def test_a_rescale_report_with_impossible_worlds_takes_the_agents_count(world: int, before: int) -> None:
    with structlog.testing.capture_logs() as logs:
        (event,) = recorded(rescaled(world=world, world_before=before, samples_per_s_before=5.0))
    assert isinstance(event, ev.RescaleCompleted)
    assert (event.world, event.world_before, event.samples_per_s_before) == (2, 2, None)
    assert any(entry["log_level"] == "warning" for entry in logs)
    assert elastic_state([event]).throughput.get("j", {}) == {}


def test_a_rescale_report_within_bounds_is_recorded_as_sent() -> None:
    (event,) = recorded(rescaled(world=2**31, world_before=0, samples_per_s_before=1e-3))
    assert isinstance(event, ev.RescaleCompleted)
    assert (event.world, event.world_before, event.samples_per_s_before) == (2**31, 0, 1e-3)


def test_a_rescale_report_with_impossible_worlds_for_a_job_unknown_here_is_dropped() -> None:
    message = control.RescaleReport(job="other", attempt=0, event="completed", generation=0, world=10**23)
    with structlog.testing.capture_logs() as logs:
        assert recorded(message) == []
    assert any(entry["log_level"] == "warning" for entry in logs)


def profile_ready() -> control.ProfileReady:
    return control.ProfileReady(job="j", attempt=0, rank=0, request="r", file="profile-0.json")


def profile(**fields: Any) -> bytes:
    layers = [{"name": "fc", "grad_bytes": 4096}, {"name": "relu"}]
    return msgspec.json.encode({"batch_size": 32, "step_s": 0.05, "layers": layers} | fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"step_s": 0},
        {"step_s": -0.1},
        {"step_s": "inf"},
        {"step_s": "nan"},
        {"step_s": True},
        {"step_s": 10**400},
        {"batch_size": 0},
        {"batch_size": 1.5},
        {"batch_size": 2**70},
        {"step_s": 5e-324, "batch_size": 1000},
        {"layers": [{"grad_bytes": -1}]},
        {"layers": [{"grad_bytes": 10**23}]},
        {"layers": [{"grad_bytes": 2**63}, {"grad_bytes": 2**63}]},
        {"layers": [{"grad_bytes": "many"}]},
    ],
)
def test_a_profile_the_elastic_service_could_not_model_by_is_dropped(fields: dict[str, Any]) -> None:
    with structlog.testing.capture_logs() as logs:
        assert recorded(profile_ready(), profile(**fields)) == []
    assert any(entry["log_level"] == "warning" and "profile" in entry["event"] for entry in logs)


def test_a_sound_profile_is_recorded_and_modelled() -> None:
    (event,) = recorded(profile_ready(), profile())
    assert isinstance(event, ev.ProfileReported) and event.profile["step_s"] == 0.05
    model = elastic_state([event]).models["j"]
    assert model.compute_per_sample_s == 0.05 / 32 and model.grad_bytes == 4096


# -- a logs reply fits the connection's max_payload -------------------------------------------------


class _ManyRanks:
    """An executor whose task has ``ranks`` logs of ``size`` bytes each, and one short one."""

    def __init__(self, ranks: int = 200, size: int = 65536) -> None:
        self.ranks, self.size = ranks, size

    def attempts(self, job: str) -> list[int]:
        return [0]

    def output(self, key: TaskKey, max_bytes: int) -> dict[str, str]:
        logs = {f"rank-{r}.log": f"{r}:" + "x" * min(max_bytes, self.size) for r in range(self.ranks)}
        return logs | {"worker-0.log": "short\n"}


async def serve_logs(executor: Any, max_reply_bytes: int, request: dict[str, Any] | None = None) -> dict[str, Any]:
    from types import SimpleNamespace

    from services.nodeagent.agent import Agent

    agent = SimpleNamespace(executor=executor, node="n1")
    data = msgspec.json.encode(request or {"job": "j1"})
    reply = await Agent._serve_logs(agent, data, max_reply_bytes=max_reply_bytes)  # type: ignore[arg-type]
    assert len(reply) <= max_reply_bytes
    return msgspec.json.decode(reply)


async def test_a_logs_reply_over_the_limit_is_cut_from_the_front_and_says_so() -> None:
    """200 ranks of 64 KiB each: 13 MB, where NATS takes 1 MiB; the asker saw "no answer within 5s"."""
    answer = await serve_logs(_ManyRanks(), 1024 * 1024)
    assert answer["ok"] is True and "cut from the front" in answer["truncated"]
    files = answer["attempts"]["0"]
    assert len(files) == 201 and files["worker-0.log"] == "short\n", "a short output is kept whole"
    for rank in range(200):
        text = files[f"rank-{rank}.log"]
        assert text.startswith("[gpuherd: the start of this output was cut"), text[:80]
        assert text.endswith("x" * 1000) and len(text) > 4000, "each keeps its end, an equal share"


async def test_a_logs_reply_within_the_limit_is_as_before() -> None:
    answer = await serve_logs(_ManyRanks(ranks=3, size=100), 1024 * 1024)
    assert answer == {"ok": True, "node": "n1", "attempts": {"0": _ManyRanks(3, 100).output(TaskKey("j1", 0), 65536)}}


async def test_a_file_is_never_read_beyond_what_the_reply_holds() -> None:
    executor = _ManyRanks(ranks=1, size=10**9)
    answer = await serve_logs(executor, 4096, {"job": "j1", "max_bytes": 10**9})
    assert answer["ok"] and len(answer["attempts"]["0"]["rank-0.log"]) < 4096


@pytest.mark.parametrize("text", ["\0\x01" * 5000, "é✓" * 5000, "\U0001f600" * 5000])
def test_a_cut_counts_the_bytes_json_takes_not_the_characters(text: str) -> None:
    from services.nodeagent.agent import logs_reply

    reply = logs_reply("n1", {"0": {"a.log": text, "b.log": text}}, 2000)
    assert len(reply) <= 2000
    files = msgspec.json.decode(reply)["attempts"]["0"]
    assert all(body.endswith(text[-10:]) for body in files.values())


def test_too_many_files_for_even_their_names_is_an_error_answer() -> None:
    from services.nodeagent.agent import logs_reply

    attempts = {"0": {f"rank-{r}.log": "x" for r in range(1000)}}
    answer = msgspec.json.decode(logs_reply("n1", attempts, 2000))
    assert answer["ok"] is False and "do not fit the reply's limit of 2000 bytes" in answer["error"]


def test_the_reply_limit_is_the_connections_max_payload() -> None:
    from types import SimpleNamespace

    from services.nodeagent.agent import DEFAULT_MAX_REPLY_BYTES, reply_limit

    assert reply_limit(SimpleNamespace(nc=SimpleNamespace(max_payload=8 * 1024 * 1024))) == 8 * 1024 * 1024
    assert reply_limit(object()) == DEFAULT_MAX_REPLY_BYTES == 1024 * 1024
