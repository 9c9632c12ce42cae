"""A sweep runs several simulations at once, each in a forked process: the same results as one by
one, in the order asked, with its progress; a run that fails or dies is named, and no process
outlives the sweep, whether it finishes, fails or is stopped early."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.cli import build_parser
from apps.sim import run as sim_run
from apps.sim.cluster import ClusterSpec, VcSpec
from apps.sim.engine import SimulationError
from apps.sim.model import HELIOS
from apps.sim.policies import compare
from apps.sim.run import simulate
from apps.sim.sweep import sweep, workers_for
from gpuherd.errors import GpuherdError
from services.analytics.jobs import summarize
from services.analytics.traces import load_trace, submissions, vc_peak_demand

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "philly-sample.csv"
POLICIES = ["fifo", "sjf", "las"]


@pytest.fixture(scope="module")
def workload() -> tuple[Any, ClusterSpec]:
    trace = load_trace(SAMPLE)
    trace.jobs = trace.jobs.head(300)
    return trace, ClusterSpec.from_peaks(vc_peak_demand(trace), scale=0.3)


@pytest.fixture(autouse=True)
def no_process_left() -> Any:
    yield
    left = multiprocessing.active_children()
    for process in left:
        process.kill()
    assert not left, f"the sweep left processes running: {left}"


def _figures(workload: tuple[Any, ClusterSpec], policy: str, progress: Any) -> dict[str, Any]:
    trace, cluster = workload
    result = simulate(
        submissions(trace, start=trace.origin), cluster, policy, start=trace.origin, on_submit=progress, digest=True
    )
    return {"digest": result.digest, "summary": summarize(result.table.jobs)["all"], "submitted": result.submitted}


def test_forked_runs_give_what_runs_one_by_one_give(workload: tuple[Any, ClusterSpec]) -> None:
    made: dict[str, int] = dict.fromkeys(POLICIES, 0)

    def count(policy: str, n: int) -> None:
        made[policy] += n

    def run(policy: str, progress: Any) -> dict[str, Any]:
        return _figures(workload, policy, progress)

    forked = dict(sweep(POLICIES, run, workers=2, on_progress=count))
    alone = dict(sweep(POLICIES, run, workers=1))
    assert forked == alone
    assert len({figures["digest"] for figures in forked.values()}) == len(POLICIES), "three different logs"
    assert made == {policy: forked[policy]["submitted"] for policy in POLICIES}, "every submission reported"


def test_a_failed_run_is_named_with_its_traceback_and_the_others_stop(workload: tuple[Any, ClusterSpec]) -> None:
    def run(policy: str, progress: Any) -> dict[str, Any]:
        if policy == "sjf":
            raise RuntimeError("broken on purpose")
        return _figures(workload, policy, progress)

    with pytest.raises(SimulationError, match=r"(?s)simulation of sjf failed.*RuntimeError: broken on purpose"):
        list(sweep(POLICIES, run, workers=2))


def test_a_run_that_dies_without_a_word_is_named() -> None:
    def run(name: str, progress: Any) -> None:
        if name == "killed":
            os.kill(os.getpid(), signal.SIGKILL)

    with pytest.raises(SimulationError, match=r"simulation of killed died \(exit code -9"):
        list(sweep(["fine", "killed"], run, workers=2))


def test_stopping_early_stops_the_runs_still_going() -> None:
    def run(name: str, progress: Any) -> str:
        if name != "quick":
            signal.pause()  # (runs until the sweep stops it)
        return name

    results = sweep(["quick", "slow", "slower"], run, workers=3)
    assert next(results) == ("quick", "quick")
    results.close()  # the caller stops here: the two still running are stopped


# -- no worker of a VC's simulation outlives its run ---------------------------------------------------
# A model that gives each VC its own simulation (Helios) runs the VCs on a pool of forked workers, in
# the sweep's forked run: stopping that run (another failed, Ctrl-C) must end its workers too.

VC_SLEEP_S = 30.0  # a VC's simulation in these tests: still running when its run is stopped
GONE_WITHIN_S = 10.0  # how long a stopped process may take to be gone


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: only its reaping is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _recorded(folder: Path) -> list[int]:
    return sorted({int(name.suffix[1:]) for name in folder.iterdir()})


def _still_running(folder: Path, within: float = GONE_WITHIN_S) -> list[int]:
    """The processes recorded in ``folder`` still running after ``within`` seconds (none: at once)."""
    deadline = time.monotonic() + within
    while (left := [pid for pid in _recorded(folder) if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _wait_for(folder: Path, count: int, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while len(list(folder.iterdir())) < count:
        assert time.monotonic() < deadline, f"{count} processes never started: {sorted(folder.iterdir())}"
        time.sleep(0.05)


def _one_vc(folder: Path, cluster: ClusterSpec) -> Any:
    """A VC's simulation in these tests: it records its process in ``folder`` (``<vc>.<pid>``) and
    sleeps, or, of a VC named ``fail...``, fails."""
    (vc,) = cluster.vcs
    (folder / f"{vc}.{os.getpid()}").touch()
    if vc.startswith("fail"):
        raise RuntimeError(f"{vc} broken on purpose")
    time.sleep(VC_SLEEP_S)
    raise RuntimeError(f"{vc} was never stopped")


@pytest.fixture
def vc_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each VC's simulation is ``_one_vc`` in the folder given. Whatever a test's outcome, every
    process recorded is killed."""
    folder = tmp_path / "processes"
    folder.mkdir()
    # (Forked processes inherit it.)
    monkeypatch.setattr(sim_run, "_simulate", lambda jobs, cluster, **_: _one_vc(folder, cluster))
    try:
        yield folder
    finally:
        for pid in _recorded(folder):
            if _running(pid) and pid != os.getpid():
                os.kill(pid, signal.SIGKILL)


