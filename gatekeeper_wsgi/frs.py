"""The frequency-restrict service (FRS) endpoint: SPEC §8, for callers that are not Python.

A mountable WSGI app that answers ``query`` and ``update`` for a ``(biz_id, key)`` over the
same engine and backend as the middleware. A ``biz_id`` is a service of project ``frs``:
the rate limit ``frs/<biz_id>/*`` of the configuration (so it is hot-reloaded with the
rest), and the key is its third level, counted exactly as a request of that service from
that caller would be. Request and answer::

    POST  <request><cmd_type>update</cmd_type><key>alice</key><biz_id>login</biz_id></request>
          (or {"cmd_type": "update", "key": "alice", "biz_id": "login"})
    200   <response><result>0</result><msg>recorded</msg></response>

``result`` 0 means not restricted, 1 restricted. ``update`` is an admission: it records the
use when it fits (0), and records nothing when the key is already restricted (1). So with
``rate = "5/minute"`` exactly five updates in any minute answer 0, however many arrive at
once. ``query`` answers whether an ``update`` would answer 0 right now, and records nothing.
See ``docs/frs.md`` for the whole protocol and the Django and Flask mounting recipes.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from defusedxml import DTDForbidden, EntitiesForbidden, ExternalReferenceForbidden
from defusedxml.ElementTree import ParseError, fromstring

from gatekeeper_wsgi.access import parse_bearer, same_token
from gatekeeper_wsgi.engine import ConfigSource, GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.fault import accept_prefers_xml, xml_text
from gatekeeper_wsgi.requestvalues import content_length, key_segment
from gatekeeper_wsgi.resolve import Route
from gatekeeper_wsgi.values import CALLER_RE, Limit

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

__all__ = ["FRS_PROJECT", "MAX_BODY", "Answer", "FrequencyService", "Reply"]

logger = logging.getLogger("gatekeeper")

#: The project whose services are the biz ids.
FRS_PROJECT = "frs"
#: Larger request bodies are refused with 413 without being read.
MAX_BODY = 64 * 1024
_TOO_LARGE = f"body too large: at most {MAX_BODY} bytes"
COMMANDS = ("query", "update")
FIELDS = ("cmd_type", "key", "biz_id")

_XML_TYPES = ("application/xml", "text/xml")
_JSON_TYPES = ("application/json",)
_BOM = b"\xef\xbb\xbf"
_UNAUTHORIZED = "unauthorized: send Authorization: Bearer <token>"
# Engines whose unprotected endpoint was warned about: once each, not per instance (the
# Django recipe builds a FrequencyService per request).
_WARNED: weakref.WeakSet[GateKeeper] = weakref.WeakSet()
_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    405: "Method Not Allowed",
    413: "Content Too Large",
    503: "Service Unavailable",
}


class Answer(NamedTuple):
    """One reply of the service: HTTP status, ``result`` (None for errors) and ``msg``."""

    status: int
    result: int | None
    msg: str
    #: seconds, sent as ``Retry-After`` on 503
    retry_after: int | None = None


class _Refused(Exception):
    """The request cannot be answered; carries the error reply."""

    def __init__(self, status: int, msg: str) -> None:
        super().__init__(msg)
        self.answer = Answer(status, None, msg)


class FrequencyService:
    """WSGI app speaking the FRS protocol over a :class:`~gatekeeper_wsgi.GateKeeper`.

    ``config`` is a settings dict, a config file path, or the GateKeeper a
    :class:`~gatekeeper_wsgi.GateKeeperMiddleware` uses, so both count in the same
    windows::

        from werkzeug.middleware.dispatcher import DispatcherMiddleware
        from gatekeeper_wsgi import GateKeeperMiddleware
        from gatekeeper_wsgi.frs import FrequencyService

        site = GateKeeperMiddleware(app, {"limits": {"frs/login/*": {"rate": "5/minute"}}})
        application = DispatcherMiddleware(site, {"/frs": FrequencyService(site.gatekeeper)})

    Answers are XML, or JSON when ``Accept`` prefers ``application/json``.
    :meth:`query` and :meth:`update` are the same operations for Python callers.

    ``token``: HTTP requests must send ``Authorization: Bearer <token>``, else they get
    401 and count nothing. Without one, anyone who can reach the endpoint can use up any
    key's quota (a WARNING says so at start): give it a token, or keep it on a network
    only its callers reach.
    """

    def __init__(self, config: ConfigSource | GateKeeper, *, token: str | None = None) -> None:
        if token is not None and not token.strip():
            raise ValueError("FrequencyService token must not be empty (None: no token)")
        self.gatekeeper = config if isinstance(config, GateKeeper) else GateKeeper(config)
        self.token = token
        if token is None and self.gatekeeper not in _WARNED:
            _WARNED.add(self.gatekeeper)
            logger.warning(
                "gatekeeper: the frequency service has no token: anyone who can reach it can "
                "use up any key's quota. Pass FrequencyService(..., token=...) and send "
                "'Authorization: Bearer <token>', or keep it on a network only its callers "
                "reach (docs/frs.md)."
            )

    # --- the operations -------------------------------------------------------------------

    def query(self, biz_id: str, key: str) -> Answer:
        """Whether ``key`` is restricted for ``biz_id`` now (result 1), recording nothing."""
        return self.answer("query", biz_id, key)

    def update(self, biz_id: str, key: str) -> Answer:
        """Record one use of ``key`` for ``biz_id`` if it is not restricted (result 0);
        when it is (result 1) nothing is recorded."""
        return self.answer("update", biz_id, key)

    def answer(self, cmd_type: str, biz_id: str, key: str) -> Answer:
        """Run one command; invalid arguments give a 400 answer, never an exception."""
        try:
            return self._run(cmd_type, biz_id, key)
        except _Refused as refused:
            return refused.answer

    def _run(self, cmd_type: str, biz_id: str, key: str) -> Answer:
        if cmd_type not in COMMANDS:
            raise _Refused(400, "unknown cmd_type: expected 'query' or 'update'")
        if not key:
            raise _Refused(400, "missing field: key")
        if not CALLER_RE.fullmatch(biz_id):
            raise _Refused(
                400, "invalid biz_id: expected a name of [A-Za-z0-9._:@-], at most 128 characters"
            )
        keeper = self.gatekeeper
        route = keeper.route(FRS_PROJECT, biz_id)
        limit = _biz_limit(route)
        if limit is None:
            raise _Refused(
                400, f"unknown biz_id {biz_id}: no rate limit {FRS_PROJECT}/{biz_id}/* configured"
            )
        # The key is the third level whatever the limit counts by (caller, ip, user or a
        # header), so a middleware-limited endpoint and this service share its counts.
        environ = {c.environ_key: key for c in route.caller_candidates if c.environ_key}
        caller = key_segment(key)
        if cmd_type == "query":
            rejected = keeper.query(FRS_PROJECT, biz_id, caller, environ, key)
            return _not_restricted("not restricted") if rejected is None else _restricted(rejected)
        try:
            admission = keeper.admit(FRS_PROJECT, biz_id, caller, environ, key)
        except Rejected as rejected:
            return _restricted(rejected)
        # A limit that counts only some statuses (failed logins) records the use only if
        # given one of them: an update is such a use by definition.
        slots, _ = route.caller_level(caller, environ, key)
        counted = slots[-1].limit.count if len(slots) > len(route.slots) else None
        admission.release(min(counted) if counted else 200)
        return _not_restricted("recorded")

    # --- HTTP -----------------------------------------------------------------------------

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        method = str(environ.get("REQUEST_METHOD") or "GET")
        accept = str(environ.get("HTTP_ACCEPT") or "")
        if not self.authorized(environ.get("HTTP_AUTHORIZATION")):
            # Refused before the body is read: an unauthenticated client costs nothing.
            reply = _reply(Answer(401, None, _UNAUTHORIZED), accept, method)
            start_response(reply.status, reply.headers)
            return [reply.body]
        try:
            body = _read_body(environ) if method == "POST" else b""
        except _Refused as refused:
            reply = _reply(refused.answer, accept, method)
        else:
            content_type = str(environ.get("CONTENT_TYPE") or "")
            reply = self._respond(method, body, content_type, accept)
        start_response(reply.status, reply.headers)
        return [reply.body]

    def authorized(self, authorization: object) -> bool:
        """Whether an ``Authorization`` header value (None: absent) admits an HTTP request:
        always without a token, else when it is ``Bearer <token>``."""
        if self.token is None:
            return True
        presented = parse_bearer(authorization)
        return presented is not None and same_token(presented, self.token)

    def respond(
        self,
        method: str,
        body: bytes,
        *,
        content_type: str = "",
        accept: str = "",
        authorization: str | None = None,
    ) -> Reply:
        """The HTTP reply to one request, for framework views that read the body
        themselves: pass at most ``MAX_BODY + 1`` bytes of it (more is answered 413) and
        the request's ``Authorization`` header (checked when the service has a token)."""
        if not self.authorized(authorization):
            return _reply(Answer(401, None, _UNAUTHORIZED), accept, method)
        return self._respond(method, body, content_type, accept)

    def _respond(self, method: str, body: bytes, content_type: str, accept: str) -> Reply:
        if method != "POST":
            answer = Answer(405, None, "method not allowed: use POST")
        elif len(body) > MAX_BODY:
            answer = Answer(413, None, _TOO_LARGE)
        else:
            try:
                fields = _parse(body, content_type)
                answer = self._run(fields["cmd_type"], fields["biz_id"], fields["key"])
            except _Refused as refused:
                answer = refused.answer
        return _reply(answer, accept, method)


