"""HTTP/1.1 wire helpers shared by the client side, the upstream side and the relay:
which headers belong to one connection, which are never passed on, reason phrases."""

from __future__ import annotations

from http import HTTPStatus

#: Headers that describe one connection, not the message (RFC 9110 7.6.1, and the
#: old ``keep-alive`` / ``proxy-connection``): never passed on, in either direction.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Upstream response headers never relayed as they are: the sidecar frames every
#: answer itself (its own length or chunking, its own ``X-Cache``).
FORWARD_DROP = HOP_BY_HOP | {b"content-length", b"x-cache"}
#: Client request headers not sent upstream: the upstream connection has its own
#: framing and host, and the sidecar answers ``Expect`` itself.
REQUEST_DROP = HOP_BY_HOP | {b"content-length", b"host", b"expect"}

_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}


def reason_phrase(status: int) -> bytes:
    """The reason phrase of ``status`` (``b"Unknown"`` for a code HTTP does not name)."""
    return _PHRASES.get(status, b"Unknown")