def _vcs(*names: str) -> ClusterSpec:
    return ClusterSpec(vcs={name: VcSpec(nodes=1) for name in names})


def test_a_partitioned_simulation_gives_the_same_logs_on_workers_as_alone(
    workload: tuple[Any, ClusterSpec],
) -> None:
    trace, cluster = workload

    def logs(workers: int) -> dict[str, list[Any]]:
        run = simulate(
            submissions(trace, start=trace.origin), cluster, "sjf", start=trace.origin, model=HELIOS, workers=workers
        )
        return run.logs

    alone = logs(1)
    assert list(logs(2).items()) == list(alone.items()), "each VC's log, in the VCs' order"
    assert len(alone) > 1 and all(alone.values())


def test_a_failed_run_leaves_no_worker_of_another_runs_vcs_behind(vc_processes: Path) -> None:
    def run(name: str, progress: Any) -> Any:
        if name == "bad":
            _wait_for(vc_processes, 2)  # good's workers run both its VCs
            raise RuntimeError("broken on purpose")
        return simulate([], _vcs("a", "b"), "fifo", model=HELIOS, workers=2)

    with pytest.raises(SimulationError, match="simulation of bad failed"):
        list(sweep(["good", "bad"], run, workers=2))
    assert len(_recorded(vc_processes)) == 2
    assert _still_running(vc_processes) == [], "good's workers outlived it"


def test_a_failed_vc_ends_the_other_vcs_of_its_simulation_at_once(vc_processes: Path) -> None:
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="fail broken on purpose"):
        simulate([], _vcs("slow", "fail"), "fifo", model=HELIOS, workers=2)
    assert time.monotonic() - began < VC_SLEEP_S / 2, "the failure waited for the other VC to finish"
    assert _still_running(vc_processes, within=0) == [], "the other VC's worker still runs"


def test_the_workers_of_a_failed_simulation_are_reaped_before_it_returns(vc_processes: Path) -> None:
    # The pool's own thread reaps a worker it sees die; both reaping at once once left a dead worker
    # listed as running (about one failure in six here), which a caller counting its children saw.
    for attempt in range(20):
        with pytest.raises(RuntimeError, match="fail broken on purpose"):
            simulate([], _vcs("slow", "fail"), "fifo", model=HELIOS, workers=2)
        assert multiprocessing.active_children() == [], f"a worker still listed after attempt {attempt + 1}"


def sweep_at_a_terminal(folder: str) -> None:
    """What the Ctrl-C test runs as a command of its own: a sweep of two runs, each simulating three
    VCs on two workers, every VC ``_one_vc`` in ``folder``."""
    sim_run._simulate = lambda jobs, cluster, **_: _one_vc(Path(folder), cluster)  # type: ignore[assignment]

    def run(name: str, progress: Any) -> Any:
        (Path(folder) / f"run.{os.getpid()}").touch()
        return simulate([], _vcs("a", "b", "c"), "fifo", model=HELIOS, workers=2)

    list(sweep(["fifo", "sjf"], run, workers=2))