class Reply(NamedTuple):
    """A complete HTTP reply: status line, headers, body."""

    status: str
    headers: list[tuple[str, str]]
    body: bytes


def _reply(answer: Answer, accept: str, method: str) -> Reply:
    as_json = bool(accept) and accept_prefers_xml(accept) is False
    payload = _render(answer, as_json=as_json)
    headers = [
        ("Content-Type", "application/json" if as_json else "application/xml; charset=utf-8"),
        ("Content-Length", str(len(payload))),
        # Every update changes the answers: no cache may keep one.
        ("Cache-Control", "no-store"),
    ]
    if answer.status == 405:
        headers.append(("Allow", "POST"))
    elif answer.status == 401:
        headers.append(("WWW-Authenticate", 'Bearer realm="gatekeeper-frs"'))
    if answer.retry_after is not None:
        headers.append(("Retry-After", str(answer.retry_after)))
    status = f"{answer.status} {_REASONS[answer.status]}"
    return Reply(status, headers, b"" if method == "HEAD" else payload)


def _biz_limit(route: Route) -> Limit | None:
    """The rate limit that makes ``route.service`` a biz id: the caller-level limit of
    project ``frs`` that applies to every key (``frs/<biz_id>/*``, or ``frs/*/*``)."""
    for candidate in route.caller_candidates:
        if candidate.segment == "*":
            limit = candidate.limit
            if limit.segments[0] == FRS_PROJECT and limit.rate is not None:
                return limit
            return None
    return None


