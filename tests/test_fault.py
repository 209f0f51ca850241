"""The ServiceFault a rejected client receives: status, headers, XML / JSON / SOAP bodies."""

from __future__ import annotations

import json
import logging
import random
import re
from typing import TYPE_CHECKING, Any
from xml.etree.ElementTree import Element

import pytest
from defusedxml.ElementTree import fromstring
from hypothesis import given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi import fault
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.errors import FAULT_CODES, ConfigError, RateInfo, Rejected
from gatekeeper_wsgi.fault import render_fault
from gatekeeper_wsgi.redact import Throttle
from tests.conftest import FakeClock

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

NS = "{urn:gatekeeper-wsgi:fault:1}"
SOAP11 = "{http://schemas.xmlsoap.org/soap/envelope/}"
SOAP12 = "{http://www.w3.org/2003/05/soap-envelope}"
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
SAFE_HEADER_VALUE = re.compile(r"[\x20-\x7e]*")


def checkout_full(**overrides: Any) -> Rejected:
    fields: dict[str, Any] = {
        "level": "service",
        "limit_path": "shop/checkout",
        "limit_value": "10",
        "retry_after": 2,
    }
    fields.update(overrides)
    return Rejected("GK-CONCURRENCY-LIMIT", **fields)


def login_rate(**overrides: Any) -> Rejected:
    fields: dict[str, Any] = {
        "level": "caller",
        "limit_path": "shop/login/*",
        "limit_value": "5/minute",
        "retry_after": 11.2,
        "rate": RateInfo(quota=5, window=60.0, remaining=0, reset=11.2),
    }
    fields.update(overrides)
    return Rejected("GK-RATE-LIMIT", **fields)


def header(headers: list[tuple[str, str]], name: str) -> str | None:
    values = [value for key, value in headers if key.lower() == name.lower()]
    assert len(values) <= 1, f"{name} sent {len(values)} times"
    return values[0] if values else None


def parse_body(content_type: str, body: bytes) -> Any:
    """Parse a fault body the way a client would, by its Content-Type."""
    if "json" in content_type:
        return json.loads(body.decode("ascii"))
    return fromstring(body)


def service_fault_fields(element: Element) -> list[tuple[str, str | None, dict[str, str]]]:
    assert element.tag == f"{NS}ServiceFault"
    return [(child.tag.removeprefix(NS), child.text, dict(child.attrib)) for child in element]


def assert_safe_headers(body: bytes, headers: list[tuple[str, str]]) -> None:
    for name, value in headers:
        assert SAFE_HEADER_VALUE.fullmatch(value), (name, value)
        value.encode("latin-1")
    assert header(headers, "Content-Length") == str(len(body))


# -- status ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status_line"),
    [
        ("GK-CONCURRENCY-LIMIT", "503 Service Unavailable"),
        ("GK-RATE-LIMIT", "429 Too Many Requests"),
        ("GK-QUEUE-FULL", "503 Service Unavailable"),
        ("GK-QUEUE-TIMEOUT", "503 Service Unavailable"),
        ("GK-CALLER-MISSING", "400 Bad Request"),
        ("GK-BACKEND-UNAVAILABLE", "503 Service Unavailable"),
    ],
)
@pytest.mark.parametrize("fault_format", ["xml", "json"])
def test_every_code_has_its_status(code: str, status_line: str, fault_format: str) -> None:
    """Each fault code is answered with the HTTP status SPEC §5 assigns to it, in both formats."""
    retry_after = None if code == "GK-CALLER-MISSING" else 3
    status, headers, body = render_fault(
        Rejected(code, retry_after=retry_after), {}, "rid", fault_format=fault_format
    )
    assert status == status_line
    parsed = parse_body(header(headers, "Content-Type") or "", body)
    if fault_format == "json":
        assert parsed["code"] == code
        assert parsed["status"] == int(status_line[:3])
    else:
        assert parsed.find(f"{NS}code").text == code


