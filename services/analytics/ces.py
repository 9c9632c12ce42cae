"""Cluster energy saving (Helios' CES): forecast how many GPU nodes demand will need, and power
the rest down, keeping a safety buffer.

Demand is a count of nodes: those running any job, plus the nodes the jobs waiting for GPUs
would fill. The forecast of the peak demand over the next ``horizon_s`` is the peak over the
last ``lookback_s`` (demand rarely jumps by more than the buffer within the hour); with
``seasonal`` also the peak in the same window one day and one week earlier, so a rise the
daily or weekly cycle predicts is powered for before it arrives. On the Philly node sequence
the seasonal forecast overshoots (MAE 32 vs 5 nodes) and keeps 30 fewer nodes off for fewer
waits; ``evaluate_sequence`` measures both. The controller keeps ``forecast + buffer_nodes`` nodes powered and
changes the count at most every ``min_interval_s`` (each change costs boot time and wear), but
never waits to power nodes up when the forecast rises above what is powered.

Why not LightGBM, as the Helios artifact does? The forecaster must run inside a pure decider
on every tick and replay identically; the seasonal-peak rule is cheap, has no training step,
and ``evaluate_sequence`` reports how it does on the Philly node sequence against the
published reference numbers.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from gpuherd.errors import GpuherdError

if TYPE_CHECKING:
    import pandas as pd

DAY_S = 86400.0
WEEK_S = 7 * DAY_S
MAX_NODES = 10_000_000  # in a node sequence's counts: beyond any cluster, and far from int64's end


class NodeSequenceError(GpuherdError, ValueError):
    """A node sequence (``time,active,total``) that cannot be replayed: missing, unreadable, empty."""


class CesParamsError(GpuherdError, ValueError):
    """CES parameters that would power down nodes the forecast says are needed. (A ValueError, so
    ``msgspec.convert`` reports it as a ValidationError, as it does a wrong type.)"""


class CesParams(msgspec.Struct, frozen=True, kw_only=True):
    horizon_s: float = 3600.0  # the forecast covers this much of the future
    lookback_s: float = 3600.0  # recent peak window
    buffer_nodes: int = 20  # powered nodes beyond the forecast (Helios: 20 of 420)
    min_interval_s: float = 4 * 3600.0  # between two power-downs
    sample_s: float = 60.0  # demand history resolution
    history_s: float = 8 * DAY_S  # enough for the weekly look-back
    boot_s: float = 300.0  # a node's power-up time (used by the offline evaluation)
    seasonal: bool = False  # also look at the same window a day and a week ago

    def __post_init__(self) -> None:
        # A negative buffer keeps fewer nodes powered than the forecast; a negative window (or a
        # look-back shorter than a sample) holds no sample, and forecasts 0 nodes: either powers
        # down capacity that demand needs.
        if self.buffer_nodes < 0:
            raise CesParamsError(f"buffer_nodes is a number of nodes >= 0, got {self.buffer_nodes}")
        for name in ("horizon_s", "lookback_s", "min_interval_s", "sample_s", "history_s", "boot_s"):
            seconds = getattr(self, name)
            if not seconds >= 0:  # (NaN too)
                raise CesParamsError(f"{name} is seconds >= 0, got {seconds}")
        if self.lookback_s < self.sample_s:
            raise CesParamsError(
                f"lookback_s ({self.lookback_s:g}) must be at least sample_s ({self.sample_s:g}): a shorter "
                "look-back can hold no sample, and forecast no demand"
            )


class DemandHistory(msgspec.Struct, kw_only=True):
    """Sampled demand (nodes), oldest first, bounded to ``history_s``."""

    times: list[float] = msgspec.field(default_factory=list)
    nodes: list[int] = msgspec.field(default_factory=list)

    def record(self, at: float, nodes: int, params: CesParams) -> bool:
        """Add a sample unless the last one is younger than ``sample_s``; True if added."""
        if self.times and at - self.times[-1] < params.sample_s:
            if nodes > self.nodes[-1]:
                self.nodes[-1] = nodes  # keep the peak of the sample interval
            return False
        self.times.append(at)
        self.nodes.append(nodes)
        cut = bisect.bisect_left(self.times, at - params.history_s)
        if cut:
            del self.times[:cut]
            del self.nodes[:cut]
        return True

    def peak(self, start: float, end: float) -> int | None:
        lo = bisect.bisect_left(self.times, start)
        hi = bisect.bisect_right(self.times, end)
        return max(self.nodes[lo:hi]) if hi > lo else None


def forecast_peak(history: DemandHistory, now: float, params: CesParams) -> int:
    """The peak demand (nodes) expected over ``[now, now + horizon_s]``."""
    candidates = [history.peak(now - params.lookback_s, now)]
    if params.seasonal:
        for period in (DAY_S, WEEK_S):
            candidates.append(history.peak(now - period, now - period + params.horizon_s))
    known = [c for c in candidates if c is not None]
    return max(known) if known else 0


def target_powered(forecast: int, total: int, params: CesParams) -> int:
    return min(total, forecast + params.buffer_nodes)


@dataclass(frozen=True)
class PowerPlan:
    down: int  # nodes to power down now
    up: int  # nodes to power up now


def plan_power(
    powered: int, total: int, forecast: int, now: float, last_down_at: float, params: CesParams
) -> PowerPlan:
    """How many nodes to switch, given the powered ones (on or booting) and the forecast."""
    target = target_powered(forecast, total, params)
    slack = params.buffer_nodes // 2
    # A band around the target, so small wobbles of the forecast change nothing: power up once
    # the forecast eats half the buffer, power down once the excess is more than half a buffer.
    if powered < target - slack or (powered < target and forecast >= powered):
        return PowerPlan(down=0, up=target - powered)
    if powered > target + slack and now - last_down_at >= params.min_interval_s:
        return PowerPlan(down=powered - target, up=0)
    return PowerPlan(down=0, up=0)


# -- offline evaluation on a node sequence ---------------------------------------------------------


@dataclass(frozen=True)
class CesReport:
    minutes: int
    forecast_mae_nodes: float  # |forecast peak - actual peak| over each horizon, mean
    forecast_wape: float  # sum of absolute errors / sum of actual peaks
    under_forecast_share: float  # decisions whose forecast fell short of the actual peak
    mean_nodes_total: float
    mean_nodes_off: float
    changes_per_day: float
    utilization_before: float  # active / total
    # Demand served by booted nodes / powered nodes. Demand beyond the booted nodes waits (counted
    # below), so it is not utilization: counting it made this exceed 100% while nodes booted.
    utilization_after: float
    wait_node_minutes: float  # node-minutes of demand that found no powered node
    waits: int  # episodes in which demand exceeded the powered nodes
    mean_wait_s: float  # how long such an episode lasted (boot time included)

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("minutes replayed", f"{self.minutes:,}"),
            ("forecast MAE (nodes, peak over the horizon)", f"{self.forecast_mae_nodes:.1f}"),
            ("forecast WAPE (sum of errors / sum of peaks)", f"{self.forecast_wape:.1%}"),
            ("forecasts below the actual peak", f"{self.under_forecast_share:.1%}"),
            ("mean nodes in the cluster", f"{self.mean_nodes_total:.1f}"),
            ("mean nodes powered down", f"{self.mean_nodes_off:.1f}"),
            ("node-count changes per day", f"{self.changes_per_day:.2f}"),
            ("node utilization before (active/total)", f"{self.utilization_before:.1%}"),
            ("node utilization after (served/powered)", f"{self.utilization_after:.1%}"),
            ("node-minutes of demand without a powered node", f"{self.wait_node_minutes:,.0f}"),
            ("episodes of demand waiting for power-up", f"{self.waits:,}"),
            ("mean wait for a node to power up (s)", f"{self.mean_wait_s:,.0f}"),
        ]


def load_node_sequence(path: str) -> pd.DataFrame:
    """``time,active,total`` per minute (Helios' CES input)."""
    import pandas as pd  # only offline: the live service (which imports this module) never loads pandas

    try:
        df = pd.read_csv(path)
    except FileNotFoundError:
        raise NodeSequenceError(f"{path}: no such node sequence file") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise NodeSequenceError(f"{path}: not a readable CSV node sequence ({exc})") from None
    missing = {"time", "active", "total"} - set(df.columns)
    if missing:
        raise NodeSequenceError(f"{path}: missing columns {', '.join(sorted(missing))}")
    if df.empty:
        raise NodeSequenceError(f"no usable rows in {path}: it has a header and no rows (time,active,total per minute)")
    when = pd.to_datetime(df["time"], utc=True, errors="coerce")
    df["t"] = (when - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    counts = df[["active", "total"]].apply(pd.to_numeric, errors="coerce")
    _refuse_rows(
        path, df["t"].isna() | counts.isna().any(axis=1), "lack a readable time or a number of active or total nodes"
    )
    active, total = counts["active"], counts["total"]
    # Counts are cast to int64, where inf, 1e30 or 3.5 became other numbers without a word (a
    # utilization of 7.7e19%), and a negative count is no number of nodes.
    whole = (counts == np.floor(counts)).all(axis=1) & (counts.abs() <= MAX_NODES).all(axis=1)
    _refuse_rows(path, ~whole, f"hold a count of nodes that is not a whole number from 0 to {MAX_NODES:,}")
    _refuse_rows(path, (active < 0) | (total < 1), "hold fewer than 0 active or 1 total nodes")
    _refuse_rows(path, active > total, "hold more active nodes than the cluster's total")
    # The replay looks up windows by time (bisect): rows out of order would be windows of other minutes.
    _refuse_rows(path, df["t"].diff() <= 0, "are not later than the row before them (times must increase)")
    df["active"] = active.astype("int64")
    df["total"] = total.astype("int64")
    return df


def _refuse_rows(path: str, bad: pd.Series, what: str) -> None:
    """A NodeSequenceError when any row is ``bad``: how many, and the line of the first."""
    if bad.any():  # (line 1 is the header)
        raise NodeSequenceError(
            f"{path}: {int(bad.sum()):,} of its rows {what} (the first on line {int(bad.to_numpy().argmax()) + 2})"
        )


def evaluate_sequence(
    seq: pd.DataFrame, params: CesParams | None = None, *, decide_every_s: float = 600.0
) -> CesReport:
    """Replay a node sequence through the forecaster and controller above.

    Every ``decide_every_s`` the controller sees the demand so far and sets the powered count;
    powering up takes ``boot_s``. Demand above the powered nodes waits (the jobs behind it wait
    for a node to boot): counted as node-minutes and as episodes with their length."""
    params = params or CesParams()
    if not 0 < decide_every_s < math.inf:  # (NaN never came due: no decision at all; 0 at every row)
        raise CesParamsError(f"the controller decides every so many seconds > 0, got {decide_every_s}")
    if len(seq) == 0:  # (there is no first minute to start from)
        raise NodeSequenceError("an empty node sequence: no minute to replay")
    times = seq["t"].to_numpy(dtype="float64")
    active = seq["active"].to_numpy(dtype="int64")
    total = seq["total"].to_numpy(dtype="int64")
    history = DemandHistory()
    powered = int(total[0])
    ready = powered  # powered and booted
    booting: list[tuple[float, int]] = []  # (ready at, nodes)
    last_down = -math.inf
    next_decision = times[0]
    changes = 0
    errors: list[float] = []
    actual_sum: list[int] = []
    under = 0
    powered_series = np.empty(len(times))
    served = 0  # node-minutes of demand that booted nodes ran
    wait_node_minutes = 0.0
    episodes: list[float] = []
    episode_start: float | None = None
    for i, now in enumerate(times):
        history.record(now, int(active[i]), params)
        while booting and booting[0][0] <= now:
            ready += booting.pop(0)[1]
        if now >= next_decision:
            next_decision = now + decide_every_s
            forecast = forecast_peak(history, now, params)
            end = bisect.bisect_right(times, now + params.horizon_s)
            actual = int(active[i:end].max())
            errors.append(abs(forecast - actual))
            actual_sum.append(actual)
            under += forecast < actual
            plan = plan_power(powered, int(total[i]), forecast, now, last_down, params)
            if plan.down:
                powered -= plan.down
                ready = min(ready, powered)
                last_down = now
                changes += 1
            elif plan.up:
                powered += plan.up
                booting.append((now + params.boot_s, plan.up))
                changes += 1
        powered = min(powered, int(total[i]))
        ready = min(ready, powered)
        powered_series[i] = powered
        short = max(0, int(active[i]) - ready)
        served += int(active[i]) - short
        wait_node_minutes += short
        if short and episode_start is None:
            episode_start = now
        elif not short and episode_start is not None:
            episodes.append(now - episode_start)
            episode_start = None
    if episode_start is not None:  # still waiting when the sequence ends: an episode, as long as it went
        episodes.append(times[-1] + 60.0 - episode_start)  # (to the end of its last minute)
    days = max((times[-1] - times[0]) / DAY_S, 1e-9)
    return CesReport(
        minutes=len(times),
        forecast_mae_nodes=float(np.mean(errors)),
        forecast_wape=float(np.sum(errors) / max(np.sum(actual_sum), 1)),
        under_forecast_share=under / max(len(errors), 1),
        mean_nodes_total=float(total.mean()),
        mean_nodes_off=float((total - powered_series).mean()),
        changes_per_day=changes / days,
        utilization_before=float(active.sum() / total.sum()),
        utilization_after=float(served / max(powered_series.sum(), 1.0)),
        wait_node_minutes=wait_node_minutes,
        waits=len(episodes),
        mean_wait_s=float(np.mean(episodes)) if episodes else 0.0,
    )
