"""A simulation that keeps no log (``keep_log=False``) gives the job table and the event digest of
one that keeps it, for one shared pool and for VCs partitioned over processes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pandas as pd
import pytest

from apps.sim.cluster import ClusterSpec
from apps.sim.helios import helios_workload
from apps.sim.model import GPUHERD, HELIOS, SimModel
from apps.sim.run import simulate
from services.analytics.jobs import job_table
from services.analytics.traces import load_trace, submissions, vc_peak_demand

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "philly-sample.csv"


def digest_of(records: list) -> str:
    encode = msgspec.msgpack.Encoder().encode
    h = hashlib.blake2b(digest_size=12)
    for record in records:
        h.update(encode(record.event))
    return h.hexdigest()


@pytest.mark.parametrize("model", [GPUHERD, HELIOS], ids=["shared-pool", "partitioned"])
def test_a_run_without_its_log_has_the_same_table_and_digest(model: SimModel) -> None:
    trace = load_trace(SAMPLE)
    if model.partition_vcs:
        trace, cluster = helios_workload(trace)
    else:
        cluster = ClusterSpec.from_peaks(vc_peak_demand(trace), scale=0.5)
    run = {"start": trace.origin, "model": model, "digest": True}
    kept = simulate(submissions(trace, start=trace.origin), cluster, "sjf", keep_log=True, **run)
    streamed = simulate(submissions(trace, start=trace.origin), cluster, "sjf", keep_log=False, **run)
    assert streamed.records == [] and all(log == [] for log in streamed.logs.values())
    assert streamed.events == kept.events == len(kept.records)
    assert streamed.digest == kept.digest
    pd.testing.assert_frame_equal(streamed.table.jobs, kept.table.jobs)
    pd.testing.assert_frame_equal(kept.table.jobs, job_table(kept.records).jobs)  # built as it ran = folded after
    if not model.partition_vcs:
        assert kept.digest == digest_of(kept.records)
    else:
        assert kept.digest != digest_of(kept.records)  # (partitioned: a digest of each VC's digest)