def test_all_codes_are_covered() -> None:
    """The status table above covers every fault code the engine can raise."""
    assert set(FAULT_CODES) == {
        "GK-CONCURRENCY-LIMIT",
        "GK-RATE-LIMIT",
        "GK-QUEUE-FULL",
        "GK-QUEUE-TIMEOUT",
        "GK-CALLER-MISSING",
        "GK-BACKEND-UNAVAILABLE",
    }


# -- XML ------------------------------------------------------------------------------------


def test_xml_fault_element_by_element() -> None:
    """An XML client gets the ServiceFault of SPEC §5 with every element in order."""
    status, headers, body = render_fault(
        checkout_full(), {"HTTP_ACCEPT": "application/xml"}, "9f1c"
    )
    assert status == "503 Service Unavailable"
    assert header(headers, "Content-Type") == "application/xml; charset=utf-8"
    assert body.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<ServiceFault xmlns="urn:')
    assert service_fault_fields(fromstring(body)) == [
        ("code", "GK-CONCURRENCY-LIMIT", {}),
        ("reason", "Too many concurrent requests", {}),
        ("level", "service", {}),
        ("limit", "10", {"path": "shop/checkout"}),
        ("requestId", "9f1c", {}),
        ("retryAfter", "2", {}),
    ]


def test_xml_omits_absent_fields() -> None:
    """A fault without level, limit or retry time carries no empty placeholders for them."""
    _, headers, body = render_fault(Rejected("GK-CALLER-MISSING"), {}, "abc", fault_format="xml")
    assert service_fault_fields(fromstring(body)) == [
        ("code", "GK-CALLER-MISSING", {}),
        ("reason", "Missing or invalid caller identification", {}),
        ("requestId", "abc", {}),
    ]
    assert header(headers, "Retry-After") is None


# -- JSON -----------------------------------------------------------------------------------


def test_json_problem_details() -> None:
    """A JSON client gets RFC 9457 problem details with exactly the SPEC §5 members."""
    status, headers, body = render_fault(checkout_full(), {}, "9f1c")
    assert status == "503 Service Unavailable"
    assert header(headers, "Content-Type") == "application/problem+json"
    assert json.loads(body) == {
        "type": "urn:gatekeeper-wsgi:fault:GK-CONCURRENCY-LIMIT",
        "title": "Too many concurrent requests",
        "status": 503,
        "code": "GK-CONCURRENCY-LIMIT",
        "level": "service",
        "limit": {"path": "shop/checkout", "value": 10},
        "requestId": "9f1c",
        "retryAfter": 2,
    }
    assert b", " not in body and b": " not in body


def test_json_types_a_concurrency_as_a_number_and_a_rate_as_a_string() -> None:
    """In JSON a concurrency value is a number and a rate a string (SPEC §5)."""
    for value, expected in (("0", 0), ("10", 10), ("5/minute", "5/minute"), ("3/10s", "3/10s")):
        _, _, body = render_fault(checkout_full(limit_value=value), {}, "r")
        assert json.loads(body)["limit"]["value"] == expected


def test_xml_keeps_the_value_as_text() -> None:
    """XML shows a concurrency value as the text it always had."""
    _, _, body = render_fault(checkout_full(), {"HTTP_ACCEPT": "application/xml"}, "r")
    limit = fromstring(body).find(f"{NS}limit")
    assert limit is not None
    assert limit.text == "10"


def test_json_value_of_thousands_of_digits_never_raises() -> None:
    """A 5000-digit value (past Python's int() digit cap) renders instead of raising."""
    digits = "9" * 5000
    _, _, body = render_fault(checkout_full(limit_value=digits), {}, "r")
    assert json.loads(body)["limit"]["value"] == digits


def test_json_omits_absent_members() -> None:
    """A JSON fault without level, limit or retry time has no null members."""
    _, _, body = render_fault(Rejected("GK-CALLER-MISSING"), {}, "abc")
    assert json.loads(body) == {
        "type": "urn:gatekeeper-wsgi:fault:GK-CALLER-MISSING",
        "title": "Missing or invalid caller identification",
        "status": 400,
        "code": "GK-CALLER-MISSING",
        "requestId": "abc",
    }


