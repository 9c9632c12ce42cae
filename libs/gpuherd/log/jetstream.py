"""EventLog on NATS JetStream.

- Streams are created idempotently (or updated when the config changed).
- ``append`` of one event is a JetStream publish with ``Nats-Msg-Id``; of
  several, one message holding them all (a *page*, ``pages.py``): one disk sync
  and one round trip, all or nothing. A page over the server's payload limit,
  or one that must check several subjects, is an atomic batch instead
  (``allow_atomic``, nats-server >= 2.12), as is every append to a log created
  before pages.
- Readers unpack pages: an event's position is its message's sequence x
  ``PAGE_SLOTS`` + its index in the message (positions = sequences on a log
  from before pages).
- ``read`` is an ordered consumer: an ephemeral pull consumer that is
  recreated from the last sequence seen whenever it breaks (server restart,
  reconnect), so a reader sees every sequence exactly once, in order.
- Snapshots and leaderships are KV buckets. A leadership is a key written with
  ``create`` (only if absent) and renewed with ``update(last=revision)``; the
  bucket's max age makes an unrenewed leadership expire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import itertools
import os
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.client import JetStreamContext

from gpuherd import events as ev
from gpuherd.aio import patiently
from gpuherd.errors import UNDECODABLE, ConcurrencyError, EventDecodeError, LeadershipLost, LogError, LogUnavailable
from gpuherd.log.interfaces import DurableConsumer, EventLog, Leadership, RequestHandler, Traces, trace_of
from gpuherd.log.ordered import ordered_messages
from gpuherd.log.pages import (
    PAGE_HEADER,
    PAGE_SLOTS,
    POSITIONS_METADATA,
    decode_page,
    decode_page_events,
    encode_page,
    page_admits,
    page_id,
)
from gpuherd.log.records import AppendResult, DeadLetter, Delivery, Record
from gpuherd.log.relay import RELAYED_SUBJECT
from gpuherd.log.streams import (
    ALSO_REPLY_HEADER,
    CONTROL_PREFIX,
    DEAD_LETTER_PREFIX,
    HERD,
    HERD_DEAD,
    HERD_INTAKE,
    HERD_SUBJECTS,
    HERD_TELEMETRY,
    INTAKE_PREFIX,
    LEADERSHIP_BUCKET,
    REPLY_HEADER,
    SNAPSHOT_BUCKET,
    STATUS_BUCKET,
    TELEMETRY_PREFIX,
    TRACEPARENT,
)
from gpuherd.obs import get_logger

log = get_logger("gpuherd.log")
_T = TypeVar("_T")

ERR_WRONG_LAST_SEQUENCE = 10071
# A clustered stream refuses an append that checks a subject's last sequence while another one checking
# the same subject is not applied yet ("wrong last sequence", without one): worth retrying at once.
ERR_SUBJECT_CHECK_BUSY = 10164
ERR_BATCH_DUPLICATE_ID = 10201
# A clustered stream answers a second copy of a message id whose first copy is still being stored
# (a report its relay is storing, appended by its agent too): the retry gets the duplicate ack.
ERR_DUPLICATE_IN_PROCESS = 10158
ERR_TOO_MANY_REQUESTS = 10167  # the stream's ingest queue is full: nothing was stored
_BUSY = frozenset({ERR_SUBJECT_CHECK_BUSY, ERR_DUPLICATE_IN_PROCESS, ERR_TOO_MANY_REQUESTS})
ERR_JETSTREAM_NOT_ENABLED_FOR_ACCOUNT = 10039
ERR_JETSTREAM_NOT_ENABLED = 10076
JS_API_INFO = "$JS.API.INFO"  # answered by JetStream itself: nobody answers it on a server without
CLI_SETUP_PATIENCE_S = 5.0  # how long a short-lived open waits for JetStream (a CLI gives up at 10 s)
# What setting up the streams waits out while JetStream starts or a cluster elects its meta leader
# (nats-py's JetStream manager reports "no responders" as ServiceUnavailableError).
_SETUP_OUTAGE = (TimeoutError, nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError)
_CREATE_STREAMS = (
    "create them with `gpuherd log init` as a NATS user allowed to manage streams (or run gpuherd as such "
    "a user with GPUHERD_STREAMS unset or =create, its default: it then creates them as it connects)"
)
# What a server failing over, or a stream electing its leader, answers meanwhile: worth waiting out.
_OUTAGE = (
    TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
_HEADROOM = 64 * 1024  # of the server's payload limit, left for a page's headers
# From this many events, ``append_each`` stores them as one atomic batch: the server stages a batch
# for about 2.5 ms whatever its size, then commits it with one fsync (bench_log: 100 events in
# 4.3 ms, where pipelined alone each costs about 0.25 ms of fsync); fewer go pipelined.
ATOMIC_FROM = 16
# A page in a stream whose metadata says positions = sequences: the metadata was dropped (a stream
# config update without it, as gpuherd before pages makes, clears it). Reading on would misnumber.
_LOST_POSITIONS = (
    f"stream {HERD} holds a page of events (message {{seq}}) but its metadata lacks "
    f"{POSITIONS_METADATA}={PAGE_SLOTS}: an older gpuherd (or a hand edit) updated the stream's config; "
    f"put that key back in the stream's metadata (a JetStream stream update) before reading it"
)
_batch_numbers = itertools.count(1)  # batch ids: unique per process, with the client id and clock


class JetStreamSettings(msgspec.Struct, kw_only=True):
    replicas: int = 1
    duplicate_window_s: float = 7200.0
    intake_max_age_s: float = 7 * 86400.0
    telemetry_max_age_s: float = 3600.0
    leadership_ttl_s: float = 6.0
    snapshot_max_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 5.0
    # "create": create or update the streams and buckets on open (the local default, and the
    # deployment's one-shot ``gpuherd log init`` as admin). "require": only wait for them to exist,
    # for roles whose permissions do not cover stream management (every service and agent in compose).
    streams: str = "create"
    dead_letter_max_age_s: float = 30 * 86400.0
    status_ttl_s: float = 15.0
    # Where HERD_INTAKE keeps submissions not yet judged: "file" (fsynced as the log is) or "memory"
    # (an operator's choice, GPUHERD_INTAKE_STORAGE: no disk sync per submission; one not yet judged
    # is lost if every server holding it stops, an accepted one never is: its verdict is in HERD).
    # None: file for a new stream, and an existing stream as it is.
    intake_storage: str | None = None
    outage_patience_s: float = 120.0  # how long a read waits through a NATS outage before it gives up
    # A multi-event append as one message (a page, ``pages.py``); False: an atomic batch of one
    # message per event, as before pages (5-9 ms of server staging each: benchmarks compare the two).
    pages: bool = True


def credentials_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Connection options from the environment, so no secret is baked into an image or a command line:

    - ``NATS_USER`` and ``NATS_PASSWORD`` (or ``NATS_PASSWORD_FILE``, e.g. a Docker secret); the
      user's inbox prefix becomes ``_INBOX.<user>``, the only inboxes its permissions let it read;
    - ``NATS_CREDS``: a credentials file (NATS operator/JWT deployments);
    - ``NATS_CA``, ``NATS_CERT``, ``NATS_KEY``: TLS (the server's CA; a client certificate for mutual TLS).
    """
    env = os.environ if env is None else env
    options: dict[str, Any] = {}
    user = env.get("NATS_USER")
    if user:
        options["user"] = user
        options["inbox_prefix"] = f"_INBOX.{user}"
        password = env.get("NATS_PASSWORD")
        if password is None and env.get("NATS_PASSWORD_FILE"):
            try:
                password = Path(env["NATS_PASSWORD_FILE"]).read_text().strip()
            except OSError as exc:
                raise LogError(f"NATS_PASSWORD_FILE: cannot read {env['NATS_PASSWORD_FILE']}: {exc}") from None
        if password is None:
            raise LogError(f"NATS_USER={user} is set but neither NATS_PASSWORD nor NATS_PASSWORD_FILE is")
        options["password"] = password
    if env.get("NATS_CREDS"):
        options["user_credentials"] = env["NATS_CREDS"]
    if env.get("NATS_CA") or env.get("NATS_CERT"):
        context = ssl.create_default_context(cafile=env.get("NATS_CA") or None)
        if env.get("NATS_CERT"):
            context.load_cert_chain(env["NATS_CERT"], env.get("NATS_KEY") or None)
        options["tls"] = context
        options["tls_hostname"] = env.get("NATS_TLS_HOSTNAME") or None
    return options


