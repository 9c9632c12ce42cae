"""The dashboard, as a service: a reader of the log serving a live web UI and JSON API. It
decides nothing and needs no leadership: any number may run. Its pages' operator actions (cancel a
job, drain and undrain a node) are operator commands, sent only for a request carrying its token."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpuherd.log import CONTROL_PREFIX, STATUS_BUCKET
from gpuherd.runtime.spec import BACKGROUND_NICE, LocalContext, ServiceSpec
from gpuherd.security import Permissions, inbox, kv_write, read_log

# The HERD subjects of the operator commands it offers (JobCancelRequested, NodeDrained,
# NodeUndrained): each aggregate's own subject, never an agent's ``.by.<node>`` one.
APPENDS = ("herd.job.*", "herd.node.*")
# People read its pages: a change shown 50 ms later is not seen later, and reading the log in
# batches that far apart spares a host it shares with the scheduler a wake-up for every job event.
READ_LINGER_S = 0.05


def permissions(_: str) -> Permissions:
    """What the reader may, the operator commands of its pages, and its own status entry."""
    publish = (*read_log(), f"{CONTROL_PREFIX}.>", *APPENDS, kv_write(STATUS_BUCKET, "dashboard.>"))
    return Permissions(publish=publish, subscribe=(inbox("dashboard"),))


def main(argv: list[str] | None = None, *, peers: Sequence[ServiceSpec] = ()) -> None:
    # The web server (aiohttp) is imported by the dashboard's process alone, not by every process
    # that looks its spec up.
    from services.dashboard import service

    service.main(argv, peers=peers)


def build_parser() -> argparse.ArgumentParser:
    from services.dashboard import service

    return service.build_parser()


def local_argv(ctx: LocalContext) -> list[str] | None:
    """Served on ``ui_port`` (0: any free one; None: no dashboard), its URL written to ``url_file``."""
    if ctx.option("ui_port") is None:
        return None
    argv = ["--port", str(ctx.option("ui_port")), "--report-dir", str(ctx.data_dir / "report")]
    argv += ["--url-file", str(ctx.option("url_file", ctx.data_dir / "dashboard.url"))]
    token = ctx.option("ui_token_file")
    return argv + (["--operator-token-file", token] if token else [])


SPEC = ServiceSpec(
    name="dashboard",
    about="the live web dashboard and its JSON API (a reader of the log)",
    role="reader",
    follows=frozenset(),
    emits=frozenset(),  # (its operator actions are operator commands, as the CLI's)
    permissions=permissions,
    main=main,
    parser=build_parser,
    local_argv=local_argv,
    required=False,
    read_linger_s=READ_LINGER_S,
    nice=BACKGROUND_NICE,
)