def test_json_is_ascii() -> None:
    """Non-ASCII text in a JSON fault arrives escaped, so the body is plain ASCII."""
    _, _, body = render_fault(checkout_full(limit_path="shöp/☃"), {}, "ïd")
    body.decode("ascii")
    parsed = json.loads(body)
    assert parsed["limit"]["path"] == "shöp/☃"
    assert parsed["requestId"] == "ïd"


# -- headers --------------------------------------------------------------------------------


def test_standard_headers() -> None:
    """A fault is never cached, says when to retry and echoes the request id."""
    _, headers, body = render_fault(checkout_full(), {}, "req-1", request_id_header="X-Trace")
    assert header(headers, "Cache-Control") == "no-store"
    assert header(headers, "Retry-After") == "2"
    assert header(headers, "X-Trace") == "req-1"
    assert header(headers, "X-Request-Id") is None
    assert header(headers, "Content-Length") == str(len(body))
    assert header(headers, "RateLimit") is None
    assert header(headers, "RateLimit-Policy") is None


def test_ratelimit_headers_exact() -> None:
    """A rate-limited client gets the IETF RateLimit-Policy and RateLimit fields."""
    status, headers, _ = render_fault(login_rate(), {}, "r")
    assert status == "429 Too Many Requests"
    assert header(headers, "Retry-After") == "12"
    assert header(headers, "RateLimit-Policy") == '"shop/login/*";q=5;w=60'
    assert header(headers, "RateLimit") == '"shop/login/*";r=0;t=12'


def test_ratelimit_headers_round_window_and_reset() -> None:
    """Fractional windows and resets are sent as whole seconds, rounded up, reset never < 0."""
    rate = RateInfo(quota=100, window=9.2, remaining=3, reset=-0.5)
    _, headers, _ = render_fault(login_rate(limit_path="api", rate=rate), {}, "r")
    assert header(headers, "RateLimit-Policy") == '"api";q=100;w=10'
    assert header(headers, "RateLimit") == '"api";r=3;t=0'


def test_ratelimit_reset_of_a_full_window_is_never_0() -> None:
    """A window with no room left within a nanosecond of sliding still says t=1, as its
    Retry-After does (whole seconds, at least 1): never t=0 on a refusal."""
    rate = RateInfo(quota=1, window=10.0, remaining=0, reset=5e-10)
    _, headers, _ = render_fault(login_rate(limit_path="api", rate=rate, retry_after=1), {}, "r")
    assert header(headers, "Retry-After") == "1"
    assert header(headers, "RateLimit") == '"api";r=0;t=1'


def test_ratelimit_policy_name_is_escaped() -> None:
    """A limit path with quotes, backslashes, CR/LF or non-ASCII stays one valid sf-string."""
    _, headers, _ = render_fault(login_rate(limit_path='a"b\\c\r\nX-Evil: 1/é'), {}, "r")
    assert header(headers, "RateLimit-Policy") == '"a\\"b\\\\cX-Evil: 1/";q=5;w=60'
    assert header(headers, "RateLimit") == '"a\\"b\\\\cX-Evil: 1/";r=0;t=12'
    assert header(headers, "X-Evil") is None


# -- SOAP -----------------------------------------------------------------------------------

SOAP11_ENVIRON: WSGIEnvironment = {
    "CONTENT_TYPE": "text/xml; charset=utf-8",
    "HTTP_SOAPACTION": '"urn:checkout"',
}
SOAP12_ENVIRON: WSGIEnvironment = {
    "CONTENT_TYPE": 'application/soap+xml; charset=utf-8; action="urn:checkout"'
}


