"""Intake rules 10: numbers a service divides by or adds up are bounded where they enter (a job's
declared ``scaling``, its ``duration_s``). Before, intake accepted ``compute_per_sample_s`` 0 and
the elastic service divided by it at every tick, in a crash loop. Verdicts of older rules are
re-judged by those rules, so the audit finds nothing new in an old log."""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec
import pytest

from gpuherd import events as ev
from services.scheduler.decide import SchedulerDecider
from services.scheduler.intake import Submission, judge, recheck
from services.scheduler.state import SchedulerState
from tests.helpers import node

_scheduler = SchedulerDecider()

ELASTIC = {
    "name": "e",
    "user": "u",
    "gpus": 1,
    "command": ["python", "x.py"],
    "elastic": {"min": 1, "max": 4},
}
SIM = {"name": "s", "user": "u", "gpus": 1, "duration_s": 60.0}


def cluster() -> SchedulerState:
    state = _scheduler.initial_state()
    for seq, e in enumerate([node("n1", 4, executor="cpu", ports=(29500, 29599)), node("n2", 4)], 1):
        _scheduler.evolve(state, seq, e)
    return state


def judged(spec: dict[str, Any], state: SchedulerState | None = None) -> ev.JobSubmitted | ev.JobRejected:
    data = msgspec.json.encode(spec)
    return judge(state or cluster(), Submission(source="cli", seq=1, data=data, at=1.0)).event


def accepted(spec: ev.JobSpec, rules: int) -> ev.JobSubmitted:
    """A verdict as the log would hold it, for the audit to re-judge (JSON cannot carry inf or NaN,
    so a spec holding them is made here, as a client in Python could)."""
    spec = msgspec.structs.replace(spec, intake_id="x")
    return ev.JobSubmitted(id="s", at=1.0, job="j1", spec=spec, intake_source="cli", intake_rules=rules)


@pytest.mark.parametrize("per_sample", [0, -0.5])
def test_a_scaling_without_a_positive_compute_time_is_refused(per_sample: float) -> None:
    verdict = judged(ELASTIC | {"scaling": {"compute_per_sample_s": per_sample, "grad_bytes": 0}})
    assert isinstance(verdict, ev.JobRejected)
    assert verdict.reason.startswith("`scaling.compute_per_sample_s` must be a positive, finite number"), verdict
    assert verdict.intake_rules == ev.INTAKE_RULES >= 10
    assert recheck(cluster(), verdict) is None, "the audit re-judges it the same"


@pytest.mark.parametrize("grad_bytes", [-1, 2**64])
def test_gradient_bytes_outside_64_bits_unsigned_are_refused(grad_bytes: int) -> None:
    verdict = judged(ELASTIC | {"scaling": {"compute_per_sample_s": 0.01, "grad_bytes": grad_bytes}})
    assert isinstance(verdict, ev.JobRejected)
    assert verdict.reason == f"`scaling.grad_bytes` must lie within 0..2**64-1, got {grad_bytes}"


@pytest.mark.parametrize("per_sample", [math.inf, math.nan])
def test_a_non_finite_compute_time_is_refused(per_sample: float) -> None:
    spec = ev.JobSpec(**SIM, scaling=ev.Scaling(compute_per_sample_s=per_sample, grad_bytes=0))
    problem = recheck(cluster(), accepted(spec, rules=10)) or ""
    assert "`scaling.compute_per_sample_s` must be a positive, finite number" in problem


def test_a_non_finite_duration_is_refused() -> None:
    spec = ev.JobSpec(**(SIM | {"duration_s": math.inf}))
    problem = recheck(cluster(), accepted(spec, rules=10)) or ""
    assert "`duration_s` must be a finite number of seconds, got inf" in problem


def test_a_declared_scaling_the_services_can_use_is_accepted() -> None:
    verdict = judged(ELASTIC | {"scaling": {"compute_per_sample_s": 0.002, "grad_bytes": 2**64 - 1}})
    assert isinstance(verdict, ev.JobSubmitted), verdict
    assert isinstance(judged(SIM | {"scaling": {"compute_per_sample_s": 1e-9, "grad_bytes": 0}}), ev.JobSubmitted)


def test_a_job_accepted_by_rules_9_is_re_judged_by_them() -> None:
    """An old log may hold a job rules 9 accepted with a zero compute time: the audit does not
    report it (it was right by its rules); a verdict by rules 10 on the same spec would be wrong."""
    spec = ev.JobSpec(**SIM, scaling=ev.Scaling(compute_per_sample_s=0.0, grad_bytes=0))
    assert recheck(cluster(), accepted(spec, rules=9)) is None
    assert recheck(cluster(), accepted(msgspec.structs.replace(spec, duration_s=math.inf), rules=9)) is None
    assert "would now be rejected" in (recheck(cluster(), accepted(spec, rules=10)) or "")


