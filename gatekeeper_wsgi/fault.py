"""Rendering a rejection as the standardized ServiceFault (SPEC §5).

One function, :func:`render_fault`, turns a :class:`~gatekeeper_wsgi.errors.Rejected` into a
WSGI status line, headers and body: the ServiceFault XML, RFC 9457 problem details JSON, or a
SOAP 1.1 / 1.2 Fault envelope carrying the ServiceFault as its detail. Framework-free: only the
standard library and werkzeug.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from functools import lru_cache
from http import HTTPStatus
from typing import TYPE_CHECKING, TypeAlias
from xml.sax.saxutils import escape

from werkzeug.datastructures import MIMEAccept
from werkzeug.http import parse_accept_header

from gatekeeper_wsgi.config import FAULT_FORMATS, Config, FaultFormat
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.redact import Throttle, failure_without_message
from gatekeeper_wsgi.values import FAULT_CODES

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

__all__ = [
    "ACCEPT_CAP",
    "FAULT_FORMATS",
    "FAULT_NAMESPACE",
    "Renderer",
    "accept_prefers_xml",
    "json_limit_value",
    "render_fault",
    "xml_text",
]

logger = logging.getLogger("gatekeeper")

#: ``(rejected, request_id, environ) -> (content_type, body)``: a site's own fault body.
Renderer: TypeAlias = Callable[[Rejected, str, "WSGIEnvironment"], tuple[str, bytes | str]]

FAULT_NAMESPACE = "urn:gatekeeper-wsgi:fault:1"
SOAP11_NAMESPACE = "http://schemas.xmlsoap.org/soap/envelope/"
SOAP12_NAMESPACE = "http://www.w3.org/2003/05/soap-envelope"

XML_CONTENT_TYPE = "application/xml; charset=utf-8"
JSON_CONTENT_TYPE = "application/problem+json"
SOAP11_CONTENT_TYPE = "text/xml; charset=utf-8"
SOAP12_CONTENT_TYPE = "application/soap+xml; charset=utf-8"

_XML_MIMETYPES = ("application/xml", "text/xml")
_JSON_MIMETYPES = ("application/json", "application/problem+json")

_STATUS_LINES: dict[int, str] = {
    status: f"{status} {HTTPStatus(status).phrase}"
    for status in {s for s, _ in FAULT_CODES.values()} | {500}
}
_SOAP_STATUS_LINE = _STATUS_LINES[500]

# Everything XML 1.0 forbids (C0 controls but tab/LF/CR, lone surrogates, U+FFFE/U+FFFF).
_XML_FORBIDDEN = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]+")
# CR would be normalized to LF by every parser; tab/LF too inside attributes.
_XML_TEXT_ENTITIES = {"\r": "&#13;"}
_XML_ATTR_ENTITIES = {'"': "&quot;", "\r": "&#13;", "\n": "&#10;", "\t": "&#9;"}
# ensure_ascii would write lone surrogates as \udxxx escapes, which strict parsers reject.
_LONE_SURROGATES = re.compile("[\ud800-\udfff]+")
# Header values: printable ASCII only, so never CR/LF and never beyond latin-1.
_NOT_HEADER_SAFE = re.compile("[^\x20-\x7e]+")


def xml_text(value: str) -> str:
    """``value`` as XML character data: escaped, characters XML 1.0 forbids dropped."""
    return escape(_XML_FORBIDDEN.sub("", value), _XML_TEXT_ENTITIES)


def _xml_attr(value: str) -> str:
    return escape(_XML_FORBIDDEN.sub("", value), _XML_ATTR_ENTITIES)


def _header_value(value: str) -> str:
    return _NOT_HEADER_SAFE.sub("", value).strip()


@lru_cache(maxsize=1024)
def _sf_string(value: str) -> str:
    """A structured-field string (RFC 8941 §3.3.3): printable ASCII, ``\\`` and ``"`` escaped."""
    cleaned = _NOT_HEADER_SAFE.sub("", value)
    return '"' + cleaned.replace("\\", "\\\\").replace('"', '\\"') + '"'


# Per code: the constant head of the ServiceFault (code and reason) and the JSON "type".
_XML_HEAD: dict[str, tuple[str, str]] = {
    code: (xml_text(code), xml_text(reason)) for code, (_, reason) in FAULT_CODES.items()
}
_JSON_TYPE: dict[str, str] = {code: f"urn:gatekeeper-wsgi:fault:{code}" for code in FAULT_CODES}