def test_soap11_fault_envelope() -> None:
    """A SOAP 1.1 client gets a soap:Server Fault, HTTP 500, with the ServiceFault as detail."""
    status, headers, body = render_fault(login_rate(), dict(SOAP11_ENVIRON), "9f1c")
    assert status == "500 Internal Server Error"
    assert header(headers, "Content-Type") == "text/xml; charset=utf-8"
    assert header(headers, "Retry-After") == "12"
    assert header(headers, "RateLimit") == '"shop/login/*";r=0;t=12'
    envelope = fromstring(body)
    assert envelope.tag == f"{SOAP11}Envelope"
    (soap_body,) = list(envelope)
    assert soap_body.tag == f"{SOAP11}Body"
    (fault,) = list(soap_body)
    assert fault.tag == f"{SOAP11}Fault"
    assert [child.tag for child in fault] == ["faultcode", "faultstring", "detail"]
    assert fault.findtext("faultcode") == "soap:Server"
    assert b'xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/"' in body
    assert fault.findtext("faultstring") == "Too many requests"
    detail = fault.find("detail")
    assert detail is not None
    (service_fault,) = list(detail)
    assert service_fault_fields(service_fault) == [
        ("code", "GK-RATE-LIMIT", {}),
        ("reason", "Too many requests", {}),
        ("level", "caller", {}),
        ("limit", "5/minute", {"path": "shop/login/*"}),
        ("requestId", "9f1c", {}),
        ("retryAfter", "12", {}),
    ]


def test_soap12_fault_envelope() -> None:
    """A SOAP 1.2 client gets an env:Receiver Fault, HTTP 500, with the ServiceFault as detail."""
    status, headers, body = render_fault(checkout_full(), dict(SOAP12_ENVIRON), "9f1c")
    assert status == "500 Internal Server Error"
    assert header(headers, "Content-Type") == "application/soap+xml; charset=utf-8"
    assert header(headers, "Retry-After") == "2"
    envelope = fromstring(body)
    assert envelope.tag == f"{SOAP12}Envelope"
    fault = envelope.find(f"{SOAP12}Body/{SOAP12}Fault")
    assert fault is not None
    assert [child.tag for child in fault] == [f"{SOAP12}Code", f"{SOAP12}Reason", f"{SOAP12}Detail"]
    assert fault.findtext(f"{SOAP12}Code/{SOAP12}Value") == "env:Receiver"
    assert b'xmlns:env="http://www.w3.org/2003/05/soap-envelope"' in body
    text = fault.find(f"{SOAP12}Reason/{SOAP12}Text")
    assert text is not None
    assert text.text == "Too many concurrent requests"
    assert text.get(XML_LANG) == "en"
    detail = fault.find(f"{SOAP12}Detail")
    assert detail is not None
    (service_fault,) = list(detail)
    assert service_fault_fields(service_fault)[0] == ("code", "GK-CONCURRENCY-LIMIT", {})
    assert service_fault.findtext(f"{NS}requestId") == "9f1c"


def test_soap_fault_for_caller_missing_keeps_no_retry_after() -> None:
    """A SOAP client missing its caller id gets a Fault without Retry-After or retryAfter."""
    status, headers, body = render_fault(Rejected("GK-CALLER-MISSING"), dict(SOAP11_ENVIRON), "x")
    assert status == "500 Internal Server Error"
    assert header(headers, "Retry-After") is None
    assert fromstring(body).find(f".//{NS}retryAfter") is None


def test_soap11_requires_soapaction() -> None:
    """A plain text/xml POST without SOAPAction is not SOAP: it gets the XML fault, its status."""
    status, headers, body = render_fault(checkout_full(), {"CONTENT_TYPE": "text/xml"}, "r")
    assert status == "503 Service Unavailable"
    assert header(headers, "Content-Type") == "application/xml; charset=utf-8"
    assert fromstring(body).tag == f"{NS}ServiceFault"


@pytest.mark.parametrize(
    ("environ", "content_type"),
    [
        ({"CONTENT_TYPE": "TEXT/XML", "HTTP_SOAPACTION": ""}, "text/xml; charset=utf-8"),
        ({"CONTENT_TYPE": " Application/SOAP+XML "}, "application/soap+xml; charset=utf-8"),
    ],
    ids=["soap11-empty-action-uppercase", "soap12-mixed-case"],
)
def test_soap_detection_is_case_insensitive(environ: WSGIEnvironment, content_type: str) -> None:
    """Media types are matched case-insensitively and an empty SOAPAction still means SOAP 1.1."""
    status, headers, _ = render_fault(checkout_full(), environ, "r")
    assert status == "500 Internal Server Error"
    assert header(headers, "Content-Type") == content_type


