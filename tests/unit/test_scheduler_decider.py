import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuherd import events as ev
from gpuherd.fold.invariants import violations
from gpuherd.log import Record
from gpuherd.runtime.audit import audit
from gpuherd.runtime.core import DecisionCore, outputs_of
from gpuherd.runtime.decider import decide_stamped
from services.scheduler.decide import SchedulerDecider
from services.scheduler.placement import NodeView, place
from services.scheduler.state import SchedulerState, index_problems
from tests.helpers import ended, finish, node, submit, tick

decider = SchedulerDecider()


def drive(events: list[ev.Event], log: list[Record] | None = None) -> list[Record]:
    """Append ``events`` after ``log`` one at a time, each once the scheduler has decided everything
    before it, through the runtime's ordering core: fold, decide what it follows, append, and fold
    its own decisions before deciding anything else."""
    log = list(log or [])
    core = DecisionCore(decider, folded(log))  # (what the log so far would make is in it already)
    for event in events:
        append(log, core, event)
        settle(log, core)
    return log


def append(log: list[Record], core: DecisionCore[SchedulerState], event: ev.Event) -> None:
    record = Record(len(log) + 1, event)
    log.append(record)
    core.fold(record)


def settle(log: list[Record], core: DecisionCore[SchedulerState]) -> None:
    """Decide until nothing waits: each batch's outputs appended and folded before the next."""
    while core.ready():
        batch = core.next_batch()
        outputs = outputs_of(batch)
        first = len(log) + 1
        for output in outputs:
            append(log, core, output)
        if outputs:
            core.appended(range(first, len(log) + 1))


def folded(log: list[Record]) -> SchedulerState:
    state = decider.initial_state()
    for record in log:
        state = decider.evolve(state, record.seq, record.event)
    return state


def decisions(log: list[Record], kind: type) -> list:
    return [r.event for r in log if isinstance(r.event, kind)]


def test_fifo_head_blocks_smaller_jobs_behind_it() -> None:
    log = drive([node("n1", 4), submit("big", 4), submit("small", 1), submit("big2", 4), submit("tiny", 1)])
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["big"]
    strict = ev.PolicyConfigured(id="strict", policy="fifo", backfill=False)
    log = drive([strict, node("n1", 4), submit("a", 2), submit("b", 4), submit("c", 1)])
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a"], "c must not overtake the waiting head b"


def test_backfill_lets_a_short_job_overtake_only_if_it_ends_before_the_heads_reserved_start() -> None:
    # a (2 GPUs, 10 s) runs; b needs all 4 GPUs, so its start is reserved at a's end (t=10).
    log = drive(
        [node("n1", 4), submit("a", 2), submit("b", 4), submit("c", 1, duration=10), submit("d", 1, duration=50)]
    )
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a", "c"], "d would still run at t=10: it must wait"
    cpu = node("n1", 4, executor="cpu", ports=(29500, 29599))
    unknown = submit("a", 2, duration=None, command=CMD)
    log = drive([cpu, unknown, submit("b", 4, command=CMD), submit("c", 1, duration=1, command=CMD)])
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a"], "a's end is unknown: no reservation, no backfill"


def test_finish_lets_the_queue_move() -> None:
    log = drive([node("n1", 2), submit("a", 2), submit("b", 2), finish("a")])
    placed = decisions(log, ev.JobPlaced)
    assert [p.job for p in placed] == ["a", "b"]
    assert placed[1].based_on > placed[0].based_on
    assert placed[1].cause == "fin-a-0"


def test_multi_node_gang_and_even_split() -> None:
    log = drive([node("n1", 4), node("n2", 4), node("n3", 4), node("n4", 4), submit("g", 8), submit("e", 4, nodes=2)])
    g, e = decisions(log, ev.JobPlaced)
    assert sorted(a.node for a in g.allocations) == ["n1", "n2"]
    assert [(a.node, len(a.gpus)) for a in e.allocations] == [("n3", 2), ("n4", 2)]