def _not_restricted(msg: str) -> Answer:
    return Answer(200, 0, msg)


def _restricted(rejected: Rejected) -> Answer:
    if rejected.code == "GK-RATE-LIMIT":
        msg = f"restricted by {rejected.limit_path} ({rejected.limit_value})"
        if rejected.retry_after is not None:
            msg += f"; retry in {rejected.retry_after} s"
        return Answer(200, 1, msg)
    # Not a verdict on the key: the service itself is overloaded or its backend is down.
    where = f" at {rejected.limit_path}" if rejected.limit_path else ""
    return Answer(503, None, f"{rejected.code}: {rejected.reason}{where}", rejected.retry_after)


# --- the wire format ----------------------------------------------------------------------


def _render(answer: Answer, *, as_json: bool = False) -> bytes:
    """The UTF-8 body of an answer: ``<response>`` XML, or the same members as JSON.
    Error answers carry no ``result``: the HTTP status says the request failed."""
    if as_json:
        members: dict[str, Any] = {} if answer.result is None else {"result": answer.result}
        members["msg"] = answer.msg
        return json.dumps(members, ensure_ascii=False).encode("utf-8", "replace")
    result = "" if answer.result is None else f"<result>{answer.result}</result>"
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<response>{result}<msg>{xml_text(answer.msg)}</msg></response>\n"
    ).encode("utf-8", "replace")


