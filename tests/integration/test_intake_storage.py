"""Where submissions wait for their verdict (``GPUHERD_INTAKE_STORAGE``), on a real nats-server: a
file by default; memory only where an operator asks, kept as it is by every process that does not
ask, and never changed in place (a clear error says how)."""

from __future__ import annotations

import pytest
from nats.js.api import StorageType

from gpuherd.errors import LogError
from gpuherd.log import HERD, HERD_INTAKE, open_log, settings_from_env
from gpuherd.log.health import nats_overview
from gpuherd.natsd import NatsServer

pytestmark = pytest.mark.slow


async def _storage(url: str, stream: str) -> StorageType:
    log_ = await open_log(url, name="look")
    try:
        return StorageType((await log_.js.stream_info(stream)).config.storage)
    finally:
        await log_.close()


def test_the_setting_is_read_from_the_environment_and_checked() -> None:
    assert settings_from_env({}).intake_storage is None
    assert settings_from_env({"GPUHERD_INTAKE_STORAGE": ""}).intake_storage is None
    assert settings_from_env({"GPUHERD_INTAKE_STORAGE": "memory"}).intake_storage == "memory"
    with pytest.raises(LogError, match="GPUHERD_INTAKE_STORAGE='disk': set it to file or memory"):
        settings_from_env({"GPUHERD_INTAKE_STORAGE": "disk"})


async def test_submissions_wait_in_a_file_unless_an_operator_asks_for_memory(local_nats: NatsServer) -> None:
    log_ = await open_log(local_nats.url, name="default")
    await log_.close()
    assert await _storage(local_nats.url, HERD_INTAKE) == StorageType.FILE


async def test_a_memory_intake_is_kept_by_every_process_and_never_changed_in_place(local_nats: NatsServer) -> None:
    first = await open_log(local_nats.url, name="operator", intake_storage="memory")
    try:
        await first.publish_intake("ci", b'{"name": "a"}')
        consumer = first.intake_consumer("intake-storage-test")
        deliveries = await consumer.fetch(1, timeout=5.0)
        assert [d.data for d in deliveries] == [b'{"name": "a"}']
        overview = await nats_overview(first)
    finally:
        await first.close()
    storage = {s["name"]: s["storage"] for s in overview["streams"]}
    assert storage[HERD_INTAKE] == "memory" and storage[HERD] == "file", "the log itself stays on disk"
    assert await _storage(local_nats.url, HERD_INTAKE) == StorageType.MEMORY, "a process that does not ask keeps it"
    with pytest.raises(LogError, match=r"cannot change a stream's storage in place.*nats stream rm HERD_INTAKE"):
        await open_log(local_nats.url, name="other", intake_storage="file")
    with pytest.raises(LogError, match=r"cannot change a stream's storage in place"):  # (one that may not create)
        await open_log(local_nats.url, name="service", intake_storage="file", streams="require")
    assert await _storage(local_nats.url, HERD_INTAKE) == StorageType.MEMORY
    with pytest.raises(LogError, match="file or memory"):
        await open_log(local_nats.url, name="typo", intake_storage="memroy")
