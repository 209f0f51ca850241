"""Token access to the operations endpoints: one check for the status app, Flask's status
blueprint and Django's status views (:func:`check_token`), and the bearer parsing the
frequency service shares (:func:`bearer_token`).

Scrapers send ``Authorization: Bearer <token>``. Browsers open a ``?token=<token>`` link
once; it is answered with a redirect to the same URL without the token and a cookie
derived from it, so the token does not stay in the address bar, history, or the access
logs of later requests - whatever else lets the request in (a staff session, an auth
hook, a bearer header).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import quote, unquote, unquote_plus

from werkzeug.http import parse_cookie

from gatekeeper_wsgi.redact import split_query

__all__ = [
    "COOKIE_NAME",
    "bearer_token",
    "check_token",
    "parse_bearer",
    "presents_token",
    "same_token",
    "token_link",
]

#: The cookie a ``?token=`` link is exchanged for (its value is derived from the token).
COOKIE_NAME = "gatekeeper_dashboard"
# Request values longer than this are not parsed for credentials: a token is short, and a
# megabyte of cookies or query must cost nothing.
_MAX_CREDENTIAL_INPUT = 8192

Denied = tuple[str, str, list[tuple[str, str]]]
_WRONG_TOKEN: Denied = ("403 Forbidden", "forbidden: wrong token", [])


def _cookie_value(token: str) -> str:
    # An HMAC of the token, not the token: the cookie proves a visit with the token, and
    # cannot be turned back into it (e.g. from a browser profile or a proxy's log).
    return hmac.new(
        token.encode("utf-8"), b"gatekeeper-wsgi dashboard cookie 1", hashlib.sha256
    ).hexdigest()


def bearer_token(environ: Mapping[str, Any]) -> str | None:
    """The token of the request's ``Authorization: Bearer <token>`` header, if any."""
    return parse_bearer(environ.get("HTTP_AUTHORIZATION", ""))


def parse_bearer(header: object) -> str | None:
    """The token of an ``Authorization`` header value of the Bearer scheme, if it is one."""
    if not isinstance(header, str) or len(header) > _MAX_CREDENTIAL_INPUT:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return None


def _cookie(environ: Mapping[str, Any]) -> str | None:
    header = environ.get("HTTP_COOKIE", "")
    if not isinstance(header, str) or COOKIE_NAME not in header:
        return None
    if len(header) > _MAX_CREDENTIAL_INPUT:
        return None
    # werkzeug's parser, not http.cookies: SimpleCookie drops every cookie after one it
    # finds malformed, and other apps of the same site may set such cookies.
    return parse_cookie(header).get(COOKIE_NAME) or None


class TokenLink(NamedTuple):
    """The ``token`` parameter of a query string and the query string without it."""

    #: the value as a form decodes it (``+`` is a space)
    token: str
    rest: str
    #: the value with ``+`` kept: a base64 token (``openssl rand -base64``) pasted into a
    #: link as it is, which a browser sends as it is
    literal: str

    def names(self, token: str) -> bool:
        """Whether the link carries ``token``, read either way (in constant time each)."""
        return same_token(self.token, token) or same_token(self.literal, token)


# Bytes a request target cannot carry raw (controls, space, '#', non-ASCII): written
# percent-encoded in the Location, so a header never carries them; all else kept as sent.
_LOCATION_QUERY_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "#")


def token_link(environ: Mapping[str, Any]) -> TokenLink | None:
    """The ``token`` of the query string (the last, if several) and the query string
    without every parameter whose name decodes to ``token``, each other byte as sent."""
    query = environ.get("QUERY_STRING", "")
    if not isinstance(query, str) or not query or len(query) > _MAX_CREDENTIAL_INPUT:
        return None
    pieces = split_query(query)  # parameter, separator, parameter, ...
    linked: str | None = None
    kept: list[str] = []
    for index in range(0, len(pieces), 2):
        name, _, value = pieces[index].partition("=")
        if unquote_plus(name) == "token":  # decoded as parse_qsl decodes
            linked = value
        else:
            # A kept parameter keeps the separator sent before it (the first none).
            kept.append(pieces[index - 1] + pieces[index] if index and kept else pieces[index])
    if linked is None:
        return None
    return TokenLink(unquote_plus(linked), "".join(kept), unquote(linked))


