"""Review of the duration model's burst features: what a job learns from is what it is asked with."""

from __future__ import annotations

import math

from services.analytics.predict import FEATURES, DurationModel, Features

GAP = FEATURES.index("burst.gap_s")


def test_the_gap_since_the_previous_submission_of_a_key_is_a_feature_of_every_submission() -> None:
    # The same key submitted at 0, 10, 30, then 500 (a new burst): each submission's training row holds
    # the gap since the one before it, as ``predict`` (which asks without remembering) reads it.
    model = DurationModel(learner="ladder")
    times = [0.0, 10.0, 30.0, 500.0]
    gaps = []
    for n, at in enumerate(times):
        f = Features(vc="a", gpus=1, user="u", at=at)
        asked = model.features(f)[GAP]  # (what ``predict`` reads)
        model.submit(str(n), f)
        gaps.append(model.pending[str(n)].x[GAP])
        assert gaps[-1] == asked or (math.isnan(asked) and math.isnan(gaps[-1]))
    assert math.isnan(gaps[0])  # (no earlier submission of the key)
    assert gaps[1:] == [math.log1p(10.0), math.log1p(20.0), math.log1p(470.0)]