def _service_fault_xml(rejected: Rejected, request_id: str, indent: str) -> str:
    """The ``<ServiceFault>`` element, its first line unindented, children at ``indent + 2``."""
    code, reason = _XML_HEAD.get(rejected.code) or (
        xml_text(rejected.code),
        xml_text(rejected.reason),
    )
    inner = indent + "  "
    lines = [
        f'<ServiceFault xmlns="{FAULT_NAMESPACE}">',
        f"{inner}<code>{code}</code>",
        f"{inner}<reason>{reason}</reason>",
    ]
    if rejected.level is not None:
        lines.append(f"{inner}<level>{xml_text(rejected.level)}</level>")
    if rejected.limit_path is not None:
        value = "" if rejected.limit_value is None else xml_text(rejected.limit_value)
        lines.append(f'{inner}<limit path="{_xml_attr(rejected.limit_path)}">{value}</limit>')
    lines.append(f"{inner}<requestId>{xml_text(request_id)}</requestId>")
    if rejected.retry_after is not None:
        lines.append(f"{inner}<retryAfter>{rejected.retry_after}</retryAfter>")
    lines.append(f"{indent}</ServiceFault>")
    return "\n".join(lines)


def _render_xml(rejected: Rejected, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        + _service_fault_xml(rejected, request_id, "")
        + "\n"
    ).encode("utf-8")


def _render_soap11(rejected: Rejected, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<soap:Envelope xmlns:soap="{SOAP11_NAMESPACE}">\n'
        "  <soap:Body>\n"
        "    <soap:Fault>\n"
        "      <faultcode>soap:Server</faultcode>\n"
        f"      <faultstring>{xml_text(rejected.reason)}</faultstring>\n"
        "      <detail>\n"
        f"        {_service_fault_xml(rejected, request_id, '        ')}\n"
        "      </detail>\n"
        "    </soap:Fault>\n"
        "  </soap:Body>\n"
        "</soap:Envelope>\n"
    ).encode()


def _render_soap12(rejected: Rejected, request_id: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<env:Envelope xmlns:env="{SOAP12_NAMESPACE}">\n'
        "  <env:Body>\n"
        "    <env:Fault>\n"
        "      <env:Code><env:Value>env:Receiver</env:Value></env:Code>\n"
        "      <env:Reason>\n"
        f'        <env:Text xml:lang="en">{xml_text(rejected.reason)}</env:Text>\n'
        "      </env:Reason>\n"
        "      <env:Detail>\n"
        f"        {_service_fault_xml(rejected, request_id, '        ')}\n"
        "      </env:Detail>\n"
        "    </env:Fault>\n"
        "  </env:Body>\n"
        "</env:Envelope>\n"
    ).encode()


def _json_str(value: str) -> str:
    return _LONE_SURROGATES.sub("", value)


# A limit value of plain ASCII digits can only be a concurrency (a rate always has its "/"),
# which SPEC §5 types as a JSON number; 18 digits keep int() far from Python's digit cap.
_CONCURRENCY_VALUE = re.compile(r"(?:0|[1-9][0-9]{0,17})")


def json_limit_value(value: str) -> int | str:
    """A limit's value as JSON types it (SPEC §5): a concurrency a number, a rate a string.
    The fault and the rejected-request log both write it so."""
    return int(value) if _CONCURRENCY_VALUE.fullmatch(value) else value


def _json_limit_value(value: str) -> int | str:
    typed = json_limit_value(value)
    return typed if isinstance(typed, int) else _json_str(typed)


