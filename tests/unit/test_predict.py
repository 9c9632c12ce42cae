"""The duration model: no look-ahead, determinism, the compiled trees, burst revisions, snapshots."""

from __future__ import annotations

import math

import lightgbm
import msgspec
import numpy as np
import pandas as pd
import pytest

from apps.registry import make_decider
from gpuherd import events as ev
from gpuherd.runtime.decider import Decider
from services.analytics.decide import _moved
from services.analytics.predict import FEATURES, DurationModel, Features, evaluate
from services.analytics.state import AnalyticsState


def _jobs(n: int, seed: int = 0) -> pd.DataFrame:
    """Bursts of jobs whose duration depends on their size and burst (what the model can learn)."""
    rng = np.random.default_rng(seed)
    submit = np.cumsum(rng.choice([1.0, 2.0, 900.0], size=n, p=[0.5, 0.3, 0.2]))
    gpus = rng.choice([1, 2, 8], size=n)
    burst = np.cumsum(np.diff(submit, prepend=0.0) > 60)
    duration = np.exp(4 + gpus / 2 + (burst % 5) + rng.normal(0, 0.3, size=n))
    return pd.DataFrame(
        {
            "job_id": [f"j{i}" for i in range(n)],
            "submit_time": submit + 1.5e9,
            "duration": duration,
            "gpus": gpus,
            "vc": "v",
            "end_time": np.nan,
            "queue": np.nan,
            "user": pd.NA,
            "name": pd.NA,
        }
    )


def test_no_prediction_knows_a_job_that_finished_after_it() -> None:
    jobs = _jobs(900)
    _, before = evaluate(jobs, DurationModel(refit_every=100))
    # Change every job that finishes after t: what was predicted before t must not change.
    t = float(jobs["submit_time"].iloc[600])
    finish = jobs["submit_time"] + jobs["duration"]
    changed = jobs.copy()
    changed.loc[finish > t, "duration"] *= 7.0
    model = DurationModel(refit_every=100)
    _, after = evaluate(changed, model)
    assert model.version >= 3, "the trees were refitted along the way"
    known = (jobs["submit_time"] <= t).to_numpy()
    np.testing.assert_array_equal(before[known], after[known])
    assert not np.array_equal(before[~known], after[~known]), "(the change does reach later predictions)"


def test_the_decider_predicts_from_what_it_had_folded_at_the_submission_even_when_it_decides_later() -> None:
    analytics = make_decider("analytics")
    gpus = tuple(ev.GpuInfo(index=i, uuid=f"g{i}", model="sim", memory_mb=1000) for i in range(8))
    log: list[ev.Event] = [ev.NodeRegistered(id="r", node="n1", gpus=gpus)]
    for i in range(6):
        spec = ev.JobSpec(name="train", user="ana", gpus=1, duration_s=100)
        log.append(ev.JobSubmitted(id=f"s{i}", at=float(i * 1000), job=f"j{i}", spec=spec, intake_source="t"))
        log.append(ev.JobFinished(id=f"f{i}", at=float(i * 1000 + 100), job=f"j{i}", attempt=0, outcome="completed"))
    # (The core folds a start for service time: give each job a placement and a start.)
    full: list[ev.Event] = []
    for e in log:
        if isinstance(e, ev.JobFinished):
            full.append(ev.JobPlaced(id=f"p{e.job}", at=e.at - 100, job=e.job, attempt=0,
                                     allocations=(ev.Allocation(node="n1", gpus=(0,)),)))  # fmt: skip
            full.append(ev.JobStarted(id=f"st{e.job}", at=e.at - 100, job=e.job, attempt=0, node="n1"))
        full.append(e)
    late = ev.JobSubmitted(
        id="sx", at=9000.0, job="x", spec=ev.JobSpec(name="train", user="ana", gpus=1, duration_s=1), intake_source="t"
    )
    state = analytics.initial_state()
    seq = 0
    for e in [*full, late]:
        seq += 1
        state = analytics.evolve(state, seq, e)
    (first,) = analytics.decide(state, late)
    assert first.seconds == pytest.approx(100.0) and first.user_history == 6 and first.features
    # Jobs that finish after x's submission, folded before the decision: the same prediction.
    for i in range(3):
        spec = ev.JobSpec(name="train", user="ana", gpus=1, duration_s=1)
        for e in (
            ev.JobSubmitted(id=f"ls{i}", at=9001.0 + i, job=f"late{i}", spec=spec, intake_source="t"),
            ev.JobPlaced(
                id=f"lp{i}", at=9001.0 + i, job=f"late{i}", attempt=0, allocations=(ev.Allocation("n1", (1 + i,)),)
            ),
            ev.JobStarted(id=f"lst{i}", at=9001.0 + i, job=f"late{i}", attempt=0, node="n1"),
            ev.JobFinished(id=f"lf{i}", at=99_999.0, job=f"late{i}", attempt=0, outcome="completed"),
        ):  # fmt: skip
            seq += 1
            state = analytics.evolve(state, seq, e)
    assert analytics.decide(state, late) == [first]


