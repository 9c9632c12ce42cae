"""Specific exceptions, each with a message a user can act on."""

from __future__ import annotations

import msgspec

# What decoding bytes from outside (a submission, a stored page, a file, a message) may raise:
# msgspec raises ``UnicodeDecodeError``, which is no ``msgspec.DecodeError``, for a string that is
# not UTF-8. (A ``msgspec.ValidationError`` is a ``DecodeError``.)
UNDECODABLE: tuple[type[ValueError], ...] = (msgspec.DecodeError, UnicodeDecodeError)


class GpuherdError(Exception):
    """Base of every gpuherd error."""


class EventDecodeError(GpuherdError):
    """Stored bytes are not a known event (or an old version without an upcaster)."""


class LogError(GpuherdError):
    """The event log could not carry out a request."""


class LogUnavailable(GpuherdError):
    """The log cannot take the request right now (server restarting, no quorum); retrying is safe."""


class ConcurrencyError(LogError):
    """An aggregate changed since the writer last read it (expected subject sequence did not match)."""

    def __init__(self, subject: str, expected: int, actual: int | None = None) -> None:
        self.subject = subject
        self.expected = expected
        self.actual = actual
        found = "" if actual is None else f", found {actual}"
        super().__init__(
            f"{subject} changed since it was read (expected last sequence {expected}{found}); "
            "re-read the aggregate and decide again"
        )


class LeadershipLost(GpuherdError):
    """Another instance holds the leadership now; this one must stop deciding."""


class SubmissionError(GpuherdError):
    """The cluster rejected a job submission; the message says why."""


class NatsServerError(GpuherdError):
    """The embedded nats-server could not be started."""
