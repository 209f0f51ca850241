"""The memos the WSGI middleware keeps of response values (status lines, declared
Content-Length values): every answer stays right, and a spray of values keeps them
bounded in entries and bytes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gatekeeper_wsgi import GateKeeperMiddleware
from gatekeeper_wsgi.kernel import DECLARED_LENGTHS, declared_length
from gatekeeper_wsgi.resolve import MEMO_KEY_CHARS, MEMO_SIZE

SETTINGS = {"project": "shop", "limits": {"shop": {"concurrency": 1}}}


def _app(length: str) -> Callable[..., Iterator[bytes]]:
    """An app declaring ``Content-Length: length`` and streaming two chunks of 2 bytes."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", length)])
        return iter([b"ab", b"cd"])  # not a list: the declared length is what is read

    return app


def _released_after_declared_body(length: str) -> bool:
    """Whether the slot came back once ``length`` bytes were handed out, before the
    server asked for more or closed the response."""
    middleware = GateKeeperMiddleware(_app(length), SETTINGS)
    environ = {"PATH_INFO": "/orders", "REMOTE_ADDR": "127.0.0.1"}
    response = middleware(environ, lambda status, headers, exc_info=None: None)
    body = iter(response)
    next(body)
    next(body)  # 4 bytes handed out
    released = environ["gatekeeper.admission"].released
    list(body)
    response.close()  # type: ignore[attr-defined]
    assert environ["gatekeeper.admission"].released
    middleware.gatekeeper.close()
    return bool(released)


def test_a_declared_length_releases_at_its_last_byte_memo_or_not() -> None:
    """A plain Content-Length (blanks around it are no part of the value, RFC 9110 5.5)
    releases at its last byte, the first time and when read from the memo; other
    spellings (non-ASCII digits, 5000 digits, signs) release only when the body is
    exhausted."""
    for plain in ("4", " 4", "4\t"):
        assert _released_after_declared_body(plain)
        assert _released_after_declared_body(plain)  # from the memo now
    for odd in ("\u0664", "+4", "4" * 5000, "4.0", ""):
        assert not _released_after_declared_body(odd)
        assert not _released_after_declared_body(odd)


def test_a_spray_of_content_lengths_keeps_the_memo_bounded() -> None:
    """New Content-Length values past the memo's size start it over; values longer than
    MEMO_KEY_CHARS are never stored; every one is still read right."""
    middleware = GateKeeperMiddleware(_app("0"), SETTINGS)
    for n in range(MEMO_SIZE + 100):
        value = str(10**6 + n)
        assert declared_length(value) == 10**6 + n
        assert len(DECLARED_LENGTHS) <= MEMO_SIZE
    huge = "9" * (MEMO_KEY_CHARS + 1)
    assert declared_length(huge) is None
    assert huge not in DECLARED_LENGTHS
    middleware.gatekeeper.close()
