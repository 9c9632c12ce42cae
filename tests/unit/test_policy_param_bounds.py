"""A policy command's parameters are finite and within their ranges, checked where the command is
applied and by the CLI before it is sent; a policy the log holds that cannot be built never stops
the scheduler."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from apps.cli import config as cli_config
from gpuherd import events as ev
from gpuherd.errors import GpuherdError
from services.scheduler.decide import SchedulerDecider
from services.scheduler.policy import MAX_LAS_QUEUES, POLICIES, check_policy
from services.scheduler.state import CLUSTER_PARAMS
from tests.helpers import node, submit
from tests.unit.test_scheduler_decider import decider, decisions, drive, folded


@pytest.mark.parametrize("queues", [1e12, float(MAX_LAS_QUEUES + 1), math.inf, math.nan, -1.0])
def test_las_refuses_a_number_of_queues_out_of_range(queues: float) -> None:
    problem = check_policy("las", {"queues": queues})
    assert problem is not None and "queues" in problem


@pytest.mark.parametrize("queues", [1.0, 3.0, float(MAX_LAS_QUEUES)])
def test_las_takes_a_number_of_queues_in_range(queues: float) -> None:
    assert check_policy("las", {"queues": queues}) is None


@pytest.mark.parametrize(
    ("policy", "param"),
    [(name, param) for name, cls in POLICIES.items() for param in cls.PARAMS]
    + [("fifo", param) for param in CLUSTER_PARAMS],
)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_every_parameter_must_be_finite(policy: str, param: str, value: float) -> None:
    problem = check_policy(policy, {param: value})
    assert problem is not None and "finite" in problem and param in problem


def test_a_las_command_with_too_many_queues_is_refused_and_scheduling_goes_on() -> None:
    started = time.monotonic()
    log = drive([node("n1", 2), ev.PolicyConfigured(id="p", policy="las", params={"queues": 1e12}), submit("a")])
    assert time.monotonic() - started < 5.0  # (it built 1e12 queue bounds: it never ended)
    (refusal,) = decisions(log, ev.CommandRefused)
    assert refusal.command_id == "p" and "queues" in refusal.reason
    assert folded(log).scheduling.policy is None  # the policy before it stays in force
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a"]


@pytest.mark.parametrize("queues", [1e12, math.inf])
def test_a_policy_in_the_log_that_cannot_be_built_falls_back_to_the_default_with_a_warning(queues: float) -> None:
    # Recorded unchecked (before commands were checked) it is applied as it was; building it raised
    # OverflowError (inf) or never ended (1e12) at every pass.
    recorded = ev.PolicyConfigured(id="p", policy="las", params={"queues": queues}, unchecked=True)
    state = folded(drive([node("n1", 2), recorded]))
    assert state.scheduling.policy == "las"
    decider = SchedulerDecider()
    with capture_logs() as logs:
        assert decider.policy_for(state) is decider.policy
    assert [entry["log_level"] for entry in logs] == ["warning"] and logs[0]["policy"] == "las"
    assert [p.job for p in decisions(drive([recorded, node("n1", 2), submit("a")]), ev.JobPlaced)] == ["a"]


@pytest.mark.parametrize("rules", [2**64, -(2**63) - 1, 999, ev.SCHEDULING_RULES + 1, 0, -1])
def test_a_policy_command_naming_rules_this_scheduler_does_not_know_is_refused(rules: int) -> None:
    # As read from the log: applied, 2**64 made every snapshot raise OverflowError (the process died).
    raw = b'{"type":"PolicyConfigured","id":"p","v":3,"policy":"fifo","rules":%d}' % rules
    log = drive([node("n1", 2), ev.decode(raw), submit("a")])
    (refusal,) = decisions(log, ev.CommandRefused)
    assert refusal.command_id == "p" and "rules" in refusal.reason
    state = folded(log)
    assert state.scheduling.rules == ev.SCHEDULING_RULES and state.scheduling.policy is None
    assert decider.decode_state(decider.encode_state(state)).scheduling.rules == ev.SCHEDULING_RULES
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a"]


@pytest.mark.parametrize("rules", [1, ev.SCHEDULING_RULES])
def test_a_policy_command_naming_known_rules_is_applied(rules: int) -> None:
    log = drive([node("n1", 2), ev.PolicyConfigured(id="p", policy="fifo", rules=rules)])
    assert not decisions(log, ev.CommandRefused) and folded(log).scheduling.rules == rules


def test_the_cli_refuses_a_policy_parameter_that_is_not_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_config, "client_call", _never_sent)
    for param in ("half_life_s=inf", "queues=nan", "min_run_s=1e999"):
        args = argparse.Namespace(policy_command="set", name="las", param=[param], no_backfill=False)
        with pytest.raises(GpuherdError, match="finite"):
            cli_config.cmd_policy(args)


@pytest.mark.parametrize(
    "option",
    [{"weight": math.inf}, {"weight": math.nan}, {"default_time_limit": "inf"}, {"max_time_limit": "1e999"}],
)
def test_the_cli_refuses_a_vc_setting_that_is_not_finite(
    option: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli_config, "client_call", _never_sent)
    empty_log = tmp_path / "log.jsonl"
    empty_log.write_text("")
    args = argparse.Namespace(
        vc_command="set",
        name="team",
        log=str(empty_log),
        quota=None,
        borrow=None,
        weight=None,
        default_time_limit=None,
        max_time_limit=None,
        max_gpus_per_user=None,
        max_running_per_user=None,
    )
    for name, value in option.items():
        setattr(args, name, value)
    with pytest.raises(GpuherdError, match="finite"):
        cli_config.cmd_vc(args)


def _never_sent(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a command the CLI should have refused was sent")
