"""The log's NATS client parses a message's headers as nats-py does, only quicker (``_Client``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient

from gpuherd.log.jetstream import _Client

# Header blocks as the server sends them, and what no writer should send: names with spaces or
# control characters, non-ASCII bytes, lines without a colon, empty lines, bad UTF-8 in values.
_pieces = st.sampled_from(
    [b"Nats-Msg-Id", b"Gpuherd-Page", b"traceparent", b" x ", b"a b", b"a\tb", b"a\x1cb", b"\xc3\xa9", b"", b":", b"7"]
)
_values = st.binary(max_size=12) | st.sampled_from([b" 00-ab-cd-01", b"\xff\xfe", b" job:1..job:9#9 "])
_lines = st.tuples(_pieces, st.sampled_from([b":", b": ", b"", b"::"]), _values).map(b"".join)


@given(st.lists(_lines, max_size=6), st.booleans())
def test_headers_parse_as_nats_py_parses_them(lines: list[bytes], ends_blank: bool) -> None:
    raw = b"\r\n".join(lines) + (b"\r\n\r\n" if ends_blank else b"")
    assert _Client._parse_header_lines(raw) == NatsClient._parse_header_lines(raw)


def test_the_headers_a_page_carries() -> None:
    raw = b"Gpuherd-Page: 3\r\nNats-Msg-Id: a..c#3\r\nNats-Expected-Last-Subject-Sequence: 12\r\n\r\n"
    assert _Client._parse_header_lines(raw) == {
        "Gpuherd-Page": "3",
        "Nats-Msg-Id": "a..c#3",
        "Nats-Expected-Last-Subject-Sequence": "12",
    }