def _node() -> ev.NodeRegistered:
    gpus = tuple(ev.GpuInfo(index=i, uuid=f"g{i}", model="sim", memory_mb=1000) for i in range(8))
    return ev.NodeRegistered(id="r", node="n1", gpus=gpus)


def _b0_runs(
    analytics: Decider[AnalyticsState], state: AnalyticsState, seq: int, start: float, end: float
) -> tuple[AnalyticsState, int, ev.Event]:
    """Fold job b0 placed on n1, started at ``start`` and finished at ``end``: (state, seq, its end)."""
    for e in (
        ev.JobPlaced(id="p", at=start, job="b0", attempt=0, allocations=(ev.Allocation(node="n1", gpus=(0,)),)),
        ev.JobStarted(id="st", at=start, job="b0", attempt=0, node="n1"),
        ev.JobFinished(id="f", at=end, job="b0", attempt=0, outcome="completed"),
    ):
        seq += 1
        state = analytics.evolve(state, seq, e)
    return state, seq, e


def test_a_burst_s_predictions_are_revised_as_its_jobs_finish() -> None:
    analytics = make_decider("analytics")
    events: list[ev.Event] = [_node()]
    for i in range(4):  # a sweep of four, submitted within seconds
        spec = ev.JobSpec(name="sweep", user="bo", gpus=1, duration_s=50)
        events.append(ev.JobSubmitted(id=f"s{i}", at=float(i), job=f"b{i}", spec=spec, intake_source="t"))
    state = analytics.initial_state()
    seq = 0
    for e in events:
        seq += 1
        state = analytics.evolve(state, seq, e)
        if isinstance(e, ev.JobSubmitted):
            for made in analytics.decide(state, e):
                seq += 1
                state = analytics.evolve(state, seq, made)
    assert state.predicted["b1"][0] == pytest.approx(3600.0)  # nothing known: the default
    state, seq, end = _b0_runs(analytics, state, seq, 5.0, 55.0)
    revised = analytics.decide(state, end)
    assert sorted(r.job for r in revised) == ["b1", "b2", "b3"]
    assert all(r.seconds < 600 and "1 of its burst finished" in r.basis for r in revised)


def test_a_burst_is_revised_once_per_prediction_its_mates_share_and_as_if_one_by_one() -> None:
    analytics = make_decider("analytics")
    state, seq = analytics.initial_state(), 1
    state = analytics.evolve(state, seq, _node())
    for i in range(200):  # a sweep of 200 alike jobs, submitted within seconds
        spec = ev.JobSpec(name="sweep", user="bo", gpus=1, duration_s=50)
        seq += 1
        state = analytics.evolve(
            state, seq, ev.JobSubmitted(id=f"s{i}", at=i / 10, job=f"b{i}", spec=spec, intake_source="t")
        )
    state, seq, _ = _b0_runs(analytics, state, seq, 30.0, 80.0)
    mates = state.model.mates("b0")
    assert len(mates) == 199
    # Half the mates hold the default prediction, half one already close to what the burst says.
    current = {m: (3600.0, 0.0) if i % 2 else (50.0, 0.5) for i, m in enumerate(mates)}
    asked: list[tuple[float, float]] = []

    def moved(before: tuple[float, float], seconds: float, sigma: float) -> bool:
        asked.append(before)
        return abs(math.log(seconds / before[0])) > 1.0

    revised = state.model.revise(current, moved)
    assert sorted(set(asked)) == sorted(set(current.values())) and len(asked) == 2
    one_by_one = {}
    for mate, before in current.items():
        one_by_one.update(state.model.revise({mate: before}, moved))
    assert revised == one_by_one
    assert set(revised) == {m for m, before in current.items() if before[0] == 3600.0}


def test_the_model_is_deterministic_and_its_compiled_trees_match_lightgbm() -> None:
    jobs = _jobs(700, seed=1)
    first, second = DurationModel(refit_every=200), DurationModel(refit_every=200)
    a = evaluate(jobs, first)[1]
    b = evaluate(jobs, second)[1]
    np.testing.assert_array_equal(a, b)
    assert first.booster == second.booster and first.version == second.version >= 2
    rows = np.asarray([r[:-1] for r in first.rows], dtype=np.float64)
    rows[::3, FEATURES.index("hour")] = np.nan  # missing values take the trees' default ways
    rows[::5, FEATURES.index("burst.position")] = 0.0
    reference = lightgbm.Booster(model_str=first.booster).predict(rows)
    compiled = first.compiled()
    np.testing.assert_allclose([compiled.predict(list(r)) for r in rows], reference, rtol=0, atol=1e-12)