def _render_json(rejected: Rejected, request_id: str) -> bytes:
    problem: dict[str, object] = {
        "type": _JSON_TYPE.get(rejected.code) or f"urn:gatekeeper-wsgi:fault:{rejected.code}",
        "title": rejected.reason,
        "status": rejected.status,
        "code": rejected.code,
    }
    if rejected.level is not None:
        problem["level"] = _json_str(rejected.level)
    if rejected.limit_path is not None:
        limit: dict[str, object] = {"path": _json_str(rejected.limit_path)}
        if rejected.limit_value is not None:
            limit["value"] = _json_limit_value(rejected.limit_value)
        problem["limit"] = limit
    problem["requestId"] = _json_str(request_id)
    if rejected.retry_after is not None:
        problem["retryAfter"] = rejected.retry_after
    return json.dumps(problem, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _mimetype(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


def _is_xml_mimetype(mimetype: str) -> bool:
    return mimetype in _XML_MIMETYPES or mimetype.endswith("+xml")


def accept_prefers_xml(accept: str) -> bool | None:
    """What an ``Accept`` header prefers: True XML, False JSON (or a tie between types the
    client named), None when it says nothing about either. At most ``ACCEPT_CAP``
    characters are parsed, so a 64 KiB header costs no more than a short one: of a longer
    header, the media ranges that can speak for XML or JSON (those types, ``+xml`` and
    ``+json`` ones, wildcards) found in its first ``ACCEPT_SCAN`` characters by one regex
    scan, so a client naming the type it wants at the end of a long list is heard."""
    if len(accept) > ACCEPT_CAP:
        accept = _relevant_ranges(accept[:ACCEPT_SCAN].lower())
    return _parsed_preference(accept)


def _relevant_ranges(accept: str) -> str:
    """The media ranges of a long ``accept`` (lowercased) that name xml or json or hold a
    wildcard, whole, in order, up to ``ACCEPT_CAP`` characters: the parser keeps the exact
    types among them. Found from each keyword a regex scan meets (a C-level pass, ~25 µs
    for 8 KiB); no more ranges are cut out than fit in ``ACCEPT_CAP``."""
    found: list[str] = []
    size = 0
    done = 0  # where the last range taken ends: a keyword before it is in that range
    for match in _KEYWORD.finditer(accept):
        at = match.start()
        if at < done:
            continue
        start = accept.rfind(",", 0, at) + 1
        done = accept.find(",", at)
        if done < 0:
            done = len(accept)
        size += done - start + 1
        if size > ACCEPT_CAP:
            break
        found.append(accept[start:done])
    return ",".join(found)


@lru_cache(maxsize=512)
def _parsed_preference(accept: str) -> bool | None:
    # Clients send few distinct Accept values, so the parse is cached (bounded).
    try:
        parsed = parse_accept_header(accept, MIMEAccept)
        # The types the client named itself, without parameters, with their qualities.
        named = [(value.partition(";")[0].strip().lower(), quality) for value, quality in parsed]
        xml_quality = _family_quality(parsed, named, _XML_MIMETYPES)
        json_quality = _family_quality(parsed, named, _JSON_MIMETYPES)
    except Exception:  # untrusted input: whatever werkzeug makes of it, never fail a fault
        return None
    if xml_quality != json_quality:
        return xml_quality > json_quality
    # A tie is a JSON preference only if the client named one of the types itself; `*/*`,
    # `text/html` or nothing parseable leave the choice to the request body.
    families = _XML_MIMETYPES + _JSON_MIMETYPES
    if any(value in families for value, quality in named if quality > 0):
        return False
    return None


def _family_quality(
    parsed: MIMEAccept, named: list[tuple[str, float]], family: tuple[str, ...]
) -> float:
    """How much the client wants one format (XML, JSON), whichever of its types is sent. A
    type of it the client named speaks for the whole format: ``application/json;q=0, */*``
    refuses JSON, although ``application/problem+json`` matches ``*/*``. Otherwise the
    wildcards the client sent decide (``text/*`` takes XML as ``text/xml``)."""
    qualities = [quality for value, quality in named if value in family]
    if qualities:
        return max(qualities)
    return max(parsed.quality(mimetype) for mimetype in family)


#: How much of an Accept header is parsed: real ones are a few hundred characters, and a
#: 64 KiB one must cost a fault no more than a short one (nor fill the parse cache).
ACCEPT_CAP = 1024
#: How much of a longer one is scanned for the media ranges that matter: 8 KiB, the longest
#: header line gunicorn accepts by default (at most ~0.1 ms, however hostile).
ACCEPT_SCAN = 8 * 1024
#: What makes a media range one that can speak for XML or JSON (in lowercased text).
_KEYWORD = re.compile(r"xml|json|\*")


def _wants_xml(environ: WSGIEnvironment, mimetype: str) -> bool:
    accept = environ.get("HTTP_ACCEPT")
    if isinstance(accept, str) and accept.strip():
        prefers_xml = accept_prefers_xml(accept)
        if prefers_xml is not None:
            return prefers_xml
    return _is_xml_mimetype(mimetype)


#: seconds between two ERRORs of a failing fault renderer (it fails on every rejection
#: of a kind, and rejections come by the thousand during overload)
RENDERER_LOG_INTERVAL = 10.0
_renderer_failures = Throttle(RENDERER_LOG_INTERVAL)


def _call_renderer(
    renderer: Renderer, rejected: Rejected, request_id: str, environ: WSGIEnvironment
) -> tuple[str, bytes] | None:
    """The user renderer's (content type, body), or None when it failed (logged once per
    ``RENDERER_LOG_INTERVAL``, with the failures since)."""
    # A broken renderer must not turn every rejection into a 500 during overload.
    try:
        content_type, body = renderer(rejected, request_id, environ)
        if isinstance(body, str):
            body = body.encode("utf-8")
    except Exception as exc:
        failures = _renderer_failures.due()
        if failures:
            logger.error(
                "fault renderer %r failed (%d times since the last report); sending the"
                " standard ServiceFault: %s",
                renderer,
                failures,
                failure_without_message(exc),
            )
        return None
    if not isinstance(content_type, str) or not isinstance(body, bytes):
        failures = _renderer_failures.due()
        if failures:
            logger.error(
                "fault renderer %r returned (%s, %s), expected (str, bytes | str) (%d"
                " failures since the last report); sending the standard ServiceFault",
                renderer,
                type(content_type).__name__,
                type(body).__name__,
                failures,
            )
        return None
    return _header_value(content_type) or "application/octet-stream", body


def render_fault(
    rejected: Rejected,
    environ: WSGIEnvironment,
    request_id: str,
    *,
    fault_format: FaultFormat = "auto",
    request_id_header: str = Config.request_id_header,
    renderer: Renderer | None = None,
) -> tuple[str, list[tuple[str, str]], bytes]:
    """Render ``rejected`` as a ServiceFault response: ``(status line, headers, body)``.

    The format is negotiated from ``environ``: a SOAP request (SOAP 1.1: ``text/xml`` with a
    ``SOAPAction`` header; SOAP 1.2: ``application/soap+xml``) always gets a SOAP Fault with
    HTTP 500 and the ServiceFault as its detail. Otherwise ``renderer`` (a site's own body) is
    used if given, then ``fault_format`` ``"xml"``/``"json"`` forces a format, and ``"auto"``
    picks XML when ``Accept`` prefers ``application/xml``/``text/xml`` over JSON, or when
    ``Accept`` expresses no preference and the request body is XML by its Content-Type;
    JSON otherwise. (The body itself is not read to tell: a refused request's body may be
    slow to come, and waiting for it would hold the worker, or cost the connection.)

    Example::

        status, headers, body = render_fault(
            Rejected("GK-RATE-LIMIT", level="caller", limit_path="shop/login/*",
                     limit_value="5/minute", retry_after=12),
            environ, "9f1c2d",
        )
        start_response(status, headers)   # "429 Too Many Requests", Retry-After: 12, ...
        return [body]                      # {"type":"urn:gatekeeper-wsgi:fault:GK-RATE-LIMIT",...}
    """
    mimetype = _mimetype(environ.get("CONTENT_TYPE") or "")
    status_line = _STATUS_LINES.get(rejected.status) or f"{rejected.status} Error"
    custom: tuple[str, bytes] | None = None

    if mimetype == "application/soap+xml":
        content_type, body = SOAP12_CONTENT_TYPE, _render_soap12(rejected, request_id)
        status_line = _SOAP_STATUS_LINE
    elif mimetype == "text/xml" and "HTTP_SOAPACTION" in environ:
        content_type, body = SOAP11_CONTENT_TYPE, _render_soap11(rejected, request_id)
        status_line = _SOAP_STATUS_LINE
    elif renderer is not None and (
        custom := _call_renderer(renderer, rejected, request_id, environ)
    ):
        content_type, body = custom
    elif fault_format == "xml" or (fault_format != "json" and _wants_xml(environ, mimetype)):
        content_type, body = XML_CONTENT_TYPE, _render_xml(rejected, request_id)
    else:
        content_type, body = JSON_CONTENT_TYPE, _render_json(rejected, request_id)

    headers = [
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"),
    ]
    if rejected.retry_after is not None:
        headers.append(("Retry-After", str(rejected.retry_after)))
    headers.append((request_id_header, _header_value(request_id)))
    rate = rejected.rate
    if rate is not None:
        name = _sf_string(rejected.limit_path or "default")
        window = max(1, math.ceil(rate.window - 1e-9))
        # Whole seconds, rounded up as Retry-After is: a window with no room left is at
        # least a second from having some (never t=0 beside Retry-After: 1).
        reset = max(0 if rate.remaining > 0 else 1, math.ceil(rate.reset - 1e-9))
        headers.append(("RateLimit-Policy", f"{name};q={max(0, rate.quota)};w={window}"))
        headers.append(("RateLimit", f"{name};r={max(0, rate.remaining)};t={reset}"))
    return status_line, headers, body
