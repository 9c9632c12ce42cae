"""The job <-> agent control protocol: what a job's processes (and their shim) tell their node agent.

One datagram per message, on the agent's control socket (``GPUHERD_AGENT_ADDR``); JSON, tagged by
``kind``. Senders are ``gpuherd.train`` (progress, rescales, lease releases, profiles) and the
task's shim (workers that died); the agent decodes with ``decode_message`` and never acts on a
message that does not validate.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gpuherd.errors import UNDECODABLE


class Message(msgspec.Struct, kw_only=True, frozen=True, tag_field="kind"):
    job: str
    attempt: int
    at: float = 0.0  # when the sender sent it (its own clock)


class Progress(Message, tag="metrics", kw_only=True, frozen=True):
    """A rank's progress: its step and what it measured (loss, samples/s, ...)."""

    rank: int = 0
    step: int
    values: dict[str, float] = msgspec.field(default_factory=dict)


RescaleOutcome = Literal["completed", "failed", "peer-lost", "left"]


class RescaleReport(Message, tag="rescale", kw_only=True, frozen=True):
    """An elastic worker's word on a rescale: the new rank 0's first step at the new size
    (``completed``, with each phase's time), a switch that failed, a lost peer, or its leaving."""

    rank: int = 0
    event: RescaleOutcome
    generation: int
    world: int = 0
    world_before: int = 0
    samples_per_s_before: float | None = None
    times: dict[str, float | None] = msgspec.field(default_factory=dict)
    reason: str = ""
    step: int = 0


class WorkerExit(Message, tag="worker-exit", kw_only=True, frozen=True):
    """The shim saw an elastic worker end with a non-zero code (or fail to start)."""

    node: str = ""
    gpu: int
    code: int
    reason: str = ""


class LeaseReleased(Message, tag="lease-released", kw_only=True, frozen=True):
    """The runtime gave back its shares on lender ``gpus`` of a revoked lease (empty: all of it)."""

    rank: int = 0
    lease: str
    gpus: tuple[int, ...] = ()
    reason: str = "revoked"


class LeaseHeld(Message, tag="lease-held", kw_only=True, frozen=True):
    """What the runtime holds of a lease now: MiB allocated on each lender GPU (device memory only;
    a share it could not allocate, or keeps in host memory, is not in it). Sent whenever it read
    the lease file, so the agent's memory reports tell the borrowers' part of a lender's use from
    its owner's or strays' (a share granted but not yet allocated is none of it)."""

    rank: int = 0
    lease: str
    held_mb: dict[int, int] = msgspec.field(default_factory=dict)


class ProfileReady(Message, tag="profile", kw_only=True, frozen=True):
    """A rank wrote its per-layer profile (``file``, in the task folder) answering ``request``."""

    rank: int = 0
    request: str = ""
    file: str


AgentMessage = Progress | RescaleReport | WorkerExit | LeaseReleased | LeaseHeld | ProfileReady

MAX_MESSAGE_BYTES = 65536
_decoder = msgspec.json.Decoder(AgentMessage)
_encoder = msgspec.json.Encoder()


class MessageError(ValueError):
    """A datagram that is not a valid message of the protocol."""


def encode_message(message: AgentMessage) -> bytes:
    return _encoder.encode(message)


def decode_message(data: bytes) -> AgentMessage:
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        return _decoder.decode(data)
    except UNDECODABLE as exc:
        raise MessageError(str(exc)) from None