def test_a_snapshot_of_the_model_predicts_what_the_model_did() -> None:
    analytics = make_decider("analytics")
    model = DurationModel(refit_every=100)
    evaluate(_jobs(400, seed=2), model)
    state = analytics.initial_state()
    state.model = model
    copy = analytics.decode_state(analytics.encode_state(state)).model
    f = Features(vc="v", gpus=2, at=1.6e9)
    assert copy.predict(f) == model.predict(f)


def test_quantiles_of_a_prediction() -> None:
    model = DurationModel(learner="ladder")
    guess = model.predict(Features(vc="v", gpus=1))
    assert guess.sigma > 0 and guess.quantile(0.5) == guess.seconds
    assert guess.quantile(0.9) == pytest.approx(guess.seconds * math.exp(1.2815515655 * guess.sigma), rel=1e-6)
    assert guess.quantile(0.1) < guess.seconds < guess.quantile(0.9)


def test_the_groups_a_burst_keeps_revise_as_every_mate_weighed_one_by_one_would_also_after_a_snapshot() -> None:
    """The decider revises an end's mates from the groups the model keeps (burst, mu, error key,
    prediction in force). At every end it must decide what weighing each open mate with a recorded
    prediction would (``mates`` + ``revise``), in submission order, also on a state read back from a
    snapshot (the groups are part of it)."""
    analytics = make_decider("analytics")
    state, seq = analytics.initial_state(), 1
    state = analytics.evolve(state, seq, _node())
    rng = np.random.default_rng(3)
    submitted: list[str] = []
    ended: set[str] = set()
    revisions = 0
    clock = 0.0

    def fold(event: ev.Event) -> list[ev.Event]:
        nonlocal state, seq
        seq += 1
        state = analytics.evolve(state, seq, event)
        return analytics.decide(state, event)

    for step in range(240):
        clock += 0.5
        if step % 3 != 2 or not submitted:  # a sweep keeps arriving while its first jobs end
            job = f"b{len(submitted)}"
            spec = ev.JobSpec(name="sweep", user="bo", gpus=1, duration_s=50)
            for made in fold(ev.JobSubmitted(id=f"s{job}", at=clock, job=job, spec=spec, intake_source="t")):
                fold(made)
            submitted.append(job)
            continue
        job = next(j for j in submitted if j not in ended)
        ended.add(job)
        runs = float(rng.choice([20.0, 60.0, 400.0]))
        allocation = (ev.Allocation(node="n1", gpus=(0,)),)
        fold(ev.JobPlaced(id=f"p{job}", at=clock, job=job, attempt=0, allocations=allocation))
        fold(ev.JobStarted(id=f"st{job}", at=clock, job=job, attempt=0, node="n1"))
        end = ev.JobFinished(id=f"f{job}", at=clock + runs, job=job, attempt=0, outcome="completed")
        seq += 1
        state = analytics.evolve(state, seq, end)
        if step == 120:  # from here on, a state read back from its snapshot
            state = analytics.decode_state(analytics.encode_state(state))
        current = {m: state.predicted[m] for m in state.model.mates(job) if m in state.predicted}
        expected = list(state.model.revise(current, _moved))
        decided = analytics.decide(state, end)
        assert [e.job for e in decided] == expected
        revisions += len(decided)
        for made in decided:
            fold(made)
    assert revisions > 50, "(the mates' predictions did move, in groups of several)"
    assert set(state.model.grouped) == set(submitted) - ended  # (an ended job leaves its group)


def test_a_submission_stored_earlier_than_its_burst_s_first_is_predicted_not_a_crash() -> None:
    """JobSubmitted.at is when the intake stream stored it: after a leader change to a server whose
    clock is behind, a burst-mate may carry an earlier time than the burst's first job."""
    analytics = make_decider("analytics")
    state = analytics.initial_state()
    spec = ev.JobSpec(name="sweep", user="bo", gpus=1, duration_s=50)
    for seq, (job, at) in enumerate((("b0", 1000.0), ("b1", 995.0)), start=1):
        submitted = ev.JobSubmitted(id=f"s{job}", at=at, job=job, spec=spec, intake_source="t")
        state = analytics.evolve(state, seq, submitted)
        (made,) = analytics.decide(state, submitted)
        assert made.seconds == pytest.approx(3600.0)  # nothing known: the default