def test_ctrl_c_ends_a_sweep_its_runs_and_their_workers(vc_processes: Path) -> None:
    # A fresh interpreter in a process group of its own, with Ctrl-C raising KeyboardInterrupt, as a
    # command a shell starts (Ctrl-C sends SIGINT to the group). Forked from this session as it was, it
    # inherited the session's disposition of SIGINT: in a suite started in the background (`make test &`,
    # which a shell without job control starts with SIGINT ignored) the sweep went on after Ctrl-C, and
    # the test failed. An ignored SIGINT also survives exec, and Python then leaves it ignored: the code
    # sets it first.
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"from tests.unit.test_sweep import sweep_at_a_terminal; sweep_at_a_terminal({str(vc_processes)!r})"
    )
    root = Path(__file__).resolve().parents[2]
    driver = subprocess.Popen([sys.executable, "-c", code], cwd=root, start_new_session=True)
    try:
        _wait_for(vc_processes, 6)  # each run and the two VCs its workers began (the third one waits)
        os.killpg(driver.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            driver.wait(GONE_WITHIN_S)
        assert driver.returncode is not None, "the sweep went on after Ctrl-C"
        assert _still_running(vc_processes) == [], "a run or a VC's worker outlived Ctrl-C"
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


def test_workers_default_to_one_per_core_and_never_exceed_the_runs() -> None:
    assert workers_for(2, 8) == 2
    assert workers_for(5, 1) == 1
    assert workers_for(100) == (os.cpu_count() or 1)
    assert workers_for(0) == 1


def test_policy_comparison_forks_with_the_same_runs(workload: tuple[Any, ClusterSpec]) -> None:
    trace, cluster = workload
    alone = compare(trace, cluster, ["fifo", "sjf"], workers=1)
    forked = compare(trace, cluster, ["fifo", "sjf"], workers=2)
    assert [(r.policy, r.avg_jct_s, r.preemptions) for r in forked] == [
        (r.policy, r.avg_jct_s, r.preemptions) for r in alone
    ]


def test_gpuherd_sim_runs_its_policies_at_once_in_the_order_asked(tmp_path: Path, capsys: Any) -> None:
    def sim(workers: int, out: Path) -> dict[str, Any]:
        argv = ["sim", str(SAMPLE), "--limit", "200", "--scale", "0.3", "--policy", "sjf,fifo,srtf"]
        args = build_parser().parse_args([*argv, "--workers", str(workers), "--out", str(out), "--json"])
        assert args.func(args) == 0
        printed = json.loads(capsys.readouterr().out)
        return {k: v for k, v in printed.items() if isinstance(v, dict) and "summary" in v}

    forked, alone = sim(2, tmp_path / "forked"), sim(1, tmp_path / "alone")
    assert list(forked) == ["sjf", "fifo", "srtf"], "the order asked, whichever finished first"
    for policy in forked:
        assert forked[policy]["summary"] == alone[policy]["summary"]
        for name in ("events.jsonl", "jobs.csv"):  # (summary.json has each run's own wall time)
            forked_file, alone_file = (tmp_path / run / policy / name for run in ("forked", "alone"))
            assert forked_file.read_bytes() == alone_file.read_bytes(), f"{policy}/{name} differs"


def test_gpuherd_sim_refuses_an_unknown_policy_before_running_any() -> None:
    args = build_parser().parse_args(["sim", str(SAMPLE), "--policy", "fifo,nonesuch"])
    with pytest.raises(GpuherdError, match="unknown policies: nonesuch; choose from"):
        args.func(args)


def test_gpuherd_sim_json_is_strict_json_when_no_job_finishes(tmp_path: Path, capsys: Any) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("vcs:\n  other: {nodes: 1}\ngpus_per_node: 8\n")  # no VC of the trace: every job rejected
    argv = ["sim", str(SAMPLE), "--limit", "20", "--workers", "1", "--cluster", str(cluster), "--json"]
    args = build_parser().parse_args([*argv, "--out", str(tmp_path / "out")])
    assert args.func(args) == 0

    def strict(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    printed = json.loads(capsys.readouterr().out, parse_constant=strict)
    assert printed["fifo"]["rejected"] == 20 and printed["fifo"]["summary"]["all"]["avg_jct_s"] is None
    json.loads((tmp_path / "out" / "fifo" / "summary.json").read_text(), parse_constant=strict)


def test_gpuherd_sim_prints_its_table_when_no_job_ran(tmp_path: Path, capsys: Any) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("vcs:\n  other: {nodes: 1}\ngpus_per_node: 8\n")  # no VC of the trace: every job rejected
    args = build_parser().parse_args(["sim", str(SAMPLE), "--limit", "20", "--workers", "1", "--cluster", str(cluster)])
    assert args.func(args) == 0
    assert "20 jobs (20 rejected)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", str(SAMPLE), "--ces", "nope"],
        ["sim", str(SAMPLE), "--ces", '{"nope": 1}'],
        ["sim", str(SAMPLE), "--ces", "[]"],
        ["sim", str(SAMPLE), "--bucket", "0"],
        ["sim", str(SAMPLE), "--gpus-per-node", "0"],
        ["ces", str(SAMPLE), "--params", "nope"],
        ["ces", str(SAMPLE), "--params", '{"nope": 1}'],
    ],
)
def test_gpuherd_sim_and_ces_refuse_bad_options_with_a_clear_error(argv: list[str]) -> None:
    args = build_parser().parse_args([*argv])
    with pytest.raises(GpuherdError):
        args.func(args)