def rendered_by_site(
    rejected: Rejected, request_id: str, environ: WSGIEnvironment
) -> tuple[str, str]:
    return "text/plain; charset=utf-8", f"busy ({rejected.code}, {request_id})"


@pytest.mark.parametrize("environ", [SOAP11_ENVIRON, SOAP12_ENVIRON], ids=["soap11", "soap12"])
@pytest.mark.parametrize("fault_format", ["json", "xml"])
def test_soap_wins_over_format_and_renderer(environ: WSGIEnvironment, fault_format: str) -> None:
    """SOAP clients always get a SOAP Fault, whatever fault.format or a site renderer says."""
    status, headers, body = render_fault(
        checkout_full(),
        dict(environ),
        "r",
        fault_format=fault_format,
        renderer=rendered_by_site,
    )
    assert status == "500 Internal Server Error"
    assert "xml" in (header(headers, "Content-Type") or "")
    assert fromstring(body).tag.endswith("}Envelope")


# -- negotiation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "content_type", "expected"),
    [
        (None, None, "json"),
        ("", None, "json"),
        ("application/json", None, "json"),
        ("application/xml", None, "xml"),
        ("text/xml", None, "xml"),
        ("application/problem+json", None, "json"),
        ("application/xml;q=0.5, application/json", None, "json"),
        ("application/json;q=0.5, application/xml", None, "xml"),
        ("application/json;q=0.5, text/xml;q=0.6", None, "xml"),
        ("application/json, application/xml", None, "json"),
        ("application/xml, application/json", None, "json"),
        ("application/problem+json;q=0.9, application/xml;q=0.8", None, "json"),
        ("*/*", None, "json"),
        ("*/*;q=0.1, application/xml", None, "xml"),
        # a JSON type the client named speaks for JSON, whichever JSON type a fault is sent as
        ("application/json;q=0, */*", None, "xml"),
        ("*/*, application/json;q=0.1", None, "xml"),
        ("application/json;q=0, text/*", None, "xml"),
        ("application/json;charset=utf-8;q=0.2, */*;q=0.5", None, "xml"),
        ("application/problem+json;q=0, application/json", None, "json"),
        ("text/xml;q=0, */*", None, "json"),
        ("text/*", None, "xml"),
        ("application/*", None, "json"),
        ("text/html", None, "json"),
        ("*/*", "application/xml", "xml"),
        ("text/html", "text/xml", "xml"),
        (None, "application/xml; charset=utf-8", "xml"),
        (None, "application/atom+xml", "xml"),
        (None, "application/json", "json"),
        ("application/json", "application/xml", "json"),
        ("application/json, application/xml", "application/xml", "json"),
        ("application/xml;q=0, application/json;q=0", "application/xml", "xml"),
        (";;;q=abc,,,", None, "json"),
        (";;;q=abc,,,", "application/xml", "xml"),
        ("application/xml;q=nan", None, "json"),
        ("application/xml;q=2", None, "json"),
        ("\x00\xff/\x7f", "text/xml", "xml"),
        # longer than the 1 KiB parsed: the types that matter are found wherever they are
        (
            ", ".join(f"text/x-{n}" for n in range(150))
            + ", application/json;q=0.5, Application/XML",
            None,
            "xml",
        ),
        ("application/json, " + "x-a/b;q=0.1, " * 8_000 + "application/xml", None, "json"),
        ("text/html, " + "xml," * 2_000 + "application/json", None, "json"),
        ("x" * 64_000, "application/xml", "xml"),
    ],
)
def test_accept_negotiation(accept: str | None, content_type: str | None, expected: str) -> None:
    """With fault.format "auto" the client gets the format its Accept (else its body) prefers."""
    environ: WSGIEnvironment = {}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if content_type is not None:
        environ["CONTENT_TYPE"] = content_type
    status, headers, body = render_fault(checkout_full(), environ, "r")
    assert status == "503 Service Unavailable"
    expected_type = {"xml": "application/xml; charset=utf-8", "json": "application/problem+json"}
    assert header(headers, "Content-Type") == expected_type[expected]
    parse_body(expected_type[expected], body)