def same_token(presented: str, expected: str) -> bool:
    """Whether two tokens are equal, in constant time."""
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def presents_token(environ: Mapping[str, Any]) -> bool:
    """Whether a request carries a dashboard credential at all (a bearer token, the
    exchanged cookie or a ``?token=``), right or wrong: Django sends anonymous browsers
    without one to its login page instead."""
    return (
        bearer_token(environ) is not None
        or _cookie(environ) is not None
        or token_link(environ) is not None
    )


def check_token(
    environ: Mapping[str, Any], token: str | None, *, allowed: bool = False
) -> Denied | None:
    """The dashboard access check: None when the request may see the status, else the
    response to send as (status, message, headers). ``allowed``: the hosting framework
    already lets the request in (Django staff, Flask's auth hook).

    Accepted: ``allowed``, ``Authorization: Bearer <token>``, or the
    ``gatekeeper_dashboard`` cookie. A ``?token=`` in the URL is never served: a right one
    is answered with a redirect (303) to the same URL without it, setting that cookie
    (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over HTTPS, scoped to the mount point),
    whatever else lets the request in, so the token never stays in URLs, history or access
    logs; a wrong one is removed by the same redirect (without a cookie) when something
    else lets the request in, else refused (403). No credential (or the cookie of a
    replaced token): 401 with a Bearer challenge; a wrong token, or none configured: 403;
    a query string too long to look for a token in: 414.
    """
    query = environ.get("QUERY_STRING", "")
    if isinstance(query, str) and len(query) > _MAX_CREDENTIAL_INPUT:
        # Too long to look for a token in (a token is short, a megabyte must cost
        # nothing), and so too long to serve: it may carry one, which must not stay in
        # the URL (no status URL needs such a query).
        return "414 URI Too Long", "the query string is too long", []
    link = token_link(environ)
    if link is not None and token is not None and link.names(token):
        return _see_without_token(environ, link.rest, cookie=_cookie_header(environ, token))
    denied = None if allowed else _check_credentials(environ, token)
    if link is None:
        return denied
    if denied is None:
        # Let in by other means: the wrong (perhaps an old) token still leaves the URL.
        return _see_without_token(environ, link.rest, cookie=None)
    return denied if token is None else _WRONG_TOKEN


def _check_credentials(environ: Mapping[str, Any], token: str | None) -> Denied | None:
    """The bearer header, else the cookie: None when right, else the refusal."""
    if token is None:
        return "403 Forbidden", "forbidden: the status endpoint needs a token", []
    bearer = bearer_token(environ)
    if bearer is not None:
        return None if same_token(bearer, token) else _WRONG_TOKEN
    cookie = _cookie(environ)
    if cookie is not None and same_token(cookie, _cookie_value(token)):
        return None
    challenge = [("WWW-Authenticate", 'Bearer realm="gatekeeper"')]
    return "401 Unauthorized", "a bearer token is required", challenge


def _see_without_token(environ: Mapping[str, Any], rest: str, *, cookie: str | None) -> Denied:
    """A 303 to this URL with the query string ``rest`` (the token removed)."""
    script_name = str(environ.get("SCRIPT_NAME", "")).rstrip("/")
    path = str(environ.get("PATH_INFO") or "/")
    # PEP 3333 strings are bytes as latin-1; a leading "//" would name another host.
    location = "/" + quote((script_name + path).encode("latin-1", "replace"), safe="/").lstrip("/")
    if rest:
        raw = rest.encode("latin-1", "replace")
        location += "?" + quote(raw, safe=_LOCATION_QUERY_SAFE)
    headers = [("Location", location)]
    if cookie is not None:
        headers.append(("Set-Cookie", cookie))
    return "303 See Other", "see this page without the token", headers


def _cookie_header(environ: Mapping[str, Any], token: str) -> str:
    """The Set-Cookie value a right token link is exchanged for."""
    script_name = str(environ.get("SCRIPT_NAME", "")).rstrip("/")
    cookie_path = quote(script_name.encode("latin-1", "replace"), safe="/") or "/"
    secure = "; Secure" if environ.get("wsgi.url_scheme") == "https" else ""
    return (
        f"{COOKIE_NAME}={_cookie_value(token)}; Path={cookie_path}; HttpOnly; "
        f"SameSite=Strict{secure}"
    )
