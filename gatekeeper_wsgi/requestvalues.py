"""What is made of request values: bounded memos, and values made safe as path segments.

Request values (paths, header values, addresses) are chosen by clients, so whatever is
cached by them is bounded in entries and in bytes (:func:`remember`, SPEC §4.5), and
whatever becomes part of a limit path is a plain name or a short digest
(:func:`key_segment`, :func:`ip_segment`). The resolver, the request identification,
the WSGI middleware and the framework plugins all use these, so each rule is written
once. A leaf module: it imports only the value types.
"""

from __future__ import annotations

import hashlib
import ipaddress
from typing import TypeVar

from gatekeeper_wsgi.values import CALLER_RE

__all__ = [
    "MEMO_KEY_CHARS",
    "MEMO_SIZE",
    "content_length",
    "ip_segment",
    "key_segment",
    "remember",
    "wsgi_string",
]

K = TypeVar("K")
V = TypeVar("V")

#: Entries a memo of request values keeps before it starts over (bounds hostile sprays).
MEMO_SIZE = 16_384
#: The longest request value (characters) a memo keeps: longer ones are computed afresh
#: each time, so a memo holds at most MEMO_SIZE x ~1 KiB (SPEC §4.5: bounded in bytes).
MEMO_KEY_CHARS = 256
# (REMOTE_ADDR, ipv6_prefix) -> its key segment, for routes whose caller level is not
# memoized whole (candidates reading different request values).
_NETWORK_MEMO: dict[tuple[str, int], str] = {}
# Longer than any textual IP address (45 chars, IPv4-mapped) with a zone id: not parsed.
_ADDRESS_CHARS = 64


def remember(memo: dict[K, V], key: K, value: V, size: int) -> V:
    """Store ``value`` in a memo of request values and return it; a full memo starts over,
    so a spray of new values costs a little time and never memory. ``size`` is how many
    characters of request text ``key`` holds: over MEMO_KEY_CHARS it is not stored, so
    8 KiB headers or 4 KiB paths cost their computation, never the memo's bytes. (Memos
    are read with a bare ``dict.get``; only a miss comes here.)"""
    if size > MEMO_KEY_CHARS:
        return value
    if len(memo) >= MEMO_SIZE:
        memo.clear()
    memo[key] = value
    return value


def content_length(value: str) -> int | None:
    """The body length a ``Content-Length`` value states (a response's or a request's),
    None unless it is a plain number of at most 18 digits (zeros before them are none).
    The blanks around a field value are not part of it (RFC 9110 5.5); isdigit() alone
    admits non-ASCII digits; 18 digits bound int()'s work."""
    digits = value.strip(" \t")
    if not (digits.isascii() and digits.isdigit()):
        return None
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else None


def key_segment(value: str | None) -> str:
    """A request-derived value made safe to use as a path segment and in logs.

    Values that are not plain names (``[A-Za-z0-9._:@-]``, ≤ 128 chars) are replaced by a
    short stable digest, so hostile input can neither forge a path nor bloat a key.
    Missing values count together as ``-``.
    """
    if not value:
        return "-"
    if CALLER_RE.fullmatch(value):
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8)
    return "~" + digest.hexdigest()


def ip_segment(value: object, ipv6_prefix: int) -> str:
    """The key segment of a client address (``key = "ip"``).

    An IPv4 address counts as itself; an IPv6 address by its network of ``ipv6_prefix``
    bits, written ``2001:db8::-64`` (``/`` separates path segments), so one host cannot
    spray the 2^64 addresses of its /64; an IPv4-mapped IPv6 address (``::ffff:10.0.0.7``)
    as its IPv4 address; one in brackets (``[2001:db8::7]``) as without. Anything else is
    made safe by :func:`key_segment`.
    """
    if isinstance(value, str) and "%" in value:
        # An IPv6 zone (fe80::1%eth0) names a link of this host, not the client, and its
        # /64 counts the same: cut, so long ones cannot pass the length check below as
        # a key each.
        head, _, zone = value.partition("%")
        value = head + ("]" if zone.endswith("]") else "")
    if not isinstance(value, str) or len(value) > _ADDRESS_CHARS:
        return key_segment(value if isinstance(value, str) else None)
    found = _NETWORK_MEMO.get((value, ipv6_prefix))
    if found is None:
        found = remember(
            _NETWORK_MEMO, (value, ipv6_prefix), _network(value, ipv6_prefix), len(value)
        )
    return found


def _network(value: str, ipv6_prefix: int) -> str:
    # A proxy may write an address as in a URL: an IPv6 one in brackets, either with a
    # port (Azure's X-Forwarded-For: 203.0.113.7:51234, [2001:db8::7]:443). The same
    # client whatever its port: counted as the address, or a client would get a key per
    # source port.
    text = value
    if value[:1] == "[":
        close = value.find("]")
        port = value[close + 2 :]
        if close > 0 and (
            close == len(value) - 1
            or (value[close + 1] == ":" and port.isascii() and port.isdigit())
        ):
            text = value[1:close]
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
        if port.isascii() and port.isdigit():
            text = host
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return key_segment(value)
    if isinstance(address, ipaddress.IPv4Address):
        return str(address)
    mapped = address.ipv4_mapped
    if mapped is not None:
        return str(mapped)
    host_bits = 128 - ipv6_prefix
    network = ipaddress.IPv6Address(int(address) >> host_bits << host_bits)
    return f"{network}-{ipv6_prefix}"


def wsgi_string(text: str) -> str:
    """Text a framework decoded from a PEP 3333 string (a path, its bytes read as UTF-8),
    back in PEP 3333's form: those bytes as latin-1 (what an environ's ``SCRIPT_NAME`` and
    ``PATH_INFO`` hold, and what the status app encodes into a redirect or a cookie path)."""
    return text.encode("utf-8", "surrogateescape").decode("latin-1")