def test_lost_node_requeues_its_jobs_then_places_elsewhere() -> None:
    log = drive(
        [
            node("n1", 2),
            node("n2", 2),
            submit("a", 2),
            submit("b", 2),
            ev.NodeLost(id="lost", node="n1", reason="silent"),
        ]
    )
    requeued = decisions(log, ev.JobRequeued)
    assert [(r.job, r.attempt) for r in requeued] == [("a", 0)]
    assert "node n1 lost" in requeued[0].reason
    placed = [(p.job, p.attempt) for p in decisions(log, ev.JobPlaced)]
    assert placed == [("a", 0), ("b", 0)], "no free GPU is left for a's retry while b runs"
    log2 = drive([node("n1", 2), node("n2", 2), submit("a", 2), ev.NodeLost(id="lost", node="n1")])
    assert [(p.job, p.attempt, p.allocations[0].node) for p in decisions(log2, ev.JobPlaced)] == [
        ("a", 0, "n1"),
        ("a", 1, "n2"),
    ]


def test_cancel_of_waiting_job_is_final_and_frees_the_head() -> None:
    log = drive(
        [node("n1", 1), submit("a"), submit("b"), submit("c"), ev.JobCancelRequested(id="c", job="b"), finish("a")]
    )
    fins = decisions(log, ev.JobFinished)
    assert [(f.job, f.outcome) for f in fins if f.source == "scheduler"] == [("b", "cancelled")]
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a", "c"]


def test_drained_and_lost_nodes_get_no_work() -> None:
    log = drive([node("n1", 2), ev.NodeDrained(id="d", node="n1"), node("n2", 1), submit("a", 1), submit("b", 1)])
    assert [(p.job, p.allocations[0].node) for p in decisions(log, ev.JobPlaced)] == [("a", "n2")]


def test_decide_is_pure() -> None:
    history = [node("n1", 4), node("n2", 4), submit("a", 3), submit("b", 6), submit("c", 2)]
    state = folded([Record(seq, e) for seq, e in enumerate(history, 1)])
    before = decider.encode_state(state)
    trigger = Record(5, history[-1])
    first = decide_stamped(decider, state, trigger)
    second = decide_stamped(decider, state, trigger)
    assert first == second and first
    assert decider.encode_state(state) == before, "decide must not change the state"
    assert [d.id for d in first] == [f"scheduler:5:{n}" for n in range(len(first))]
    assert all(d.based_on == 5 and d.cause == history[-1].id for d in first)


jobs = st.lists(
    st.tuples(st.integers(1, 10), st.sampled_from([None, 1, 2]), st.integers(0, 1)), min_size=1, max_size=25
)