def _read_body(environ: WSGIEnvironment) -> bytes:
    text = str(environ.get("CONTENT_LENGTH") or "").strip()
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    if text:
        if not (text.isascii() and text.isdigit()):
            raise _Refused(400, "invalid Content-Length")
        length = content_length(text)
        if length is None or length > MAX_BODY:  # None: more than 18 digits
            raise _Refused(413, _TOO_LARGE)
        return _read(stream, length)
    # No length: only a server that marks the stream as terminated (chunked requests)
    # lets us read to its end (PEP 3333 otherwise forbids reading past CONTENT_LENGTH).
    if not environ.get("wsgi.input_terminated"):
        if "chunked" in str(environ.get("HTTP_TRANSFER_ENCODING") or "").lower():
            raise _Refused(
                400,
                "a body without Content-Length (chunked) cannot be read on this server, "
                "which does not mark its end: send a Content-Length",
            )
        return b""
    body = _read(stream, MAX_BODY + 1)
    if len(body) > MAX_BODY:
        raise _Refused(413, _TOO_LARGE)
    return body


def _read(stream: Any, length: int) -> bytes:
    chunks = []
    while length > 0:
        chunk = stream.read(length)
        if not chunk:
            break
        chunks.append(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def _parse(body: bytes, content_type: str) -> dict[str, str]:
    """The three fields of an XML or JSON request, validated as present and textual."""
    mimetype = content_type.partition(";")[0].strip().lower()
    start = body.removeprefix(_BOM).lstrip()
    if not start:
        raise _Refused(400, "empty body: expected an XML <request> or a JSON object")
    # A declared XML or JSON type wins; anything else (form, text/plain, none) is sniffed.
    declared_json = mimetype in _JSON_TYPES or mimetype.endswith("+json")
    declared_xml = mimetype in _XML_TYPES or mimetype.endswith("+xml")
    if declared_json or (not declared_xml and start.startswith(b"{")):
        fields = _parse_json(body)
    elif declared_xml or start.startswith(b"<"):
        fields = _parse_xml(body)
    else:
        raise _Refused(400, "body is neither XML nor JSON")
    missing = [name for name in FIELDS if not fields.get(name)]
    if missing:
        raise _Refused(400, f"missing field: {', '.join(missing)}")
    return fields


def _parse_xml(body: bytes) -> dict[str, str]:
    try:
        # No DTD at all: entity declarations (billion laughs) and external entities
        # have no legitimate use in this protocol.
        root = fromstring(body, forbid_dtd=True, forbid_entities=True, forbid_external=True)
    except (DTDForbidden, EntitiesForbidden):
        raise _Refused(
            400, "XML with a DTD or entity declarations is not accepted (no entity expansion)"
        ) from None
    except ExternalReferenceForbidden:
        raise _Refused(400, "XML external entities are not accepted") from None
    except ParseError as exc:
        line, column = getattr(exc, "position", (0, 0))
        raise _Refused(400, f"not well-formed XML (line {line}, column {column})") from None
    except (ValueError, LookupError):  # e.g. an unknown encoding declared
        raise _Refused(400, "not well-formed XML") from None
    if _local_name(root.tag) != "request":
        raise _Refused(400, "XML root element must be <request>")
    fields: dict[str, str] = {}
    for element in root:
        name = _local_name(element.tag)
        if name not in FIELDS:
            continue  # fields of newer protocol versions
        if name in fields:
            raise _Refused(400, f"duplicate field: {name}")
        if len(element):
            raise _Refused(400, f"field {name} must be text, not elements")
        fields[name] = (element.text or "").strip()
    return fields


def _local_name(tag: object) -> str:
    return tag.rpartition("}")[2] if isinstance(tag, str) else ""


def _whole_number(text: str) -> int:
    """A JSON integer; one longer than Python converts (4 300 digits) is refused as such,
    not as JSON that does not parse."""
    if len(text) > 4000:
        raise _Refused(400, f"a JSON number of {len(text)} digits: at most 4000")
    return int(text)


def _parse_json(body: bytes) -> dict[str, str]:
    try:
        document = json.loads(body, object_pairs_hook=_unique_members, parse_int=_whole_number)
    except _Refused:
        raise
    except RecursionError:
        raise _Refused(400, "JSON nested too deeply") from None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError included
        raise _Refused(400, "not valid JSON") from None
    if not isinstance(document, dict):
        raise _Refused(400, "JSON body must be an object")
    fields: dict[str, str] = {}
    for name in FIELDS:
        value = document.get(name)
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # numeric user ids
        if not isinstance(value, str):
            raise _Refused(400, f"field {name} must be a string")
        fields[name] = value.strip()
    return fields


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        names = [name for name, _ in pairs]
        duplicate = next((name for name in FIELDS if names.count(name) > 1), "")
        if duplicate:
            raise _Refused(400, f"duplicate field: {duplicate}")
    return document