def test_generated_trees_take_every_way_a_missing_value_can_go_as_the_walk_does() -> None:
    """Each split mode (a missing value as 0.0; NaN left or right; NaN or zero left or right) on
    rows of NaN, zeros, the threshold itself and either side of it: the generated function and the
    node-by-node walk give the same float."""
    from services.analytics.predict import Trees, _compile

    def stump(mode: int, threshold: float) -> tuple:
        # feature 0 at the root, two leaves
        return [0], [threshold], [-1], [-2], [mode], [1.5, -2.25]

    trees = [stump(mode, threshold) for mode in (0, 1, 2, 5, 6) for threshold in (-0.5, 0.0, 0.75)]
    trees.append(([0], [math.inf], [-1], [-1], [0], [0.125]))  # a tree of one leaf
    walker = Trees.__new__(Trees)
    walker.trees = trees
    generated = _compile(trees)
    assert generated is not None
    for value in (math.nan, 0.0, -0.0, 1e-36, -0.5, 0.0, 0.75, -1.0, 2.0, 0.3):
        assert generated([value]) == walker.walk([value]), value
    one = [stump(1, 0.0)[0], [0.0], [-1], [-2], [7], [1.0, 2.0]]
    assert _compile([tuple(one)]) is None  # a mode it does not know: walked instead


@pytest.mark.parametrize("zero_as_missing", [False, True])
def test_trees_read_from_the_model_text_predict_what_lightgbm_does(zero_as_missing: bool) -> None:
    """The trees are read from the model's text, not from LightGBM's JSON dump: every way a missing
    value or a zero can go, on rows that hold both."""
    from services.analytics.predict import Trees

    rng = np.random.default_rng(5)
    x = rng.normal(size=(2000, 4))
    x[::4, 1], x[::3, 2] = np.nan, 0.0
    y = 2 * x[:, 0] + np.nan_to_num(x[:, 1]) + x[:, 2]
    params = {"objective": "regression_l1", "num_leaves": 15, "min_data_in_leaf": 20, "verbosity": -1}
    booster = lightgbm.train({**params, "zero_as_missing": zero_as_missing}, lightgbm.Dataset(x, label=y), 20)
    rows = rng.normal(size=(500, 4))
    rows[::3, 1], rows[::5, 2], rows[::7, 0] = np.nan, 0.0, np.nan
    trees = Trees(booster.model_to_string())
    np.testing.assert_allclose([trees.predict(list(r)) for r in rows], booster.predict(rows), rtol=0, atol=1e-12)
    assert [trees.predict(list(r)) for r in rows] == [trees.walk(list(r)) for r in rows]


def test_what_the_model_works_out_of_its_history_stays_in_step_with_it() -> None:
    """The model keeps each history key's median, spread, last value and count between submissions
    (not in its state). Interleaving ends and submissions of shared keys, it must predict what a
    copy of it read back from its encoding, which works everything out afresh, predicts."""
    model = DurationModel(learner="ladder", min_samples=2)
    rng = np.random.default_rng(7)
    for n in range(300):
        f = Features(vc=f"v{n % 3}", gpus=int(rng.choice([1, 2, 4])), user=f"u{n % 5}", name=f"j{n % 7}", at=1.6e9 + n)
        model.submit(f"job{n}", f)
        if n % 2:
            model.observe(f"job{n - 1}", f, float(rng.lognormal(6, 1)))
        fresh = msgspec.msgpack.decode(msgspec.msgpack.encode(model), type=DurationModel)  # (as a snapshot)
        assert "stats" not in fresh.__dict__
        assert fresh.predict(f) == model.predict(f)


def test_trees_too_deep_to_nest_are_walked() -> None:
    """A tree deeper than a generated function may nest (Python's parser limits nesting) is not
    compiled: the model walks its trees instead, with the same result."""
    from services.analytics.predict import _MAX_NESTING, Trees, _compile

    def chain(depth: int) -> tuple:  # each split sends the row left to a leaf or right to the next
        right = [*range(1, depth), -(depth + 1)]
        return (
            [0] * depth,
            [float(i) for i in range(depth)],
            [-(i + 1) for i in range(depth)],
            right,
            [1] * depth,
            [float(i) for i in range(depth + 1)],
        )

    shallow, deep = chain(_MAX_NESTING), chain(_MAX_NESTING + 1)
    walker = Trees.__new__(Trees)
    walker.trees = [shallow]
    generated = _compile([shallow])
    assert generated is not None and generated([50.5]) == walker.walk([50.5]) == 51.0
    assert _compile([shallow, deep]) is None


def test_a_model_of_a_kind_the_duration_model_never_fits_is_refused_not_evaluated_wrongly() -> None:
    from services.analytics.predict import Trees, UnsupportedModel

    rng = np.random.default_rng(9)
    x = np.column_stack([rng.integers(0, 5, 1000), rng.normal(size=1000)])
    y = (x[:, 0] == 2) * 3.0 + x[:, 1]
    params = {"objective": "regression", "num_leaves": 7, "min_data_in_leaf": 20, "verbosity": -1}
    booster = lightgbm.train(params, lightgbm.Dataset(x, label=y, categorical_feature=[0]), 5)
    with pytest.raises(UnsupportedModel, match="categorical"):
        Trees(booster.model_to_string())