@pytest.mark.parametrize(
    ("fault_format", "environ", "expected"),
    [
        ("xml", {"HTTP_ACCEPT": "application/json"}, "application/xml; charset=utf-8"),
        ("json", {"HTTP_ACCEPT": "application/xml"}, "application/problem+json"),
        ("json", {"CONTENT_TYPE": "application/xml"}, "application/problem+json"),
        ("xml", {}, "application/xml; charset=utf-8"),
    ],
)
def test_fault_format_forces(fault_format: str, environ: WSGIEnvironment, expected: str) -> None:
    """fault.format "xml" or "json" overrides what Accept or the body would pick."""
    _, headers, body = render_fault(checkout_full(), environ, "r", fault_format=fault_format)
    assert header(headers, "Content-Type") == expected
    parse_body(expected, body)


def test_xml_request_body_gets_xml() -> None:
    """A client posting XML with a generic Accept (curl's */*) gets the fault as XML."""
    _, headers, body = render_fault(
        checkout_full(), {"CONTENT_TYPE": "application/xml", "HTTP_ACCEPT": "*/*"}, "r"
    )
    assert header(headers, "Content-Type") == "application/xml; charset=utf-8"
    assert fromstring(body).findtext(f"{NS}code") == "GK-CONCURRENCY-LIMIT"


# -- user renderer --------------------------------------------------------------------------


def test_user_renderer_body() -> None:
    """A site renderer supplies the body; status and standard headers stay the gatekeeper's."""
    seen: list[tuple[Rejected, str, WSGIEnvironment]] = []

    def renderer(
        rejected: Rejected, request_id: str, environ: WSGIEnvironment
    ) -> tuple[str, bytes]:
        seen.append((rejected, request_id, environ))
        return "application/vnd.site.error+json", b'{"err":"busy"}'

    rejected = login_rate()
    environ: WSGIEnvironment = {"HTTP_ACCEPT": "application/xml"}
    status, headers, body = render_fault(
        rejected, environ, "rid-7", renderer=renderer, fault_format="xml"
    )
    assert seen == [(rejected, "rid-7", environ)]
    assert status == "429 Too Many Requests"
    assert body == b'{"err":"busy"}'
    assert header(headers, "Content-Type") == "application/vnd.site.error+json"
    assert header(headers, "Content-Length") == str(len(body))
    assert header(headers, "Retry-After") == "12"
    assert header(headers, "X-Request-Id") == "rid-7"
    assert header(headers, "RateLimit") == '"shop/login/*";r=0;t=12'


def test_user_renderer_text_is_utf8() -> None:
    """A renderer returning text has it sent as UTF-8 with the right Content-Length."""
    _, headers, body = render_fault(
        checkout_full(), {}, "ü", renderer=lambda r, i, e: ("text/plain", f"zu viele, {i}")
    )
    assert body == "zu viele, ü".encode()
    assert header(headers, "Content-Length") == str(len(body))


def test_user_renderer_content_type_is_sanitized() -> None:
    """A renderer's Content-Type cannot inject headers."""
    _, headers, _ = render_fault(
        checkout_full(), {}, "r", renderer=lambda r, i, e: ("text/plain\r\nX-Evil: 1", "busy")
    )
    assert header(headers, "Content-Type") == "text/plainX-Evil: 1"
    assert_safe_headers(b"busy", headers)


def failing_renderer(
    rejected: Rejected, request_id: str, environ: WSGIEnvironment
) -> tuple[str, str]:
    raise RuntimeError(f"template missing for {environ.get('HTTP_AUTHORIZATION')}")


