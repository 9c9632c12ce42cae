"""The real public traces beside the project (``../shared/traces``) that the benches replay.

Each has submit times and durations. ``SCALE`` is the contended size the benches judge policies
at: each VC at this fraction of its own peak demand (philly.csv's VCs are larger, so less is cut).
"""

from __future__ import annotations

from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
SHARED = {
    "philly": TRACES / "philly" / "philly.csv",
    **{f"cluster0{i}": TRACES / "itp" / f"cluster0{i}.csv" for i in range(1, 6)},
    "alibaba-openb": TRACES / "alibaba-openb" / "openb_pod_list_default.csv",
}
SCALE = {"philly": 0.25}
DEFAULT_SCALE = 0.2


def scale_of(name: str) -> float:
    return SCALE.get(name, DEFAULT_SCALE)