@settings(max_examples=60, deadline=None)
@given(jobs=jobs, rng=st.randoms(use_true_random=False), lose=st.booleans())
def test_random_gang_histories_never_double_book_and_always_settle(jobs, rng, lose) -> None:
    history: list[ev.Event] = [node(f"n{i}", 4, at=0.0) for i in range(3)]
    for i, (gpus, nodes, retries) in enumerate(jobs):
        if nodes is not None and (gpus % nodes or gpus // nodes > 4):
            nodes = None  # what intake would reject
        history.append(submit(f"j{i}", gpus, nodes=nodes, max_retries=retries))
    log = drive(history)
    # End parts one at a time in random order (sometimes failing), sometimes losing a node, until nothing runs.
    for step in range(400):
        state = fold_log(log)
        open_parts = [
            (j.job, j.attempt, a.node)
            for j in state.jobs.values()
            if j.status in ("placed", "running")
            for a in j.allocations
            if a.node not in j.parts_ended
        ]
        if not open_parts:
            break
        if lose and step == 3 and state.nodes["n0"].status == "up":
            extra: ev.Event = tick(100.0, lost_after=10.0, n1=99.0, n2=99.0)  # n0 silent since it registered
        else:
            job, attempt, part = rng.choice(open_parts)
            outcome = "stopped" if state.jobs[job].stopping() else rng.choice(["completed", "completed", "failed"])
            extra = ended(job, part, attempt, outcome=outcome, exit_code=1 if outcome == "failed" else 0)
        log = drive([extra], log)
    assert violations(log) == []
    state = fold_log(log)
    assert all(j.status in ("pending", "completed", "failed") for j in state.jobs.values())
    empty = {n.node: NodeView(n.node, n.rack, ((0, 1, 2, 3),)) for n in state.nodes.values() if n.status == "up"}
    assert not state.queue or place(state.jobs[state.queue[0]].spec, empty) is None, (
        "jobs wait only behind a head that cannot fit the nodes left (FIFO)"
    )
    for j in state.jobs.values():
        if j.status == "failed":
            assert j.failures == j.spec.max_retries, "a failed job used all of its retries"


# -- gangs: an attempt ends when every part has ended -------------------------------------------

CMD = ("python", "train.py")


def two_node_gang(max_retries: int = 0) -> list[Record]:
    return drive(
        [
            node("a", 4, executor="cpu", ports=(29500, 29599)),
            node("b", 4, executor="cpu", ports=(29500, 29599)),
            submit("g", 8, nodes=2, command=CMD, max_retries=max_retries),
        ]
    )


def test_gang_gets_a_rendezvous_on_its_leader_node() -> None:
    log = two_node_gang()
    (placed,) = decisions(log, ev.JobPlaced)
    assert [a.node for a in placed.allocations] == ["a", "b"]
    assert placed.rendezvous is not None and placed.rendezvous.addr == "a.local"
    assert 29500 <= placed.rendezvous.port <= 29599
    assert placed.locality == "rack"


def test_rendezvous_ports_differ_between_jobs_on_one_leader() -> None:
    log = drive(
        [node("a", 4, executor="cpu", ports=(29500, 29501))] + [submit(f"j{i}", 1, command=CMD) for i in range(3)]
    )
    placed = decisions(log, ev.JobPlaced)
    assert len(placed) == 3
    ports = [p.rendezvous.port if p.rendezvous else None for p in placed]
    assert sorted(p for p in ports if p is not None) == [29500, 29501]
    assert ports.count(None) == 1  # the range is used up: no port rather than a shared one


def test_job_completes_only_when_every_part_completed() -> None:
    log = two_node_gang()
    log = drive([ended("g", "a")], log)
    assert not decisions(log, ev.JobFinished)
    log = drive([ended("g", "b")], log)
    (done,) = decisions(log, ev.JobFinished)
    assert done.outcome == "completed" and done.node == "a"


def test_failed_part_stops_the_gang_and_fails_the_job_with_its_output() -> None:
    log = drive([ended("g", "b", outcome="failed", exit_code=3)], two_node_gang())
    assert not decisions(log, ev.JobFinished), "part a still runs: nothing is settled yet"
    state = fold_log(log)
    assert state.jobs["g"].stopping()
    assert state.free_gpus() == 0, "GPUs stay held until every part has ended"
    log = drive([ended("g", "a", outcome="stopped", exit_code=None)], log)
    (done,) = decisions(log, ev.JobFinished)
    assert done.outcome == "failed" and done.exit_code == 3 and done.node == "b"
    assert "Traceback: boom" in done.output_tail and "exited with code 3" in done.reason


def test_failed_job_is_retried_up_to_max_retries() -> None:
    log = two_node_gang(max_retries=1)
    log = drive([ended("g", "a", outcome="failed", exit_code=1), ended("g", "b", outcome="stopped")], log)
    (requeued,) = decisions(log, ev.JobRequeued)
    assert "retry 1 of 1" in requeued.reason
    placed = decisions(log, ev.JobPlaced)
    assert [p.attempt for p in placed] == [0, 1]
    assert placed[0].rendezvous != placed[1].rendezvous, "a retry does not reuse its predecessor's port"
    log = drive([ended("g", "a", 1, outcome="failed", exit_code=1), ended("g", "b", 1, outcome="stopped")], log)
    (done,) = decisions(log, ev.JobFinished)
    assert done.outcome == "failed" and "after 1 retries" in done.reason


def test_silent_node_is_lost_by_a_clock_tick_and_its_gang_requeued() -> None:
    log = two_node_gang(max_retries=0)
    log = drive([tick(5.0, a=4.0, b=4.0)], log)
    assert not decisions(log, ev.NodeLost), "within the timeout"
    log = drive([tick(20.0, a=19.0, b=4.0)], log)
    (lost,) = decisions(log, ev.NodeLost)
    assert lost.node == "b" and lost.cause.startswith("scheduler:tick:") and lost.based_on > 0
    assert not decisions(log, ev.JobRequeued), "a's part still runs; it must stop first"
    log = drive([ended("g", "a", outcome="stopped")], log)
    (requeued,) = decisions(log, ev.JobRequeued)
    assert "node b lost" in requeued.reason, "a lost node is not the job's failure: retries are not used"


def test_a_node_that_registered_after_the_last_heartbeat_is_not_lost() -> None:
    log = drive([node("a", 4, at=30.0), tick(35.0, lost_after=10.0, a=1.0)])
    assert not decisions(log, ev.NodeLost)


def test_cancel_of_a_running_gang_waits_for_its_parts() -> None:
    log = two_node_gang()
    log = drive([ev.JobCancelRequested(id="c1", job="g")], log)
    assert not decisions(log, ev.JobFinished)
    log = drive([ended("g", "a", outcome="stopped"), ended("g", "b", outcome="stopped")], log)
    (done,) = decisions(log, ev.JobFinished)
    assert done.outcome == "cancelled"


def fold_log(log: list[Record]) -> SchedulerState:
    state = folded(log)
    assert not index_problems(state)
    return state


def test_an_unhealthy_gpu_moves_its_job_and_takes_no_new_work() -> None:
    log = drive(
        [node("n1", 2, executor="cpu", ports=(29500, 29599)), node("n2", 2, executor="cpu", ports=(29500, 29599))]
    )
    log = drive([submit("a", 2, command=CMD)], log)
    (first,) = decisions(log, ev.JobPlaced)
    bad = ev.GpuHealthChanged(id="xid", node=first.allocations[0].node, index=1, healthy=False, reason="XID 79")
    log = drive([bad], log)
    (pre,) = decisions(log, ev.JobPreempted)
    assert pre.job == "a" and pre.grace_s == 0.0 and "XID 79" in pre.reason
    log = drive([ended("a", first.allocations[0].node, outcome="stopped")], log)
    (requeued,) = decisions(log, ev.JobRequeued)
    assert "unhealthy" in requeued.reason
    second = decisions(log, ev.JobPlaced)[1]
    assert second.attempt == 1 and second.allocations[0].node != first.allocations[0].node
    state = fold_log(log)
    assert state.jobs["a"].failures == 0, "a bad GPU is not the job's failure"
    log = drive([submit("b", 1, command=CMD)], log)
    third = decisions(log, ev.JobPlaced)[2]
    assert (third.allocations[0].node, third.allocations[0].gpus) == (first.allocations[0].node, (0,))
    log = drive([ev.NodeUndrained(id="ok", node=first.allocations[0].node)], log)
    assert all(g.healthy for g in fold_log(log).nodes[first.allocations[0].node].gpus)


def test_operator_commands_it_cannot_apply_are_refused_with_the_reason_and_change_nothing() -> None:
    log = drive([node("n1", 2), ev.PolicyConfigured(id="ok", policy="sjf")])
    bad = [
        ev.VcConfigured(id="vc", vc="a", gpu_quota=-2),
        ev.PolicyConfigured(id="pol", policy="lottery"),
        ev.PolicyConfigured(id="param", policy="las", params={"bogus": 1.0}),
        ev.NodeDrained(id="drain", node="ghost"),
        ev.JobCancelRequested(id="cancel", job="ghost"),
    ]
    log = drive(bad, log)
    refused = {r.command_id: r for r in decisions(log, ev.CommandRefused)}
    assert set(refused) == {"vc", "pol", "param", "drain", "cancel"}
    assert "cannot be negative" in refused["vc"].reason and refused["vc"].command == "VcConfigured"
    assert "unknown policy 'lottery'" in refused["pol"].reason and "no parameter bogus" in refused["param"].reason
    assert "no node 'ghost'" in refused["drain"].reason and "no job 'ghost'" in refused["cancel"].reason
    state = fold_log(log)
    assert state.scheduling.policy == "sjf" and "a" not in state.vcs, "nothing changed"
    unchecked = [msgspec.structs.replace(e, id=f"old-{e.id}", unchecked=True) for e in bad]
    log = drive(unchecked, log)
    assert len(decisions(log, ev.CommandRefused)) == 5, "commands recorded before they were checked are not refused"
    assert decider.policy_for(fold_log(log)).name == "las", "as then: its unknown parameter was ignored"


def test_a_vc_limit_a_snapshot_cannot_hold_is_refused() -> None:
    # Snapshots are msgpack (64-bit integers): a quota beyond would stop every snapshot of the state.
    log = drive([node("n1", 2)])
    huge = [
        ev.VcConfigured(id="quota", vc="a", gpu_quota=10**30),
        ev.VcConfigured(id="gpus", vc="a", max_gpus_per_user=2**64),
        ev.VcConfigured(id="jobs", vc="a", max_running_per_user=10**20),
    ]
    log = drive(huge, log)
    refused = {r.command_id: r.reason for r in decisions(log, ev.CommandRefused)}
    assert set(refused) == {"quota", "gpus", "jobs"} and all("out of range" in r for r in refused.values())
    state = fold_log(log)
    assert "a" not in state.vcs and decider.decode_state(decider.encode_state(state)).seq == state.seq


def test_a_prediction_makes_a_pass_only_where_it_is_used() -> None:
    # "declared" runs on n1, "unknown" (a command of unknown duration) on n2; "late" waits for
    # n1's free GPU, its own pass not made: whether a prediction makes one shows in what it places.
    command = ("python", "train.py")
    history = [node("n1", 2), node("n2", 1, executor="cpu"), submit("declared", 1)]
    state = folded(drive([*history, submit("unknown", 1, duration=None, command=command)]))
    assert {j for j in state.jobs if state.jobs[j].status == "placed"} == {"declared", "unknown"}
    late = submit("late", 1)
    state = decider.evolve(state, state.seq + 1, late)  # folded, its own pass not made

    def passes(policy: str, job: str, rules: int = ev.SCHEDULING_RULES) -> bool:
        config = ev.PolicyConfigured(id=f"p-{policy}-{rules}", policy=policy, rules=rules)
        s = decider.evolve(msgspec.convert(msgspec.to_builtins(state), SchedulerState), state.seq + 1, config)
        prediction = ev.JobDurationPredicted(id=f"pred-{job}", job=job, seconds=5.0)
        return bool(decider.decide(decider.evolve(s, s.seq + 1, prediction), prediction))

    assert not passes("fifo", "declared") and not passes("sjf", "late")
    assert passes("fifo", "unknown")  # backfill reads it
    assert passes("qssf", "declared")  # QSSF ranks by predictions only
    assert passes("fifo", "declared", rules=2)  # as logs of earlier rules were decided


def test_a_pass_is_put_off_to_a_later_one_only_briefly_when_live() -> None:
    """Several pass-only inputs waiting: without a clock (simulation) only the last is decided; live,
    one that has waited MAX_PASS_DEFERRAL_S is decided in its turn, and the later ones, folded
    already, are dropped: one pass, made at once, that places every waiting job."""
    from gpuherd.runtime.core import MAX_PASS_DEFERRAL_S

    def waiting_core() -> DecisionCore[SchedulerState]:
        log = drive([node("n1", 4)])
        core = DecisionCore(decider, folded(log))
        for event in (submit("a", 1), ended("gone", "n1"), submit("b", 1), submit("c", 1)):
            record = Record(len(log) + 1, event)
            log.append(record)
            core.fold(record, arrived=0.0)
        return core

    core = waiting_core()
    (batch,) = [core.next_batch()]
    assert [d.cause.event.job for d in batch] == ["c"], "no clock: coalesced to the last pass"
    assert core.coalesced == 2

    core = waiting_core()
    batch = core.next_batch(now=MAX_PASS_DEFERRAL_S / 2)
    assert [d.cause.event.job for d in batch] == ["c"], "not overdue yet: coalesced as before"

    core = waiting_core()
    batch = core.next_batch(now=MAX_PASS_DEFERRAL_S * 2)
    (decided,) = batch
    assert decided.cause.event.job == "a", "overdue: decided in its turn"
    assert sorted(p.job for p in decided.outputs if isinstance(p, ev.JobPlaced)) == ["a", "b", "c"]
    assert core.coalesced == 2 and core.waiting == 1, "the later passes dropped; the settle still waits"


def test_submissions_behind_a_pass_are_judged_in_its_batch_on_its_state() -> None:
    """The scheduler takes submissions beside passes: the ones waiting right behind a pass are
    answered in the pass's batch (one round trip), judged on the state the pass saw; a log event
    behind them is decided in a later batch."""
    import msgspec

    from services.scheduler.intake import Submission

    log = drive([node("n1", 4)])
    core = DecisionCore(decider, folded(log))
    for event in (submit("a", 1),):
        record = Record(len(log) + 1, event)
        log.append(record)
        core.fold(record)
    for seq in (1, 2):
        data = msgspec.json.encode({"name": f"s{seq}", "user": "u", "gpus": 1, "duration_s": 5})
        core.offer(Submission(source="t", seq=seq, data=data, at=1.0))
    late = Record(len(log) + 1, ended("a", "n1"))
    log.append(late)
    core.fold(late)
    batch = core.next_batch()
    assert [type(d.outputs[0]).__name__ for d in batch] == ["JobPlaced", "JobSubmitted", "JobSubmitted"]
    based_on = {o.based_on for d in batch for o in d.outputs}
    assert based_on == {core.state.seq}, "all decided on one state"
    assert core.waiting == 1, "the task's end waits for the next batch"


def test_a_pass_behind_answers_joins_their_batch() -> None:
    """Submissions that arrived while the scheduler's last batch was on its way wait ahead of the
    jobs that batch accepted. The pass for those jobs joins the submissions' batch: one round trip,
    one state for all (the audit's view unchanged), live as in a simulation."""
    import msgspec

    from services.scheduler.intake import Submission

    log = drive([node("n1", 4)])
    core = DecisionCore(decider, folded(log))
    for seq in (1, 2):
        data = msgspec.json.encode({"name": f"s{seq}", "user": "u", "gpus": 1, "duration_s": 5})
        core.offer(Submission(source="t", seq=seq, data=data, at=1.0))
    for job in ("a", "b"):  # accepted by the batch on its way: folded after the submissions came
        append(log, core, submit(job, 1))
    batch = core.next_batch()
    kinds = [type(o).__name__ for d in batch for o in d.outputs]
    assert kinds == ["JobSubmitted", "JobSubmitted", "JobPlaced", "JobPlaced"]
    assert sorted(o.job for d in batch for o in d.outputs if isinstance(o, ev.JobPlaced)) == ["a", "b"]
    assert {o.based_on for d in batch for o in d.outputs} == {core.state.seq}, "all decided on one state"
    assert core.waiting == 0 and core.coalesced == 1, "one pass for both jobs"


def test_a_pass_joins_settles_of_other_jobs_but_waits_for_one_it_decides_about() -> None:
    """A task's end settled ahead of a pass: the pass joins the settle's batch, unless the
    pass decides about the settled job (``keys_of``): then it waits, and is decided once the batch
    is folded, on the state that shows the settle."""
    log = drive([node("n1", 4), submit("a", 1)])
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["a"]

    def waiting_core(decider_: SchedulerDecider) -> tuple[list[Record], DecisionCore[SchedulerState]]:
        records = list(log)
        core = DecisionCore(decider_, folded(records))
        for event in (ended("a", "n1"), submit("b", 1)):
            append(records, core, event)
        return records, core

    _, core = waiting_core(decider)
    batch = core.next_batch()
    assert [(type(o).__name__, o.job) for d in batch for o in d.outputs] == [("JobFinished", "a"), ("JobPlaced", "b")]
    assert core.waiting == 0

    class DecidesAboutA(SchedulerDecider):
        def keys_of(self, decisions: list[ev.Event]) -> set[str]:
            return {"a"}  # as if the pass preempted a

    records, core = waiting_core(DecidesAboutA())
    batch = core.next_batch()
    assert [(type(o).__name__, o.job) for d in batch for o in d.outputs] == [("JobFinished", "a")]
    assert core.waiting == 1, "the pass waits for the settle to be folded"
    first = len(records) + 1
    for output in outputs_of(batch):
        append(records, core, output)
    core.appended(range(first, len(records) + 1))
    (decided,) = core.next_batch()
    assert [o.job for o in decided.outputs if isinstance(o, ev.JobPlaced)] == ["b"]
    assert decided.outputs[0].based_on == len(records), "decided on the state that shows a finished"
    assert decider.keys_of([*outputs_of(batch), *decided.outputs]) == {"a", "b"}


def test_a_vc_reclaiming_its_quota_gets_it_and_the_lender_does_not_borrow_it_back() -> None:
    # vision borrows 2 of nlp's GPUs; nlp's job reclaims them. Requeued, vision-big ranks ahead of
    # nlp-job again (FIFO): by the rules before, it borrowed the same GPUs at once and nlp-job waited
    # on; now the job within its quota is considered first.
    def run(rules: int) -> list[Record]:
        setup = [
            ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
            ev.VcConfigured(id="v1", vc="vision", gpu_quota=2, can_borrow=True),
            ev.VcConfigured(id="v2", vc="nlp", gpu_quota=2, can_borrow=True),
            node("n1", 4),
            submit("vision-big", 4, vc="vision", duration=1000.0),
        ]
        log = drive(setup)
        log = drive([ev.JobStarted(id="s0", job="vision-big", attempt=0, node="n1")], log)
        log = drive([submit("nlp-job", 2, vc="nlp", duration=1000.0)], log)
        (pre,) = decisions(log, ev.JobPreempted)
        assert pre.job == "vision-big" and "reclaiming" in pre.reason
        return drive([ended("vision-big", "n1", outcome="stopped")], log)

    placed = [(p.job, p.attempt) for p in decisions(run(ev.SCHEDULING_RULES), ev.JobPlaced)]
    assert placed == [("vision-big", 0), ("nlp-job", 0)], "nlp-job starts on its quota; vision-big waits for GPUs"
    before = [(p.job, p.attempt) for p in decisions(run(7), ev.JobPlaced)]
    assert before == [("vision-big", 0), ("vision-big", 1)], "a log of the rules before is re-derived as it was"


def _with_priority(submitted: ev.JobSubmitted, priority: int) -> ev.JobSubmitted:
    return msgspec.structs.replace(submitted, spec=msgspec.structs.replace(submitted.spec, priority=priority))


def _lender_back_within_quota(rules: int, *, borrower_after: bool) -> list[Record]:
    """vision (quota 2) runs vision-a within its quota and vision-b borrowing 2 of nlp's GPUs; then
    vision-a ends, so vision is back within its quota while vision-b's ``borrowed`` still says 2.
    Its freed GPUs go to vision-c (``borrower_after``: vision borrows again, by vision-c, of a higher
    priority than vision-b) or to ml's job within ml's quota. Then nlp's job asks for its quota."""
    setup: list[ev.Event] = [
        ev.PolicyConfigured(id="policy", policy="fifo", rules=rules),
        ev.VcConfigured(id="v1", vc="vision", gpu_quota=2, can_borrow=True),
        ev.VcConfigured(id="v2", vc="nlp", gpu_quota=2, can_borrow=True),
        ev.VcConfigured(id="v3", vc="ml", gpu_quota=2, can_borrow=True),
        node("n1", 4),
        submit("vision-a", 2, vc="vision", duration=1000.0),
        submit("vision-b", 2, vc="vision", duration=1000.0),
    ]
    log = drive(setup)
    log = drive([ev.JobStarted(id=f"s-{j}", job=j, attempt=0, node="n1") for j in ("vision-a", "vision-b")], log)
    assert [p.borrowed for p in decisions(log, ev.JobPlaced)] == [0, 2]
    log = drive([ended("vision-a", "n1")], log)
    vision_c = _with_priority(submit("vision-c", 2, vc="vision", duration=1000.0), 1)
    then = vision_c if borrower_after else submit("ml-a", 2, vc="ml", duration=1000.0)
    log = drive([then, ev.JobStarted(id="s-then", job=then.job, attempt=0, node="n1")], log)
    return drive([submit("nlp-job", 2, vc="nlp", duration=1000.0)], log)


def test_reclaiming_preempts_the_jobs_beyond_the_lenders_quota_now_not_those_that_borrowed_once() -> None:
    # vision runs vision-b (placed borrowing) and vision-c (placed later, borrowing): vision uses 4 of
    # its 2 GPUs, and its newest placement, vision-c, is what it borrows. By the rules before, the
    # borrowed count frozen at placement made vision-b (the lower priority) the victim: a job within
    # vision's quota stopped while vision-c, beyond it, ran on.
    log = _lender_back_within_quota(ev.SCHEDULING_RULES, borrower_after=True)
    (pre,) = decisions(log, ev.JobPreempted)
    assert pre.job == "vision-c" and pre.by == "nlp-job" and "reclaiming" in pre.reason
    old = _lender_back_within_quota(8, borrower_after=True)
    assert [p.job for p in decisions(old, ev.JobPreempted)] == ["vision-b"], "rules 8 re-derived as decided"
    for decided in (log, old):
        assert audit(decided, SchedulerDecider()).ok


def test_a_lender_back_within_its_quota_borrows_nothing_to_reclaim() -> None:
    # vision-a's end leaves vision within its quota; ml's job runs within ml's. No VC uses more than
    # its quota (nlp's is over-committed): nlp-job waits, and nothing is stopped for it.
    log = _lender_back_within_quota(ev.SCHEDULING_RULES, borrower_after=False)
    assert decisions(log, ev.JobPreempted) == []
    assert [p.job for p in decisions(log, ev.JobPlaced)] == ["vision-a", "vision-b", "ml-a"]
    old = _lender_back_within_quota(8, borrower_after=False)
    assert [p.job for p in decisions(old, ev.JobPreempted)] == ["vision-b"], "rules 8 re-derived as decided"
    for decided in (log, old):
        assert audit(decided, SchedulerDecider()).ok


def test_what_a_vc_borrows_is_its_usage_beyond_quota_held_by_its_newest_placements() -> None:
    def placed(job: str, gpus: tuple[int, ...]) -> ev.JobPlaced:
        return ev.JobPlaced(id=f"p-{job}", job=job, attempt=0, allocations=(ev.Allocation("n1", gpus),))

    jobs = [("a", (0,)), ("b", (1, 2)), ("c", (3,))]  # placed in this order
    history = [
        ev.VcConfigured(id="v1", vc="vision", gpu_quota=2, can_borrow=True),
        node("n1", 8),
        *(submit(job, len(gpus), vc="vision") for job, gpus in jobs),
        *(placed(job, gpus) for job, gpus in jobs),
    ]
    state = folded([Record(seq, e) for seq, e in enumerate(history, 1)])
    assert state.borrowing("vision") == {"b", "c"}, "4 GPUs of a quota of 2: c (1) and b hold the excess"
    restored = decider.decode_state(decider.encode_state(state))
    assert restored.borrowing("vision") == {"b", "c"}, "a snapshot keeps the order the jobs were placed in"
    state = decider.evolve(state, 20, finish("c"))
    assert state.borrowing("vision") == {"b"}
    state = decider.evolve(state, 21, finish("a"))
    assert state.borrowing("vision") == set(), "b, placed borrowing, is within the quota now"
    state = decider.evolve(state, 22, ev.VcConfigured(id="v2", vc="vision", gpu_quota=1, can_borrow=True))
    assert state.borrowing("vision") == {"b"}, "a lowered quota leaves its excess borrowed"
    assert state.borrowing("nlp") == set(), "a VC without a quota borrows nothing"