def test_the_live_decider_answers_an_elastic_job_with_a_zero_compute_time_with_the_reason() -> None:
    """What the reviewer saw: the job was accepted and the elastic service divided by zero."""
    data = msgspec.json.encode(ELASTIC | {"scaling": {"compute_per_sample_s": 0, "grad_bytes": 0}})
    answer = _scheduler.take(cluster(), Submission(source="cli", seq=1, data=data, at=1.0))
    reply = msgspec.json.decode(answer.reply)
    assert reply["ok"] is False and "compute_per_sample_s" in reply["error"]
    assert [type(e) for e in answer.events] == [ev.JobRejected]


# -- NUL bytes: no process can be started with one ------------------------------------------------

CMD = {"name": "t", "user": "u", "gpus": 1, "command": ["python", "x.py"]}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (CMD | {"env": {"A": "a\0b"}}, "env.A"),
        (CMD | {"command": ["python", "x.py", "--flag\0"]}, "command[2]"),
        (CMD | {"workdir": "/tmp\0x"}, "workdir"),
        (CMD | {"array": {"values": ["ok", "b\0d"]}}, "array.values[1]"),
    ],
)
def test_a_nul_byte_where_a_process_takes_it_is_refused(spec: dict[str, Any], field: str) -> None:
    verdict = judged(spec)
    assert isinstance(verdict, ev.JobRejected)
    assert verdict.reason.startswith(f"`{field}` holds a NUL byte"), verdict.reason
    assert recheck(cluster(), verdict) is None


def test_a_nul_byte_in_an_env_name_is_refused() -> None:
    verdict = judged(CMD | {"env": {"A\0B": "x"}})
    assert isinstance(verdict, ev.JobRejected) and "`env` names must be identifiers" in verdict.reason


def test_a_nul_byte_in_a_workflow_step_is_refused_for_that_step() -> None:
    workflow = {"workflow": "w", "steps": [CMD | {"name": "a"}, CMD | {"name": "b", "env": {"X": "\0"}}]}
    verdict = judged(workflow)
    assert isinstance(verdict, ev.JobRejected)
    assert verdict.reason.startswith("step b: `env.X` holds a NUL byte"), verdict.reason


def test_a_job_accepted_with_a_nul_byte_by_rules_9_is_re_judged_by_them() -> None:
    spec = ev.JobSpec(**(CMD | {"command": ("python", "x.py"), "env": {"A": "a\0b"}}))
    assert recheck(cluster(), accepted(spec, rules=9)) is None
    assert "`env.A` holds a NUL byte" in (recheck(cluster(), accepted(spec, rules=10)) or "")


def test_the_live_decider_refuses_what_was_requeued_forever() -> None:
    """What the reviewer saw: accepted, then each attempt's shim died on Popen's ValueError."""
    data = b'{"name":"t","user":"u","gpus":1,"command":["python","x.py"],"env":{"A":"a\\u0000b"}}'
    answer = _scheduler.take(cluster(), Submission(source="cli", seq=1, data=data, at=1.0))
    assert [type(e) for e in answer.events] == [ev.JobRejected]
    assert "NUL byte" in msgspec.json.decode(answer.reply)["error"]


# -- the client's side: numbers JSON cannot carry never leave it ----------------------------------


class _NothingSent:
    """A NATS connection that fails the test if the client sends anything."""

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the client subscribed for a verdict: it was about to send")

    async def publish(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the client sent a submission with a number JSON cannot carry")


def test_a_yaml_job_file_with_an_infinite_time_limit_is_refused_by_name(tmp_path) -> None:
    """msgspec writes inf as ``null``, which intake took for a limit left out (the VC's default)."""
    from gpuherd.client import load_spec_file
    from gpuherd.errors import SubmissionError

    path = tmp_path / "job.yaml"
    path.write_text("name: t\nuser: u\ngpus: 1\ncommand: [python, x.py]\ntime_limit_s: .inf\n")
    with pytest.raises(SubmissionError, match=r"job\.yaml: `time_limit_s` is inf"):
        load_spec_file(path)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (SIM | {"time_limit_s": math.inf}, "time_limit_s"),
        (SIM | {"duration_s": math.nan}, "duration_s"),
        (SIM | {"scaling": {"compute_per_sample_s": -math.inf, "grad_bytes": 0}}, "scaling.compute_per_sample_s"),
        (
            {"workflow": "w", "steps": [SIM | {"name": "a"}, SIM | {"name": "b", "duration_s": math.inf}]},
            "steps[1].duration_s",
        ),
        (SIM | {"array": {"values": [1.5, math.nan]}}, "array.values[1]"),
    ],
)
async def test_a_submission_with_a_non_finite_number_is_refused_before_it_is_sent(
    spec: dict[str, Any], field: str
) -> None:
    from gpuherd.client import Client
    from gpuherd.errors import SubmissionError

    client = Client(nc=_NothingSent())
    with pytest.raises(SubmissionError, match=f"^`{re.escape(field)}` is "):
        await client.submit_verdict(spec)
