"""Names on NATS: the streams, their subjects, the KV buckets and the message headers.

- ``HERD``: state changes, one subject per aggregate (``herd.job.<id>``, ...).
- ``HERD_INTAKE`` (``herd.intake.<source>``): raw submissions from other systems.
- ``HERD_TELEMETRY`` (``herd.telemetry.>``): heartbeats and samples, limited retention.
- ``HERD_DEAD`` (``herd.dead.<consumer>``): dead letters, messages a consumer could not handle.

Plus three KV buckets (decider snapshots, leader leases, what each running service says about
itself) and core request-reply on ``herd.ctl.>`` for questions to a live service.
"""

from __future__ import annotations

from collections.abc import Mapping

HERD = "HERD"
HERD_INTAKE = "HERD_INTAKE"
HERD_TELEMETRY = "HERD_TELEMETRY"
HERD_DEAD = "HERD_DEAD"

# Subjects of the HERD stream: one prefix per aggregate kind. The intake and
# telemetry prefixes are separate streams, so HERD cannot simply take herd.>.
HERD_SUBJECTS = (
    "herd.job.>",
    "herd.node.>",
    "herd.vc.>",
    "herd.rejected.>",
    "herd.cluster.>",
    "herd.clock.>",
    "herd.lease.>",
)
INTAKE_PREFIX = "herd.intake"
TELEMETRY_PREFIX = "herd.telemetry"
CONTROL_PREFIX = "herd.ctl"
DEAD_LETTER_PREFIX = "herd.dead"

SNAPSHOT_BUCKET = "herd_snapshots"
LEADERSHIP_BUCKET = "herd_leases"  # (its stored name predates the word: a running older process must see the same keys)
STATUS_BUCKET = "herd_services"

TRACEPARENT = "traceparent"
REPLY_HEADER = "Gpuherd-Reply-To"
# More inboxes, comma-separated, that wait for the same verdict: plain requests that retried one
# submission under its Nats-Msg-Id (the stream keeps one copy; each sender hears the verdict).
ALSO_REPLY_HEADER = "Gpuherd-Reply-Also"


def reply_inboxes(headers: Mapping[str, str]) -> list[str]:
    """Every inbox an intake message's verdict goes to (none: a plain publish)."""
    first = headers.get(REPLY_HEADER)
    more = [inbox for inbox in headers.get(ALSO_REPLY_HEADER, "").split(",") if inbox]
    return [first, *more] if first else more


MAX_DELIVERIES = 5  # an intake message whose handling failed this often goes to the dead letters
