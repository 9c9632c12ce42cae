"""Small statistics shared by services: the quantiles of a log-normal duration prediction
(``JobDurationPredicted``: median ``seconds``, log-spread ``sigma``)."""

from __future__ import annotations

import math
import statistics

_Z: dict[float, float] = {0.5: 0.0}


def quantile_s(median_s: float, sigma: float, q: float) -> float:
    """The ``q`` quantile of a log-normal of median ``median_s`` and log-spread ``sigma``."""
    if sigma <= 0 or q == 0.5:
        return median_s
    z = _Z.get(q)
    if z is None:
        z = _Z[q] = statistics.NormalDist().inv_cdf(min(max(q, 1e-6), 1 - 1e-6))
    return median_s * math.exp(z * sigma)