@pytest.fixture
def renderer_log(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The renderer's failures logged through a throttle of their own, on a clock the
    test moves: each test sees its own first failure logged."""
    clock = FakeClock()
    monkeypatch.setattr(fault, "_renderer_failures", Throttle(fault.RENDERER_LOG_INTERVAL, clock))
    return clock


def test_broken_user_renderer_falls_back(
    caplog: pytest.LogCaptureFixture, renderer_log: FakeClock
) -> None:
    """A renderer that raises still lets the client get the standard fault; the error is
    logged with its type and where it was raised, not its message, which may quote the
    request's secrets (SPEC 4.8)."""
    environ = {"HTTP_AUTHORIZATION": "Bearer s3cret-token"}
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        status, _, body = render_fault(checkout_full(), environ, "r", renderer=failing_renderer)
    assert status == "503 Service Unavailable"
    assert json.loads(body)["code"] == "GK-CONCURRENCY-LIMIT"
    assert "RuntimeError" in caplog.text and "failing_renderer" in caplog.text
    assert "s3cret-token" not in caplog.text


def test_a_renderer_failing_on_every_rejection_is_logged_once_an_interval(
    caplog: pytest.LogCaptureFixture, renderer_log: FakeClock
) -> None:
    """During overload a broken renderer fails on every rejection: one ERROR per interval,
    the failures in between counted in the next one, not a line per rejection (which
    would flood the log and slow every refusal when refusals must be cheapest)."""
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        for _ in range(50):
            status, _, _ = render_fault(checkout_full(), {}, "r", renderer=failing_renderer)
            assert status == "503 Service Unavailable"
        renderer_log.advance(fault.RENDERER_LOG_INTERVAL)
        render_fault(checkout_full(), {}, "r", renderer=failing_renderer)
    errors = [r.getMessage() for r in caplog.records if "fault renderer" in r.getMessage()]
    assert len(errors) == 2
    assert "(1 times since the last report)" in errors[0]
    assert "(50 times since the last report)" in errors[1]


def test_user_renderer_wrong_return_falls_back(
    caplog: pytest.LogCaptureFixture, renderer_log: FakeClock
) -> None:
    """A renderer returning the wrong types is logged and replaced by the standard fault."""
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        _, headers, body = render_fault(
            checkout_full(),
            {},
            "r",
            fault_format="xml",
            renderer=lambda r, i, e: ("x", 42),  # type: ignore[arg-type,return-value]
        )
    assert header(headers, "Content-Type") == "application/xml; charset=utf-8"
    assert fromstring(body).tag == f"{NS}ServiceFault"
    assert "expected (str, bytes | str)" in caplog.text


def test_fault_renderer_setting_accepts_callables_and_paths() -> None:
    """fault.renderer may be a callable, "pkg.mod:func" or "pkg.mod.func"; empty means none."""
    assert build_config({"fault": {"renderer": ""}}).fault.renderer is None
    for value in (
        rendered_by_site,
        f"{__name__}:rendered_by_site",
        f" {__name__}.rendered_by_site ",
    ):
        assert build_config({"fault": {"renderer": value}}).fault.renderer is rendered_by_site
    renderer = build_config({"fault": {"renderer": f"{__name__}:rendered_by_site"}}).fault.renderer
    assert renderer is not None
    _, _, body = render_fault(checkout_full(), {}, "r1", renderer=renderer)
    assert body == b"busy (GK-CONCURRENCY-LIMIT, r1)"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no_such_module_gk:render", "'no_such_module_gk:render'"),
        ("json:no_such_function", "'json:no_such_function'"),
        ("json:__doc__", "expected the path of a callable"),
        (42, "expected a dotted path or a callable"),
    ],
)
def test_fault_renderer_setting_errors(value: Any, message: str) -> None:
    """A bad fault.renderer is a ConfigError naming the key, the value and what was expected."""
    with pytest.raises(ConfigError) as info:
        build_config({"fault": {"renderer": value}})
    assert info.value.key == "fault.renderer"
    assert str(info.value).startswith("fault.renderer: ")
    assert message in str(info.value)


# -- hostile input --------------------------------------------------------------------------


def junk(size: int, seed: int = 9457) -> str:
    """Reproducible garbage: any code point (surrogates included), biased towards latin-1."""
    rng = random.Random(seed)
    return "".join(
        chr(rng.randrange(0x110000) if rng.random() < 0.5 else rng.randrange(256))
        for _ in range(size)
    )


JUNK = junk(10 * 1024)
HOSTILE = [
    "<&\"'>",
    "]]><!--",
    "\x00\x01\x08\x0b\x0c\x1b\x7f",
    "\r\nSet-Cookie: session=stolen",
    "\ud800lone\udfff",
    "\ufffe\uffff",
    "tab\tnew\nline\rcr",
    "☃ ünïcode 𝄞",
    JUNK,
]