# ASCII characters str.isspace() is true of: what nats-py refuses in a header's name.
_SPACE_IN_NAME = re.compile(rb"[\t-\r\x1c- ]")


class _Client(NatsClient):
    """nats-py's client, with a quicker parser of a message's header block (nats-py's own tests each
    character of each name with a generator: about 5% of a busy follower's time, every stored message
    carrying one header or more). It gives what nats-py's does (tested against it)."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            name = name.strip()
            if not name.isascii() or _SPACE_IN_NAME.search(name):
                continue  # (nats-py skips a name it cannot decode as ASCII, or holding a space)
            out[name.decode("ascii")] = value.strip().decode("utf-8", "replace")
        return out


async def connect(url: str, name: str = "gpuherd", **kwargs: Any) -> NatsClient:
    """Connect with endless reconnects: a restarting server must not end a service. Credentials and
    TLS come from the environment (``credentials_from_env``)."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc))

    async def on_disconnect() -> None:
        log.info("nats disconnected", url=url)  # on close too; a lost server shows in error_cb

    async def on_reconnect() -> None:
        log.info("nats reconnected", url=url)

    options: dict[str, Any] = {
        "servers": url.split(","),
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "connect_timeout": 2,
        "drain_timeout": 2,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
    options.update(credentials_from_env())
    options.update(kwargs)
    nc = _Client()
    await nc.connect(**options)
    return nc


class JetStreamOff(LogError):
    """The NATS server answers but offers no JetStream to this connection: nothing to wait for."""


def server_of(nc: NatsClient) -> str:
    """The URL of the server ``nc`` is connected to (without the credentials a URL may hold)."""
    url = nc.connected_url
    if url is None:
        return "(no server)"
    return f"{url.scheme}://{url.hostname}:{url.port}"


async def jetstream_off(nc: NatsClient, timeout: float = 2.0) -> str | None:
    """Why ``nc`` has no JetStream, where its server says so; None where JetStream answers, or may
    soon. A server without JetStream leaves ``$JS.API`` requests unanswered ("no responders"), but so
    does one whose JetStream is still starting or whose cluster is electing its meta leader: the
    server's INFO (its ``jetstream`` flag, which nats-py keeps from the connect) tells them apart."""
    where = server_of(nc)
    try:
        reply = await nc.request(JS_API_INFO, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        if nc._server_info.get("jetstream"):
            return None  # enabled, not ready yet
        return (
            f"the NATS server at {where} answers but has JetStream disabled, and gpuherd keeps its log in "
            "JetStream: start nats-server with -js, or add `jetstream {}` to its config "
            "(`gpuherd up` starts one with JetStream)"
        )
    except (TimeoutError, nats.errors.Error):
        return None  # slow or gone: nothing the server said
    try:
        error = msgspec.json.decode(reply.data).get("error") or {}
    except (msgspec.DecodeError, AttributeError):
        return None
    if error.get("err_code") in (ERR_JETSTREAM_NOT_ENABLED_FOR_ACCOUNT, ERR_JETSTREAM_NOT_ENABLED):
        return (
            f"the NATS server at {where} answers but JetStream is not enabled for this connection's account "
            f"({error.get('description')}): enable it for the account (`jetstream: enabled` in the account's "
            "config), or connect as a user of an account that has it"
        )
    return None


class JetStreamLog(EventLog):
    def __init__(self, nc: NatsClient, settings: JetStreamSettings | None = None) -> None:
        self.nc = nc
        self.settings = settings or JetStreamSettings()
        self.leadership_ttl = self.settings.leadership_ttl_s
        self.js: JetStreamContext = nc.jetstream(timeout=self.settings.request_timeout_s)
        self._kv: dict[str, Any] = {}
        # Positions per stored message: PAGE_SLOTS, or 1 on a log from before pages (None: not read yet).
        self._slots: int | None = None
        self._acks: _PublishAcks | None = None  # (made by the first append_pipelined)
        self._owns_connection = False
        self._connected_since = time.time()
        # How long setting up (or finding) the streams waits for a JetStream that does not answer yet.
        self.setup_patience_s = self.settings.outage_patience_s
        self._said_waiting = False  # (that warning once per log, not once per retry)
        previous = nc._reconnected_cb

        async def on_reconnect() -> None:
            self._connected_since = time.time()
            if previous is not None:
                await previous()

        nc._reconnected_cb = on_reconnect

    @classmethod
    async def open(
        cls, url: str, *, name: str = "gpuherd", settings: JetStreamSettings | None = None, persistent: bool = True
    ) -> JetStreamLog:
        """``persistent``: reconnect forever (services); else give up after a few tries (CLI, tests)."""
        nc = await connect(url, name=name) if persistent else await connect(url, name=name, max_reconnect_attempts=3)
        self = cls(nc, settings)
        self._owns_connection = True
        if not persistent:  # (a command: a person waits for it)
            self.setup_patience_s = min(self.setup_patience_s, CLI_SETUP_PATIENCE_S)
        try:
            # (a bound on the whole setup only where a person waits: a service waits each step out)
            async with asyncio.timeout(None if persistent else self.setup_patience_s):
                if self.settings.streams == "require":
                    # A service waits for the streams to be created; a command says at once what is missing.
                    await self.require_streams(timeout=300.0 if persistent else 0.0)
                else:
                    await self.ensure_streams()
        except TimeoutError:
            where = server_of(nc)  # (before the close forgets it)
            await self.close()
            raise LogError(
                f"the NATS server at {where} answers, but its JetStream did not within "
                f"{self.setup_patience_s:.0f}s: it may be starting, or its cluster without a meta leader"
            ) from None
        except BaseException:
            await self.close()
            raise
        return self

    async def close(self) -> None:
        if self._acks is not None:  # (on a connection another owns, it would outlive this log)
            await self._acks.close()
            self._acks = None
        if self._owns_connection and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()

    # -- setup -----------------------------------------------------------------------

    def stream_configs(self) -> list[StreamConfig]:
        s = self.settings
        return [
            StreamConfig(
                name=HERD,
                subjects=list(HERD_SUBJECTS),
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                num_replicas=s.replicas,
                duplicate_window=s.duplicate_window_s,
                deny_delete=True,
                deny_purge=True,
                allow_atomic=True,
                allow_direct=True,
                metadata={POSITIONS_METADATA: str(self._slots or PAGE_SLOTS)},
            ),
            StreamConfig(
                name=HERD_INTAKE,
                subjects=[f"{INTAKE_PREFIX}.>"],
                storage=StorageType.MEMORY if check_intake_storage(s.intake_storage) == "memory" else StorageType.FILE,
                num_replicas=s.replicas,
                max_age=s.intake_max_age_s,
                # A plain NATS request to herd.intake.* must get the scheduler's
                # verdict as its reply, not the stream's receipt.
                no_ack=True,
                deny_delete=True,
                deny_purge=True,
                allow_atomic=True,  # a client's submissions of one moment: one batch, one disk sync
            ),
            StreamConfig(
                name=HERD_TELEMETRY,
                subjects=[f"{TELEMETRY_PREFIX}.>"],
                storage=StorageType.FILE,
                num_replicas=s.replicas,
                max_age=s.telemetry_max_age_s,
                max_msgs_per_subject=2000,
                discard=DiscardPolicy.OLD,
            ),
            StreamConfig(
                name=HERD_DEAD,
                subjects=[f"{DEAD_LETTER_PREFIX}.>"],
                storage=StorageType.FILE,
                num_replicas=s.replicas,
                max_age=s.dead_letter_max_age_s,
                duplicate_window=s.duplicate_window_s,  # every reader of a bad event reports it; one is kept
                deny_delete=True,
            ),
        ]

    def kv_configs(self) -> list[KeyValueConfig]:
        s = self.settings
        return [
            KeyValueConfig(
                bucket=SNAPSHOT_BUCKET,
                history=1,
                storage=StorageType.FILE,
                replicas=s.replicas,
                max_value_size=s.snapshot_max_bytes,
            ),
            KeyValueConfig(
                bucket=LEADERSHIP_BUCKET,
                history=1,
                ttl=s.leadership_ttl_s,
                storage=StorageType.FILE,
                replicas=s.replicas,
            ),
            # What each running service says about itself (``gpuherd status``); gone when it stops saying.
            KeyValueConfig(
                bucket=STATUS_BUCKET, history=1, ttl=s.status_ttl_s, storage=StorageType.MEMORY, replicas=s.replicas
            ),
        ]

    async def ensure_streams(self) -> None:
        """Create the streams and buckets, or update them to this version's configuration."""
        for config in self.stream_configs():
            await self._ensure_stream(config)
        for kv in self.kv_configs():
            self._kv[kv.bucket] = await self._ensure_kv(kv)

    async def require_streams(self, timeout: float = 300.0) -> None:
        """Wait until the streams and buckets exist (created by a role that may: ``gpuherd log init``);
        ``timeout`` 0: look once. JetStreamOff at once where the server has no JetStream for us."""
        deadline = time.monotonic() + timeout
        names = [c.name for c in self.stream_configs()]
        buckets = [kv.bucket for kv in self.kv_configs()]
        warned = False
        while True:
            missing: list[str] = []
            for name in names:
                if not await self._setup_step(functools.partial(self._stream_exists, name), f"look up stream {name}"):
                    missing.append(name)
            for bucket in buckets:
                if bucket not in self._kv:
                    find = functools.partial(self._existing_kv, bucket)
                    kv = await self._setup_step(find, f"look up KV bucket {bucket}")
                    if kv is None:
                        missing.append(f"KV {bucket}")
                    else:
                        self._kv[bucket] = kv
            if not missing:
                if self.settings.intake_storage is not None:  # (asked for: said if the stream differs)
                    self._intake_storage((await self.js.stream_info(HERD_INTAKE)).config.storage)
                return
            if time.monotonic() >= deadline:
                waited = f" after {timeout:.0f}s" if timeout > 0 else ""
                raise LogError(
                    f"JetStream at {server_of(self.nc)} lacks gpuherd's streams{waited}: {', '.join(missing)}; "
                    f"{_CREATE_STREAMS}"
                )
            if not warned:
                log.warning(
                    "waiting for the streams to be created (gpuherd log init)", missing=missing, timeout_s=timeout
                )
                warned = True
            await asyncio.sleep(1.0)

    async def _stream_exists(self, name: str) -> bool:
        try:
            await self.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def _existing_kv(self, bucket: str) -> Any:
        try:
            return await self.js.key_value(bucket)
        except nats.js.errors.NotFoundError:  # (BucketNotFoundError is one)
            return None

    async def _setup_step(self, step: Callable[[], Awaitable[_T]], what: str) -> _T:
        """``step()`` of setting up the streams, tried again while JetStream does not answer yet (it is
        starting, or its cluster electing a meta leader: said early, in a warning) for
        ``setup_patience_s``; JetStreamOff at once where the server says it has no JetStream for us."""
        deadline = time.monotonic() + self.setup_patience_s
        delay = 0.25
        while True:
            try:
                return await step()
            except _SETUP_OUTAGE as exc:
                if not isinstance(exc, TimeoutError):
                    off = await jetstream_off(self.nc)
                    if off is not None:
                        raise JetStreamOff(off) from None
                if time.monotonic() >= deadline:
                    raise LogError(
                        f"could not {what}: JetStream at {server_of(self.nc)} did not answer within "
                        f"{self.setup_patience_s:.0f}s ({exc!r}); the server has JetStream enabled, so it may be "
                        "starting or its cluster without a meta leader (a quorum of its servers down)"
                    ) from exc
                if not self._said_waiting:
                    log.warning(
                        "JetStream does not answer yet; waiting (starting, or its cluster electing a meta leader)",
                        server=server_of(self.nc),
                        what=what,
                        error=repr(exc),
                        patience_s=self.setup_patience_s,
                    )
                    self._said_waiting = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _ensure_stream(self, config: StreamConfig) -> None:
        async def ensure() -> None:
            # Looking first means a user without the right to manage streams (a reader, a
            # service) never asks to: on a set-up cluster there is nothing to change.
            info = None
            with contextlib.suppress(nats.js.errors.NotFoundError):
                info = await self.js.stream_info(config.name)
            if config.name == HERD:
                # A new stream, or an empty one from before pages, starts with pages (recorded here).
                fresh = info is None or not (int(info.state.last_seq or 0) or _recorded_slots(info))
                self._slots = PAGE_SLOTS if fresh else _slots_of(info)
                config.metadata = {**(config.metadata or {}), POSITIONS_METADATA: str(self._slots)}
            if info is not None and config.name == HERD_INTAKE:
                config.storage = self._intake_storage(info.config.storage)
            if info is not None and (info.config.num_replicas or 1) > (config.num_replicas or 1):
                # Set up for fewer copies than the stream has (a command, the dashboard or a client
                # without GPUHERD_REPLICAS): never take copies away from the log. As admin that update
                # made a cluster's R3 streams R1; as anyone else it was refused, and the caller hung.
                config.num_replicas = info.config.num_replicas
            if info is not None and _same_config(info, config):
                return
            try:
                await self.js.add_stream(config)
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != 10058:  # exists with another config
                    raise
                if config.name == HERD_INTAKE:  # (made meanwhile by another process: keep its storage)
                    config.storage = self._intake_storage((await self.js.stream_info(HERD_INTAKE)).config.storage)
                await self.js.update_stream(config)

        await self._setup_step(ensure, f"create stream {config.name}")

    def _intake_storage(self, existing: StorageType | str | None) -> StorageType:
        """The intake stream's storage: as it is, unless this process asks for another, which a
        stream cannot change in place (LogError, with how to change it)."""
        existing = StorageType(existing or StorageType.FILE)  # (nats-py reads it back as a plain string)
        asked = check_intake_storage(self.settings.intake_storage)
        if asked is None or asked == existing.value:
            return existing
        raise LogError(
            f"stream {HERD_INTAKE} keeps submissions in {existing.value} and GPUHERD_INTAKE_STORAGE={asked} asks "
            f"for {asked}: JetStream cannot change a stream's storage in place. To change it, stop the submitters, "
            f"let the scheduler judge what {HERD_INTAKE} holds (`gpuherd status`: its consumer has nothing pending), "
            f"delete the stream as admin (`nats stream rm {HERD_INTAKE}`) and start again with the new setting; "
            f"or unset GPUHERD_INTAKE_STORAGE to use the stream as it is"
        )

    async def _ensure_kv(self, config: KeyValueConfig) -> Any:
        async def ensure() -> Any:
            try:
                return await self.js.key_value(config.bucket)
            except nats.js.errors.BucketNotFoundError:
                return await self.js.create_key_value(config)

        return await self._setup_step(ensure, f"open KV bucket {config.bucket}")

    # -- HERD ----------------------------------------------------------------------------

    @staticmethod
    def _headers(
        event: ev.Event, expect: Mapping[str, int] | None, trace: str | None, fence: tuple[str, int] | None = None
    ) -> dict[str, str]:
        headers = {"Nats-Msg-Id": event.id} if event.id else {}
        if expect is not None:
            expected = expect.get(event.subject())
            if expected is not None:
                headers["Nats-Expected-Last-Subject-Sequence"] = str(expected)
        if fence is not None:  # another subject's last sequence, checked on this message (a leader's fence)
            headers["Nats-Expected-Last-Subject-Sequence"] = str(fence[1])
            headers["Nats-Expected-Last-Subject-Sequence-Subject"] = fence[0]
        if trace:
            headers[TRACEPARENT] = trace
        return headers

    @staticmethod
    def _fences(events: Sequence[ev.Event], expect: Mapping[str, int] | None) -> dict[int, tuple[str, int]]:
        """Expected subjects none of ``events`` is on (a leader's fence): each is checked on an event
        of its own that checks nothing else (JetStream checks one subject per message)."""
        if not expect:
            return {}
        own = {e.subject() for e in events}
        others = [(subject, seq) for subject, seq in expect.items() if subject not in own]
        free = [i for i, e in enumerate(events) if e.subject() not in expect]
        if len(others) > len(free):
            raise LogError(f"cannot check {len(others)} other subjects on {len(free)} events: {sorted(expect)}")
        return dict(zip(free, others, strict=False))

    async def _positions(self) -> int:
        """Positions per stored message (``pages.py``): PAGE_SLOTS, or 1 on a log from before pages."""
        if self._slots is None:

            async def read() -> int:
                return _slots_of(await self.js.stream_info(HERD))

            self._slots = await patiently(
                read, what="the log's stream", patience_s=self.settings.outage_patience_s, transient=_OUTAGE
            )
        return self._slots

    async def append(
        self,
        events: Sequence[ev.Event],
        *,
        expect: Mapping[str, int] | None = None,
        trace: Traces = None,
    ) -> AppendResult:
        if not events:
            return AppendResult(seqs=())
        if len(events) > self.max_batch:
            raise LogError(f"an atomic append holds at most {self.max_batch} events, got {len(events)}")
        slots = await self._positions()
        # The server checks message sequences; callers hold positions.
        checks = None if expect is None else {subject: pos // slots for subject, pos in expect.items()}
        if len(events) == 1:
            event = events[0]
            fence = self._fences(events, checks).get(0)
            try:
                ack = await self.js.publish(
                    event.subject(), ev.encode(event), headers=self._headers(event, checks, trace_of(trace, 0), fence)
                )
            except nats.js.errors.APIError as exc:
                raise self._map_error(exc, fence[0] if fence else event.subject(), expect) from exc
            return AppendResult(seqs=(ack.seq * slots,), duplicate=bool(ack.duplicate))
        if slots > 1 and self.settings.pages:
            paged = await self._append_page(events, expect, checks, trace, slots)
            if paged is not None:
                return paged
        return await self._append_batch(events, checks, trace, slots)

    async def _append_page(
        self,
        events: Sequence[ev.Event],
        expect: Mapping[str, int] | None,
        checks: Mapping[str, int] | None,
        trace: Traces,
        slots: int,
    ) -> AppendResult | None:
        """``events`` as one page (one message); None where they cannot be: more than one subject to
        check (JetStream checks one per message) or more bytes than the server takes in a message."""
        if checks is not None and len(checks) > 1:
            return None
        subject = events[0].subject()
        admits = page_admits(subject)
        if not all(admits(e.subject()) for e in events):
            return None
        data = encode_page([ev.encode(e) for e in events], [trace_of(trace, n) for n in range(len(events))])
        if len(data) > self.nc.max_payload - _HEADROOM:
            return None
        headers = {PAGE_HEADER: str(len(events))}
        ids = [e.id for e in events]
        if all(ids):
            headers["Nats-Msg-Id"] = page_id(ids)
        checked = subject
        if checks:
            [(checked, seq)] = checks.items()
            headers["Nats-Expected-Last-Subject-Sequence"] = str(seq)
            if checked != subject:
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = checked
        try:
            ack = await self.js.publish(subject, data, headers=headers)
        except nats.js.errors.APIError as exc:
            raise self._map_error(exc, checked, expect) from exc
        first = ack.seq * slots
        return AppendResult(seqs=tuple(range(first, first + len(events))), duplicate=bool(ack.duplicate))

    async def _append_batch(
        self,
        events: Sequence[ev.Event],
        expect: Mapping[str, int] | None,
        trace: Traces,
        slots: int,
        encoded: Sequence[bytes] | None = None,
    ) -> AppendResult:
        batch_id = f"{self.nc.client_id}-{next(_batch_numbers)}-{time.monotonic_ns() % 10**12}"
        seen: set[str] = set()  # the same subject twice in one batch is checked on its first event only
        fences = self._fences(events, expect)
        timeout = self.settings.request_timeout_s
        last = len(events)
        for n, event in enumerate(events, start=1):
            subject = event.subject()
            check = expect if subject not in seen else None
            seen.add(subject)
            headers = self._headers(event, check, trace_of(trace, n - 1), fences.get(n - 1))
            headers["Nats-Batch-Id"] = batch_id
            headers["Nats-Batch-Sequence"] = str(n)
            data = ev.encode(event) if encoded is None else encoded[n - 1]
            if n == last:
                headers["Nats-Batch-Commit"] = "1"
                reply = await self.nc.request(subject, data, headers=headers, timeout=timeout)
                answer = msgspec.json.decode(reply.data)
                error = answer.get("error")
                if error:
                    code = error.get("err_code")
                    if code == ERR_BATCH_DUPLICATE_ID:
                        return AppendResult(seqs=(), duplicate=True)
                    if code == ERR_WRONG_LAST_SEQUENCE:
                        subj = next(iter(fences.values()), None) or next(iter((expect or {"?": 0}).items()))
                        raise ConcurrencyError(subj[0], subj[1])
                    raise _refusal("atomic append", error)
                last_seq = int(answer["seq"])
                return AppendResult(seqs=tuple(seq * slots for seq in range(last_seq - last + 1, last_seq + 1)))
            if n == 1:
                # Flow control and early failure (e.g. allow_atomic missing) on the first message.
                reply = await self.nc.request(subject, data, headers=headers, timeout=timeout)
                if reply.data:
                    error = msgspec.json.decode(reply.data).get("error")
                    if error and error.get("err_code") == ERR_WRONG_LAST_SEQUENCE:
                        subj = fences.get(0) or next(iter((expect or {"?": 0}).items()))
                        raise ConcurrencyError(subj[0], subj[1])
                    if error:
                        raise _refusal("atomic append", error)
            else:
                await self.nc.publish(subject, data, headers=headers)
        raise AssertionError("unreachable")

    @staticmethod
    def _map_error(exc: nats.js.errors.APIError, subject: str, expect: Mapping[str, int] | None) -> Exception:
        if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
            return ConcurrencyError(subject, (expect or {}).get(subject, 0))
        if exc.err_code == ERR_SUBJECT_CHECK_BUSY:
            return LogUnavailable(f"append to {subject}: another append checking {subject} is not applied yet")
        if exc.err_code in _BUSY:
            return LogUnavailable(f"append to {subject}: {exc.description} (code {exc.err_code}); worth retrying")
        return _refusal(
            f"append to {subject}", {"code": exc.code, "err_code": exc.err_code, "description": exc.description}
        )

    async def append_each(
        self, events: Sequence[ev.Event], *, trace: Traces = None, encoded: Sequence[bytes] | None = None
    ) -> list[int]:
        """Store ``events`` each as a message of its own, deduplicated by its id as when appended
        alone (never a page, whose id is the page's), with as few disk syncs as the server allows:
        from ``ATOMIC_FROM`` events on, one atomic batch (one commit, one fsync, where each of them
        alone would cost one); fewer, pipelined. A batch the server refuses because one of its
        events is stored already is stored event by event. Their positions, in order. What a
        report relay stores for many writers at once (``gpuherd.log.relay``), with ``encoded``: the
        bytes each writer wrote, stored as they are."""
        if len(events) > self.max_batch:
            raise LogError(f"an atomic append holds at most {self.max_batch} events, got {len(events)}")
        if len(events) >= ATOMIC_FROM:
            stored = await self._append_batch(events, None, trace, await self._positions(), encoded)
            if stored.seqs:
                return list(stored.seqs)
            # (refused whole as a duplicate: some were stored before, e.g. by their writer itself)
        return await self.append_pipelined(events, window=max(1, len(events)), trace=trace, encoded=encoded)

    async def append_relayed(
        self, events: Sequence[ev.Event], *, trace: Traces = None, encoded: Sequence[bytes] | None = None
    ) -> list[int]:
        """Store agents' reports of any nodes as a report relay's page (on ``RELAYED_SUBJECT``; see
        ``gpuherd.log.relay``), or as pages in order where one would exceed the server's message
        size; their positions. Deduplicated as a page (a repeat of this very append is dropped), not
        report by report. A log whose positions are message sequences (older than pages) stores
        them ``append_each``."""
        if len(events) > self.max_batch:
            raise LogError(f"an atomic append holds at most {self.max_batch} events, got {len(events)}")
        slots = await self._positions()
        if slots == 1 or not self.settings.pages:
            return await self.append_each(events, trace=trace, encoded=encoded)
        data = [ev.encode(e) for e in events] if encoded is None else list(encoded)
        traces = [trace_of(trace, n) for n in range(len(events))]
        positions: list[int] = []
        await self._store_relayed(events, data, traces, slots, positions)
        return positions

    async def _store_relayed(
        self,
        events: Sequence[ev.Event],
        data: Sequence[bytes],
        traces: Sequence[str | None],
        slots: int,
        positions: list[int],
    ) -> None:
        page = encode_page(data, traces)
        if len(page) > self.nc.max_payload - _HEADROOM and len(events) > 1:
            half = len(events) // 2
            await self._store_relayed(events[:half], data[:half], traces[:half], slots, positions)
            await self._store_relayed(events[half:], data[half:], traces[half:], slots, positions)
            return
        headers = {PAGE_HEADER: str(len(events)), "Nats-Msg-Id": page_id([e.id for e in events])}
        try:
            ack = await self.js.publish(RELAYED_SUBJECT, page, headers=headers)
        except nats.js.errors.APIError as exc:
            raise self._map_error(exc, RELAYED_SUBJECT, None) from exc
        positions.extend(range(ack.seq * slots, ack.seq * slots + len(events)))

    async def append_pipelined(
        self,
        events: Sequence[ev.Event],
        window: int = 256,
        *,
        trace: Traces = None,
        encoded: Sequence[bytes] | None = None,
    ) -> list[int]:
        """Each event on its own (one message, deduplicated by its id), ``window`` unacknowledged at
        most; their positions. The acknowledgements come on one subscription of this log's
        (``_PublishAcks``): a JetStream publish per event, a request each, cost its caller a task,
        a timer, a reply inbox and a JSON parse into nats-py's PubAck."""
        slots = await self._positions()
        if self._acks is None:
            self._acks = _PublishAcks(self.nc)
        acks = self._acks
        timeout = self.settings.request_timeout_s
        in_flight = asyncio.Semaphore(window)
        waiting: list[asyncio.Future[int]] = []
        try:
            for n, event in enumerate(events):
                if in_flight.locked():  # (acknowledgements stopped coming: a publish's timeout)
                    await asyncio.wait_for(in_flight.acquire(), timeout)
                else:
                    await in_flight.acquire()
                reply, ack = await acks.expect()
                ack.add_done_callback(lambda _: in_flight.release())
                waiting.append(ack)
                headers = self._headers(event, None, trace_of(trace, n))
                data = ev.encode(event) if encoded is None else encoded[n]
                await self.nc.publish(event.subject(), data, reply=reply, headers=headers)
            async with asyncio.timeout(timeout):
                seqs = await asyncio.gather(*waiting)
        except TimeoutError as exc:  # (nats-py's own, as js.publish raised: a caller may catch nats.errors.Error)
            raise nats.errors.TimeoutError from exc
        finally:
            acks.forget(waiting)
        return [seq * slots for seq in seqs]

    async def read(
        self, start: int = 1, *, stop: int | None = None, follow: bool = False, linger_s: float = 0.0
    ) -> AsyncIterator[Record]:
        slots = await self._positions()
        if not follow and stop is None:
            stop = await self.last_seq()
        start = max(start, 1)
        if stop is not None and start > stop:
            return
        first_message = max(start // slots, 1)
        last_message = None if stop is None else stop // slots
        async for seq, stored_at, msg in ordered_messages(
            self.nc, self.js, HERD, first_message, stop=last_message, follow=follow, linger_s=linger_s
        ):
            position = seq * slots
            headers = msg.headers
            if headers and PAGE_HEADER in headers:
                for index, (event, trace) in enumerate(_unpack(msg, slots, seq)):
                    if position + index < start:
                        continue
                    if stop is not None and position + index > stop:
                        return
                    yield Record(position + index, event, trace, stored_at)
                continue
            if position < start:
                continue
            try:
                event = ev.decode(msg.data)
            except EventDecodeError as exc:
                event = ev.Unreadable(stored_subject=msg.subject, reason=str(exc), data=msg.data)
            trace = headers.get(TRACEPARENT) if headers else None
            yield Record(position, event, trace, stored_at)

    async def last_seq(self) -> int:
        slots = await self._positions()

        # A server failing over or a stream electing its leader answers late: wait for it (what
        # asks is about to read the log, which waits through the same outage anyway).
        async def head() -> int:
            last = int((await self.js.stream_info(HERD)).state.last_seq)
            if slots == 1 or last == 0:
                return last
            msg = await self.js.get_msg(HERD, seq=last)
            return last * slots + _positions_taken(msg, slots, last) - 1

        return await patiently(
            head, what="the log's head", patience_s=self.settings.outage_patience_s, transient=_OUTAGE
        )

    async def subject_seen(self, subject: str) -> bool:
        if await self.subject_last_seq(subject) > 0:
            return True
        if await self._positions() == 1:
            return False  # a log without pages: the server knows every subject
        # In a page on another subject (which JetStream's subject index does not see): read.
        async for record in self.read():
            if record.event.subject() == subject:
                return True
        return False

    async def tail_start(self, events: int) -> int:
        slots = await self._positions()
        last = int((await self.js.stream_info(HERD)).state.last_seq)
        return max(1, (last - events + 1) * slots)

    def behind(self, folded: int, head: int) -> int:
        slots = self._slots or 1
        if folded >= head:
            return 0
        return max(1, head // slots - folded // slots)

    async def subject_last_seq(self, subject: str) -> int:
        slots = await self._positions()

        # (Asked when a decider takes its leadership: a server killed at that moment must not kill it.)
        async def last() -> int:
            try:
                msg = await self.js.get_last_msg(HERD, subject)
            except nats.js.errors.NotFoundError:
                return 0
            position = int(msg.seq or 0) * slots
            if msg.headers and PAGE_HEADER in msg.headers:
                page = _unpack(msg, slots, int(msg.seq or 0))
                on_subject = [n for n, (event, _) in enumerate(page) if event.subject() == subject]
                return position + (on_subject[-1] if on_subject else 0)
            return position

        return await patiently(
            last, what=f"the last event on {subject}", patience_s=self.settings.outage_patience_s, transient=_OUTAGE
        )

    # -- HERD_INTAKE -------------------------------------------------------------------

    async def publish_intake(self, source: str, data: bytes, headers: Mapping[str, str] | None = None) -> None:
        await self.nc.publish(f"{INTAKE_PREFIX}.{source}", data, headers=dict(headers or {}) or None)
        await self.nc.flush()

    def intake_consumer(self, name: str, ack_wait: float = 10.0) -> DurableConsumer:
        return _JetStreamConsumer(self, HERD_INTAKE, name, ack_wait)

    # -- HERD_TELEMETRY ----------------------------------------------------------------

    async def publish_telemetry(self, subject: str, data: bytes) -> None:
        await self.nc.publish(f"{TELEMETRY_PREFIX}.{subject}", data)

    async def telemetry(self, subject: str = ">", *, since_s: float | None = None) -> AsyncIterator[Delivery]:
        filter_subject = f"{TELEMETRY_PREFIX}.{subject}"
        info = await self.js.stream_info(HERD_TELEMETRY)
        start = int(info.state.last_seq) + 1
        cutoff = None if since_s is None else time.time() - since_s
        if cutoff is not None:
            start = int(info.state.first_seq) or 1
        async for seq, at, msg in ordered_messages(
            self.nc, self.js, HERD_TELEMETRY, start, stop=None, follow=True, filter_subject=filter_subject
        ):
            if cutoff is not None and at < cutoff:
                continue
            yield Delivery(
                seq=seq, subject=msg.subject, data=msg.data, headers=dict(msg.headers or {}), at=at, deliveries=1
            )

    def is_connected(self) -> bool:
        return bool(self.nc.is_connected)

    def connected_since(self) -> float:
        return self._connected_since

    async def reply(self, inbox: str, data: bytes) -> None:
        await self.nc.publish(inbox, data)

    async def request(self, subject: str, data: bytes, *, timeout: float = 5.0) -> bytes:
        try:
            msg = await self.nc.request(f"{CONTROL_PREFIX}.{subject}", data, timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise LogUnavailable(f"nobody serves {CONTROL_PREFIX}.{subject} (is its service running?)") from exc
        except TimeoutError as exc:
            raise LogUnavailable(f"no answer on {CONTROL_PREFIX}.{subject} within {timeout}s") from exc
        return msg.data

    async def serve_requests(self, subject: str, handler: RequestHandler) -> Callable[[], Awaitable[None]]:
        async def on_request(msg: Msg) -> None:
            try:
                answer = await handler(msg.data)
            except Exception as exc:  # the asker gets the error instead of a timeout
                log.exception("request handler failed", subject=msg.subject)
                answer = msgspec.json.encode({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            try:
                await msg.respond(answer)
            except Exception as exc:  # (an answer over the server's max_payload): again, not a timeout
                log.exception("request answer not sent", subject=msg.subject, size=len(answer))
                limit = self.nc.max_payload
                error = (
                    f"the answer is {len(answer)} bytes, over the NATS server's limit of {limit} bytes"
                    if len(answer) > limit
                    else f"the answer could not be sent ({type(exc).__name__}: {exc})"
                )
                with contextlib.suppress(Exception):  # (no reply subject, or the connection is gone)
                    await msg.respond(msgspec.json.encode({"ok": False, "error": error}))

        sub = await self.nc.subscribe(f"{CONTROL_PREFIX}.{subject}", cb=on_request)
        return sub.unsubscribe

    # -- HERD_DEAD ---------------------------------------------------------------------------

    async def dead_letter(self, letter: DeadLetter) -> None:
        subject = f"{DEAD_LETTER_PREFIX}.{letter.consumer}"
        await self.js.publish(subject, msgspec.json.encode(letter), headers={"Nats-Msg-Id": letter.id})

    async def dead_letters(self) -> list[DeadLetter]:
        info = await self.js.stream_info(HERD_DEAD)
        last = int(info.state.last_seq)
        first = int(info.state.first_seq) or 1
        if last < first:
            return []
        return [
            msgspec.json.decode(msg.data, type=DeadLetter)
            async for _, _, msg in ordered_messages(self.nc, self.js, HERD_DEAD, first, stop=last, follow=False)
        ]

    # -- key-value -------------------------------------------------------------------------

    async def kv_get(self, bucket: str, key: str) -> bytes | None:
        try:
            entry = await self._kv[bucket].get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return entry.value

    async def kv_put(self, bucket: str, key: str, value: bytes) -> None:
        if len(value) > self.settings.snapshot_max_bytes:
            raise LogError(
                f"value for {bucket}/{key} is {len(value)} bytes, over the {self.settings.snapshot_max_bytes} limit"
            )
        await self._kv[bucket].put(key, value)

    async def kv_entries(self, bucket: str) -> dict[str, bytes]:
        kv = self._kv[bucket]
        try:
            keys = await kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        out = {}
        for key in keys:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
                entry = await kv.get(key)
                if entry.value is not None:
                    out[key] = entry.value
        return out

    async def kv_purge(self, bucket: str, key: str) -> None:
        await self._kv[bucket].purge(key)

    def leadership(self, name: str, holder: str) -> Leadership:
        return _JetStreamLeadership(self, name, holder)


_COMPARED = (
    "num_replicas", "max_age", "duplicate_window", "no_ack", "deny_delete", "deny_purge", "allow_direct",
    "allow_atomic", "max_msgs_per_subject", "discard", "storage", "retention",
)  # fmt: skip


def _unpack(msg: Any, slots: int, seq: int) -> list[tuple[ev.Event, str | None]]:
    """The events of the page stored at ``seq`` and their traceparents; what does not decode is
    ``Unreadable`` (the whole message where it is no page), so a bad page neither stops a reader nor
    vanishes. A page in a stream that numbers positions as sequences is refused (``_LOST_POSITIONS``)."""
    if slots == 1:
        raise LogError(_LOST_POSITIONS.format(seq=seq))
    admits = page_admits(msg.subject)
    decoded = decode_page_events(msg.data)  # (every event at once, where none needs more than the union)
    if decoded is not None and all(admits(event.subject()) for event, _ in decoded):
        return decoded
    try:
        page = decode_page(msg.data)
    except UNDECODABLE as exc:
        return [(ev.Unreadable(stored_subject=msg.subject, reason=f"not a page of events: {exc}", data=msg.data), None)]
    events: list[tuple[ev.Event, str | None]] = []
    for data, trace in page:
        try:
            event = ev.decode(data)
        except EventDecodeError as exc:
            events.append((ev.Unreadable(stored_subject=msg.subject, reason=str(exc), data=data), trace))
            continue
        if not admits(event.subject()):
            reason = f"{type(event).__name__} on {event.subject()} may not travel in a page stored on {msg.subject}"
            events.append((ev.Unreadable(stored_subject=msg.subject, reason=reason, data=data), trace))
            continue
        events.append((event, trace))
    return events


def _positions_taken(msg: Any, slots: int, seq: int) -> int:
    """How many positions the message stored at ``seq`` takes: 1, or a page's count of events (its
    header). A header that is no such count (written by hand, or by a buggy writer) is not trusted:
    the page takes what a reader finds in it (``_unpack``: at least one Unreadable, a dead letter)."""
    headers = msg.headers or {}
    if PAGE_HEADER not in headers:
        return 1
    try:
        count = int(headers[PAGE_HEADER])
    except ValueError:
        count = 0
    if 1 <= count <= PAGE_SLOTS:
        return count
    return max(len(_unpack(msg, slots, seq)), 1)  # (an empty page still takes its message's first position)


def _recorded_slots(info: Any) -> str | None:
    return (info.config.metadata or {}).get(POSITIONS_METADATA)


def _slots_of(info: Any) -> int:
    """Positions per message of the HERD stream described by ``info``, as its metadata says. A stream
    without it predates pages (1): only the process that sets the streams up (``ensure_streams``)
    moves one to pages, and records that, so every reader agrees on what a position names."""
    recorded = _recorded_slots(info)
    if recorded is None:
        return 1
    try:
        slots = int(recorded)
    except ValueError:
        slots = 0
    if slots not in (1, PAGE_SLOTS):
        raise LogError(f"stream {HERD}: metadata {POSITIONS_METADATA}={recorded!r} is neither 1 nor {PAGE_SLOTS}")
    return slots


def _same_config(info: Any, wanted: StreamConfig) -> bool:
    """Whether the stream already has every setting we ask for (the server fills in the rest)."""
    have = info.config
    if set(have.subjects or ()) != set(wanted.subjects or ()):
        return False
    for key, value in (wanted.metadata or {}).items():
        if (have.metadata or {}).get(key) != value:
            return False
    for field in _COMPARED:
        value = getattr(wanted, field, None)
        if value in (None, 0):  # not asked for (the client's defaults are None or 0): the server's stands
            continue
        if getattr(have, field, None) != value:
            return False
    return True


def check_intake_storage(storage: str | None) -> str | None:
    """``storage`` if it names one (``file``, ``memory``) or none (None), else LogError."""
    if storage not in (None, "file", "memory"):
        raise LogError(f"GPUHERD_INTAKE_STORAGE={storage!r}: set it to file or memory, or leave it unset")
    return storage


def _refusal(what: str, error: Mapping[str, Any]) -> Exception:
    """A server-side 5xx (JetStream recovering, no quorum), a subject check that waits for another
    append, a message id another copy of which is being stored, or a full ingest queue is worth
    retrying; anything else is final."""
    message = f"{what} refused: {error.get('description')} (code {error.get('err_code')})"
    if int(error.get("code") or 0) >= 500 or error.get("err_code") in _BUSY:
        return LogUnavailable(message)
    return LogError(message)


class _PublishAcks:
    """JetStream's acknowledgements of publishes, on one subscription to a wildcard inbox: a future
    per publish, answered as nats-py's ``JetStreamContext.publish`` answers (the stored sequence; an
    APIError for a refusal; NoStreamResponseError where no stream took the subject)."""

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._sub: Any = None
        # Appends that start while the subscription is being made wait for it (not make a second one).
        self._subscribing = asyncio.Lock()
        self._numbers = itertools.count()
        self._waiting: dict[str, asyncio.Future[int]] = {}  # reply subject -> its publish's sequence

    async def expect(self) -> tuple[str, asyncio.Future[int]]:
        """A reply subject for one publish, and the future its acknowledgement answers."""
        if self._sub is None:
            async with self._subscribing:
                if self._sub is None:
                    self._sub = await self._nc.subscribe(f"{self._prefix}.*", cb=self._answer)
        reply = f"{self._prefix}.{next(self._numbers)}"
        ack: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[reply] = ack
        return reply, ack

    async def close(self) -> None:
        """Unsubscribe; an append still waiting gets no answer (it times out)."""
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):  # (a connection closing meanwhile takes it anyway)
                await sub.unsubscribe()

    def forget(self, acks: Sequence[asyncio.Future[int]]) -> None:
        """Stop waiting for ``acks`` (answered, or given up on: a late answer is dropped)."""
        for ack in acks:
            if not ack.done():
                ack.cancel()
        if len(self._waiting) > 0:
            self._waiting = {reply: ack for reply, ack in self._waiting.items() if not ack.done()}

    async def _answer(self, msg: Msg) -> None:
        ack = self._waiting.pop(msg.subject, None)
        if ack is None or ack.done():
            return
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":  # no responders
            ack.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            answer = msgspec.json.decode(msg.data)
            if "error" in answer:
                nats.js.errors.APIError.from_error(answer["error"])  # (raises the error's class)
            ack.set_result(int(answer["seq"]))
        except Exception as exc:  # (an answer that is no acknowledgement is the publish's failure)
            ack.set_exception(exc)


# A request's inbox is kept at most this long for its verdict: its sender gave up long before, and an
# inbox kept longer (a copy the stream dropped as a duplicate is never fetched) would take the verdict
# of a later request of the same bytes.
REQUEST_PATIENCE_S = 60.0
MSG_ID_HEADER = "Nats-Msg-Id"
PULL_GRACE_S = 1.0  # a durable consumer's pull not ended by the server this long after it expired is over


def _request_key(subject: str, data: bytes, msg_id: str) -> bytes:
    """What ties a plain request to its stored copy: its subject, its bytes, and its Nats-Msg-Id, so
    that a retry under one id is never mistaken for another request of the same bytes."""
    return hashlib.blake2b(subject.encode() + b"\x00" + msg_id.encode() + b"\x00" + data, digest_size=16).digest()


class _JetStreamConsumer(DurableConsumer):
    """A durable pull consumer. On the intake stream it also learns the reply
    inbox of plain NATS requests (the stream keeps no reply subject), so the
    verdict can answer them: a core subscription sees the request first and
    the stored copy is matched to it by subject, content and Nats-Msg-Id. Requests
    under one Nats-Msg-Id are one submission (the stream keeps the first copy and
    drops the rest as duplicates): every one still waiting hears the verdict."""

    def __init__(self, log_: JetStreamLog, stream: str, name: str, ack_wait: float) -> None:
        self._log = log_
        self._stream = stream
        self._name = name
        self._ack_wait = ack_wait
        self._sub: Any = None
        self._inbox = ""  # each pull is answered on a subject below it (``_reply``: the open one's)
        self._reply = ""
        self._pulls = itertools.count()
        self._arrived: collections.deque[Msg] = collections.deque()  # delivered, not fetched yet
        self._wake = asyncio.Event()  # something arrived, or a pull ended
        self._pull_left = 0  # messages the open pull may still bring (0: none is open)
        self._pull_until = 0.0  # (monotonic) when the open pull is over, at the latest
        self._lost = False  # the server ended a pull unexpectedly: subscribe again
        self._requests: Any = None
        # (oldest first; an OrderedDict drops its oldest at once, where a dict scans the holes of earlier drops)
        self._reply_inboxes: collections.OrderedDict[bytes, collections.deque[tuple[str, float]]] = (
            collections.OrderedDict()
        )  # request key -> (inbox, when it was seen), oldest first

    async def _watch_requests(self) -> None:
        if self._requests is not None or self._stream != HERD_INTAKE:
            return

        async def remember(msg: Any) -> None:
            headers = msg.headers or {}
            if msg.reply and not headers.get(REPLY_HEADER):
                key = _request_key(msg.subject, msg.data, headers.get(MSG_ID_HEADER, ""))
                inboxes = self._reply_inboxes.setdefault(key, collections.deque(maxlen=64))
                inboxes.append((msg.reply, time.monotonic()))
                if len(self._reply_inboxes) > 10_000:  # forget the oldest unanswered requests
                    self._reply_inboxes.popitem(last=False)

        self._requests = await self._log.nc.subscribe(f"{INTAKE_PREFIX}.>", queue=f"{self._name}-requests", cb=remember)

    async def _subscription(self) -> Any:
        """The consumer (made if missing; one that exists is used as it is) and this reader's inbox for
        its pulls, answered by a callback: nats-py's ``fetch`` waits on each message with a task, a
        timer and a uuid (3-4x the client's CPU per message, measured: the scheduler's intake)."""
        if self._sub is None:
            js = self._log.js
            try:
                await js.consumer_info(self._stream, self._name)
            except nats.js.errors.NotFoundError:
                config = ConsumerConfig(
                    durable_name=self._name,
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=self._ack_wait,
                    deliver_policy=DeliverPolicy.ALL,
                    max_ack_pending=10_000,
                )
                await js.add_consumer(self._stream, config)
            self._inbox = self._log.nc.new_inbox()
            self._pull_left = 0
            self._sub = await self._log.nc.subscribe(f"{self._inbox}.*", cb=self._delivered)
        return self._sub

    async def _delivered(self, msg: Msg) -> None:
        """A message of a pull, or the server's word that a pull is over (a status: 404/408 nothing
        more before it expired; 409 e.g. the consumer was deleted or its leader changed). Each pull
        has a reply subject of its own, where its end comes: an earlier one's says nothing of the
        open one."""
        status = (msg.headers or {}).get("Status") if not msg.data else None
        if status is None:  # (delivered under its stored subject: counted against the open pull)
            self._arrived.append(msg)
            self._pull_left -= 1
        elif status == "100" or msg.subject != self._reply:  # (a heartbeat, none asked for; an earlier pull's end)
            return
        else:
            self._pull_left = 0
            if status not in ("404", "408"):
                log.warning(
                    "intake pull ended by the server", consumer=self._name, status=status,
                    description=(msg.headers or {}).get("Description", ""),
                )  # fmt: skip
                self._lost = True  # (the consumer may be gone: looked up, or made, again)
        self._wake.set()

    async def _pull(self, max_messages: int, wait_s: float) -> None:
        """Ask for up to ``max_messages``, waiting at most ``wait_s`` for them, unless a pull is open."""
        now = time.monotonic()
        if self._pull_left > 0 and now < self._pull_until:
            return
        self._pull_left = max_messages
        # (A pull whose end never came, lost in a reconnect, is given up on a little after it expired.)
        self._pull_until = now + wait_s + PULL_GRACE_S
        self._reply = f"{self._inbox}.{next(self._pulls)}"
        request = msgspec.json.encode({"batch": max_messages, "expires": max(int(wait_s * 1e9), 1_000_000)})
        await self._log.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self._stream}.{self._name}", request, reply=self._reply)

    async def open(self) -> None:
        await self._watch_requests()
        await self._subscription()

    async def close(self) -> None:
        """Unsubscribe at once: left to the connection's drain, a subscription with a pull open
        would hold the drain until the pull expires (seconds of a service's shutdown)."""
        await self._unsubscribe()
        requests, self._requests = self._requests, None
        if requests is not None:
            with contextlib.suppress(Exception):
                await requests.unsubscribe()

    async def _unsubscribe(self) -> None:
        """Stop pulling: what arrived and was not fetched is left unacknowledged (delivered again
        after ack_wait, to whoever reads next)."""
        sub, self._sub = self._sub, None
        self._arrived.clear()
        self._pull_left = 0
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def fetch(self, max_messages: int = 64, timeout: float = 1.0) -> list[Delivery]:
        try:
            await self._watch_requests()
            if self._lost:
                self._lost = False
                await self._unsubscribe()
            await self._subscription()
            deadline = time.monotonic() + timeout
            while not self._arrived:  # (a pull may end before the wait does: another is asked for)
                wait_s = deadline - time.monotonic()
                if wait_s <= 0:
                    break
                self._wake.clear()
                await self._pull(max_messages, wait_s)
                if not self._arrived:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait_s)
        except (nats.errors.Error, nats.js.errors.Error, ConnectionError) as exc:
            log.warning("durable consumer fetch failed; retrying", consumer=self._name, error=repr(exc))
            await self._unsubscribe()
            await asyncio.sleep(0.2)
            return []
        arrived = self._arrived
        msgs = [arrived.popleft() for _ in range(min(max_messages, len(arrived)))]
        out = []
        for msg in msgs:
            meta = msg.metadata
            headers = dict(msg.headers or {})
            if REPLY_HEADER not in headers:
                inboxes = self._waiting_inboxes(msg.subject, msg.data, headers.get(MSG_ID_HEADER, ""))
                if inboxes:
                    headers[REPLY_HEADER] = inboxes[0]
                    if len(inboxes) > 1:
                        headers[ALSO_REPLY_HEADER] = ",".join(inboxes[1:])
            out.append(
                Delivery(
                    seq=meta.sequence.stream,
                    subject=msg.subject,
                    data=msg.data,
                    headers=headers,
                    at=meta.timestamp.timestamp(),
                    deliveries=meta.num_delivered,
                    token=msg,
                )
            )
        return out

    def _waiting_inboxes(self, subject: str, data: bytes, msg_id: str) -> list[str]:
        """The inboxes a stored intake message answers: under a Nats-Msg-Id, every request of it still
        waiting; without one, the oldest (each such request is stored, and answered, once)."""
        key = _request_key(subject, data, msg_id)
        waiting = self._reply_inboxes.get(key)
        if not waiting:
            return []
        patience = time.monotonic() - REQUEST_PATIENCE_S
        while waiting and waiting[0][1] < patience:
            waiting.popleft()
        if msg_id:
            inboxes = [inbox for inbox, _ in waiting]
            waiting.clear()
        else:
            inboxes = [waiting.popleft()[0]] if waiting else []
        if not waiting:
            del self._reply_inboxes[key]
        return inboxes

    async def ack(self, delivery: Delivery) -> None:
        msg = delivery.token
        if msg is not None:
            # Not ack_sync: a lost ack only means a redelivery, which the verdict's id makes a no-op,
            # and a round trip per submission would bound intake by the server's latency.
            with contextlib.suppress(nats.errors.Error):
                await msg.ack()

    async def in_progress(self, delivery: Delivery) -> None:
        msg = delivery.token
        if msg is not None:
            # (+WPI, by stream sequence: any delivery's token of the message restarts its ack wait.
            # Lost, the message is delivered again, and its handler skips it while it is in flight.)
            with contextlib.suppress(nats.errors.Error):
                await msg.in_progress()


class _JetStreamLeadership(Leadership):
    def __init__(self, log_: JetStreamLog, name: str, holder: str) -> None:
        self._log = log_
        self.name = name
        self.holder = holder
        self.ttl = log_.leadership_ttl
        self._revision: int | None = None

    @property
    def _kv(self) -> Any:
        return self._log._kv[LEADERSHIP_BUCKET]

    async def try_acquire(self) -> bool:
        try:
            self._revision = await self._kv.create(self.name, self.holder.encode())
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        except nats.js.errors.APIError as exc:
            if exc.err_code != ERR_WRONG_LAST_SEQUENCE:
                raise
        # Already ours (e.g. we restarted within the TTL under the same holder id)?
        try:
            entry = await self._kv.get(self.name)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return False
        if entry.value == self.holder.encode():
            self._revision = entry.revision
            return True
        return False

    async def renew(self) -> None:
        if self._revision is None:
            raise LeadershipLost(f"leadership {self.name!r} was never acquired by {self.holder!r}")
        try:
            self._revision = await self._kv.update(self.name, self.holder.encode(), last=self._revision)
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
            if await self.try_acquire():  # it expired unclaimed: ours again
                log.warning("leadership expired during an outage and was taken again", leadership=self.name)
                return
            raise LeadershipLost(f"leadership {self.name!r} is no longer held by {self.holder!r}") from exc

    async def release(self) -> None:
        if self._revision is None:
            return
        with contextlib.suppress(Exception):
            await self._kv.delete(self.name, last=self._revision)
        self._revision = None
