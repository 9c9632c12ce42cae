"""Where a decision's time goes: per-batch stage times of a live decider, written as JSON lines.

Off unless ``GPUHERD_STAGE_TRACE_DIR`` names a directory (``bench/bench_load.py --trace-decisions``
sets it); then each decider writes ``<dir>/<decider>.jsonl``, one line per decided batch, for its
first ``GPUHERD_STAGE_TRACE_MAX`` batches (default 20,000). Times are the wall clock (``time.time``,
seconds) so that they compare with the log's own stored times and the submitter's clock on the same
machine. A line:

``{"arrived": [...], "causes": [...], "stored": [...], "outputs": [[[id, job], ...], ...], "start": t,
"decided": t, "acked": t, "folded": t}``

``arrived``: when each input reached the core (a record folded, a submission fetched); ``stored``:
when the log stored each cause; ``outputs``: each cause's decisions (their ids and jobs);
``start``/``decided``: the core's decision; ``acked``: the log acknowledged the batch's append;
``folded``: the decider folded its own outputs back (from then on what they could change is decidable).
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

TRACE_DIR_ENV = "GPUHERD_STAGE_TRACE_DIR"
TRACE_MAX_ENV = "GPUHERD_STAGE_TRACE_MAX"
_encoder = msgspec.json.Encoder()


class BatchTrace(msgspec.Struct):
    arrived: list[float]
    causes: list[str]
    stored: list[float | None]
    start: float
    decided: float
    acked: float = 0.0
    folded: float = 0.0
    outputs: list[list[tuple[str, str | None]]] = []
    last_seq: int = 0


class StageTracer:
    """Collects ``BatchTrace`` lines for one decider and writes each once its outputs fold back."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path = path
        self.limit = limit
        self.written = 0
        self._file: IO[bytes] | None = None
        self._open: list[BatchTrace] = []  # appended, not folded back yet
        # ``perf_counter`` stamps (the core's) -> wall clock
        self._offset = time.time() - time.perf_counter()

    @classmethod
    def from_env(cls, decider: str) -> StageTracer | None:
        directory = os.environ.get(TRACE_DIR_ENV)
        if not directory:
            return None
        return cls(Path(directory) / f"{decider}.jsonl", int(os.environ.get(TRACE_MAX_ENV, "20000")))

    @property
    def active(self) -> bool:
        return self.written + len(self._open) < self.limit

    def wall(self, perf: float) -> float:
        return perf + self._offset

    def decided(self, batch: Sequence[Any], start: float, decided: float) -> BatchTrace:
        """A batch of ``Decided`` (runtime.core) decided between ``start`` and ``decided`` (wall)."""
        causes, stored = [], []
        for item in batch:
            cause = item.cause
            event = getattr(cause, "event", None)
            causes.append(event.id if event is not None else str(getattr(cause, "cause", cause)))
            stored.append(getattr(cause, "stored_at", None) if event is not None else getattr(cause, "at", None))
        outputs = [[(out.id, getattr(out, "job", None)) for out in item.outputs] for item in batch]
        return BatchTrace([self.wall(i.arrived) for i in batch], causes, stored, start, decided, outputs=outputs)

    def appended(self, trace: BatchTrace, seqs: Sequence[int], acked: float) -> None:
        trace.acked = acked
        trace.last_seq = max(seqs, default=0)
        if trace.last_seq:
            # (Several batches may be appended at once: kept in the order their outputs fold back.)
            bisect.insort(self._open, trace, key=lambda t: t.last_seq)
        else:
            self._write(trace)

    def folded(self, seq: int) -> None:
        """The decider folded the record at ``seq``: write the batches whose outputs it completes."""
        if not self._open or self._open[0].last_seq > seq:
            return
        now = time.time()
        while self._open and self._open[0].last_seq <= seq:
            trace = self._open.pop(0)
            trace.folded = now
            self._write(trace)

    def _write(self, trace: BatchTrace) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
        self._file.write(_encoder.encode(trace) + b"\n")
        self._file.flush()
        self.written += 1


def read_traces(path: Path) -> list[BatchTrace]:
    """The lines a ``StageTracer`` wrote (none if it wrote nothing)."""
    if not path.exists():
        return []
    decoder = msgspec.json.Decoder(BatchTrace)
    return [decoder.decode(line) for line in path.read_bytes().splitlines() if line.strip()]