def xml_expected(text: str) -> str:
    """What an XML parser gives back: characters XML 1.0 forbids are removed, the rest kept."""
    return re.sub("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]", "", text)


@pytest.mark.parametrize("hostile", HOSTILE, ids=lambda text: repr(text[:20]))
@pytest.mark.parametrize(
    "environ",
    [{"HTTP_ACCEPT": "application/xml"}, SOAP11_ENVIRON, SOAP12_ENVIRON],
    ids=["xml", "soap11", "soap12"],
)
def test_hostile_text_gives_well_formed_xml(hostile: str, environ: WSGIEnvironment) -> None:
    """Request ids and limit paths full of markup, controls or junk still give well-formed XML."""
    rejected = login_rate(limit_path=hostile, limit_value=hostile, level=hostile)
    _, headers, body = render_fault(rejected, dict(environ), hostile)
    (service_fault,) = fromstring(body).iter(f"{NS}ServiceFault")
    expected = xml_expected(hostile)
    assert service_fault.findtext(f"{NS}requestId") == expected
    assert service_fault.findtext(f"{NS}level") == expected
    limit = service_fault.find(f"{NS}limit")
    assert limit is not None
    assert limit.get("path") == expected
    assert limit.text == (expected or None)
    assert_safe_headers(body, headers)
    assert header(headers, "Set-Cookie") is None


@pytest.mark.parametrize("hostile", HOSTILE, ids=lambda text: repr(text[:20]))
def test_hostile_text_gives_valid_json(hostile: str) -> None:
    """Request ids and limit paths full of markup, controls or junk still give valid JSON."""
    rejected = login_rate(limit_path=hostile, limit_value=hostile)
    _, headers, body = render_fault(rejected, {}, hostile)
    problem = json.loads(body.decode("ascii"))
    without_surrogates = re.sub("[\ud800-\udfff]", "", hostile)
    assert problem["requestId"] == without_surrogates
    assert problem["limit"] == {"path": without_surrogates, "value": without_surrogates}
    assert_safe_headers(body, headers)


def test_request_id_header_drops_unsafe_characters() -> None:
    """The echoed request id header never carries CR/LF, controls or non-latin-1 characters."""
    _, headers, _ = render_fault(checkout_full(), {}, "abc\r\nSet-Cookie: x=1\x00é☃")
    assert header(headers, "X-Request-Id") == "abcSet-Cookie: x=1"


@settings(max_examples=300, deadline=None)
@given(
    request_id=st.text(),
    accept=st.one_of(st.none(), st.text()),
    content_type=st.one_of(st.none(), st.text()),
    soap_action=st.booleans(),
    fault_format=st.sampled_from(["auto", "xml", "json"]),
    limit_path=st.one_of(st.none(), st.text()),
)
def test_arbitrary_input_always_gives_a_parseable_fault(
    request_id: str,
    accept: str | None,
    content_type: str | None,
    soap_action: bool,
    fault_format: str,
    limit_path: str | None,
) -> None:
    """Whatever a client sends, the fault renders, parses by its Content-Type, headers are safe."""
    environ: WSGIEnvironment = {}
    if accept is not None:
        environ["HTTP_ACCEPT"] = accept
    if content_type is not None:
        environ["CONTENT_TYPE"] = content_type
    if soap_action:
        environ["HTTP_SOAPACTION"] = ""
    rejected = login_rate(limit_path=limit_path)
    status, headers, body = render_fault(rejected, environ, request_id, fault_format=fault_format)
    assert status in ("429 Too Many Requests", "500 Internal Server Error")
    content = header(headers, "Content-Type")
    assert content is not None
    parsed = parse_body(content, body)
    if isinstance(parsed, dict):
        assert parsed["code"] == "GK-RATE-LIMIT"
    else:
        assert [code.text for code in parsed.iter(f"{NS}code")] == ["GK-RATE-LIMIT"]
    assert_safe_headers(body, headers)
