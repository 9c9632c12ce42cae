"""The report relay, as a service: it stores node agents' reports for them, many in one commit, so
a busy cluster's reports cost the log one disk sync per batch instead of one each.

It decides nothing and folds nothing; any number may run (they share the reports). An agent falls
back to appending its reports itself when no relay answers, so a deployment without one works, only
with more syncs. Its NATS user may append exactly what agents may (``REPORT_SUBJECTS``, any node),
and its pages of them (``RELAYED_SUBJECT``, which no one else may write); it stores for each node
only what that node's agent may write itself."""

from __future__ import annotations

from gpuherd.log import STATUS_BUCKET
from gpuherd.log.relay import RELAYED_SUBJECT, REPORT_PREFIX, subjects_of
from gpuherd.runtime.spec import ServiceSpec
from gpuherd.security import Permissions, inbox, kv_write, read_log
from services.relay import relay


def permissions(_: str) -> Permissions:
    """Every agent's report subjects and its pages of them; the stream's description (its
    positions); its status entry; the reports (``herd.report.*``), which it answers."""
    publish = (*subjects_of("*"), RELAYED_SUBJECT, *read_log(), kv_write(STATUS_BUCKET, "relay.>"))
    return Permissions(publish=publish, subscribe=(inbox("relay"), f"{REPORT_PREFIX}.*"), allow_responses=True)


SPEC = ServiceSpec(
    name="relay",
    about="stores the node agents' reports many at a time (one disk sync for many)",
    role="proxy",
    follows=frozenset(),
    emits=frozenset(),  # (it stores the agents' events for them; they are the agents')
    permissions=permissions,
    main=relay.main,
    parser=relay.build_parser,
    local_argv=lambda ctx: [],
    required=False,  # (without one, agents append their reports themselves)
)
