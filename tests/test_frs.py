"""The FRS endpoint (SPEC §8): query/update in XML and JSON, exact under concurrency, counts
shared with the middleware, every malformed input answered with a ``<response>``, and the
endpoint served by a real gunicorn."""

from __future__ import annotations

import http.client
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from defusedxml.ElementTree import fromstring
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi.frs import MAX_BODY, FrequencyService
from gatekeeper_wsgi.resolve import key_segment
from tests.conftest import FakeClock
from tests.servers import Gunicorn, run_together

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment


LIMITS = {
    "frs/login/*": {"rate": "5/minute"},
    "frs/sms/*": {"rate": "2/hour"},
}


def xml_request(cmd_type: str, key: str = "alice", biz_id: str = "login") -> bytes:
    return (
        f"<request><cmd_type>{cmd_type}</cmd_type><key>{key}</key>"
        f"<biz_id>{biz_id}</biz_id></request>"
    ).encode()


def answer_of(body: bytes) -> tuple[int | None, str]:
    """(result, msg) of a ``<response>``; result None when the element is absent."""
    root = fromstring(body)
    assert root.tag == "response"
    result = root.findtext("result")
    return (None if result is None else int(result)), root.findtext("msg") or ""


def post(client: Client, data: bytes, **headers: str) -> tuple[int, int | None, str]:
    """POST to the service; (HTTP status, result, msg) from its XML answer."""
    response = client.post("/", data=data, headers=headers)
    assert response.headers["Content-Type"] == "application/xml; charset=utf-8"
    result, msg = answer_of(response.data)
    return response.status_code, result, msg


@pytest.fixture
def keeper(backend_url: str, clock: FakeClock) -> Iterator[GateKeeper]:
    """A GateKeeper on each backend with the FRS limits, on the test's clock."""
    gk = GateKeeper({"backend": backend_url, "limits": LIMITS}, clock=clock)
    yield gk
    gk.close()


@pytest.fixture
def client(keeper: GateKeeper) -> Client:
    """A werkzeug test client of the FrequencyService over ``keeper``."""
    return Client(FrequencyService(keeper))


def memory_client(limits: dict[str, Any], clock: FakeClock | None = None) -> Client:
    settings = {"limits": limits}
    gk = GateKeeper(settings, clock=clock) if clock is not None else GateKeeper(settings)
    return Client(FrequencyService(gk))


# --- the protocol -------------------------------------------------------------------------


def test_update_records_until_the_rate_is_reached_then_restricts(client: Client) -> None:
    """Five updates in a minute answer 0, the sixth answers 1 and names the limit."""
    answers = [post(client, xml_request("update")) for _ in range(6)]
    assert answers[:5] == [(200, 0, "recorded")] * 5
    status, result, msg = answers[5]
    assert (status, result) == (200, 1)
    assert "frs/login/*" in msg and "5/minute" in msg and "retry in" in msg


def test_query_records_nothing(client: Client) -> None:
    """Any number of queries leaves all five uses of the window to updates."""
    for _ in range(20):
        assert post(client, xml_request("query")) == (200, 0, "not restricted")
    results = [post(client, xml_request("update"))[1] for _ in range(6)]
    assert results == [0, 0, 0, 0, 0, 1]


def test_query_answers_restricted_once_the_window_is_full(client: Client) -> None:
    """After five updates, query answers 1 (and keeps answering 1)."""
    for _ in range(5):
        post(client, xml_request("update"))
    for _ in range(3):
        status, result, msg = post(client, xml_request("query"))
        assert (status, result) == (200, 1)
        assert "restricted by frs/login/*" in msg


def test_a_rate_on_the_biz_id_is_one_budget_for_all_its_keys() -> None:
    """A rate on frs/<biz_id> itself (docs/frs.md): once its budget is used, by any keys,
    every key is restricted by it - a verdict (200, 1), not an overloaded endpoint."""
    client = memory_client({"frs/login": {"rate": "2/minute"}, "frs/login/*": {"rate": "5/minute"}})
    assert post(client, xml_request("update", key="alice"))[:2] == (200, 0)
    assert post(client, xml_request("update", key="bob"))[:2] == (200, 0)
    status, result, msg = post(client, xml_request("update", key="carol"))
    assert (status, result) == (200, 1)
    assert "restricted by frs/login (2/minute)" in msg


def test_restricted_update_records_nothing(keeper: GateKeeper, client: Client) -> None:
    """Updates refused while restricted do not extend the window: no rejection is counted
    against the key's future beyond the five recorded uses."""
    for _ in range(5):
        post(client, xml_request("update"))
    for _ in range(10):
        assert post(client, xml_request("update"))[1] == 1
    assert keeper.stats()["counters"]["admitted"] == 5


def test_keys_and_biz_ids_count_separately(client: Client) -> None:
    """Each key has its own window, and each biz id its own rate."""
    for _ in range(5):
        post(client, xml_request("update", key="alice"))
    assert post(client, xml_request("query", key="alice"))[1] == 1
    assert post(client, xml_request("query", key="bob"))[1] == 0
    assert [post(client, xml_request("update", biz_id="sms"))[1] for _ in range(3)] == [0, 0, 1]


def test_json_request_gets_xml_unless_json_is_accepted(client: Client) -> None:
    """A JSON body is answered in XML by default and in JSON when Accept prefers it."""
    fields = {"cmd_type": "update", "key": "alice", "biz_id": "login"}
    assert post(client, json.dumps(fields).encode(), **{"Content-Type": "application/json"}) == (
        200,
        0,
        "recorded",
    )
    response = client.post(
        "/", json={**fields, "cmd_type": "query"}, headers={"Accept": "application/json"}
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert response.get_json() == {"result": 0, "msg": "not restricted"}


def test_xml_request_can_ask_for_a_json_answer(client: Client) -> None:
    """Accept decides the answer's format, whatever the request's."""
    response = client.post("/", data=xml_request("query"), headers={"Accept": "application/json"})
    assert response.get_json() == {"result": 0, "msg": "not restricted"}


def test_json_error_answer_carries_no_result() -> None:
    """An error answered in JSON has only msg: no result a careless client could trust."""
    client = memory_client(LIMITS)
    response = client.post("/", json={"cmd_type": "query"}, headers={"Accept": "application/json"})
    assert response.status_code == 400
    assert response.get_json() == {"msg": "missing field: key, biz_id"}


def test_json_numeric_key_is_a_key() -> None:
    """A numeric user id in JSON counts like its decimal string."""
    client = memory_client({"frs/login/*": {"rate": "1/minute"}})
    body = json.dumps({"cmd_type": "update", "key": 4711, "biz_id": "login"}).encode()
    assert post(client, body)[1] == 0
    assert post(client, xml_request("update", key="4711"))[1] == 1


def test_xml_declaration_namespace_and_whitespace_are_accepted() -> None:
    """A declared encoding, a namespace, pretty-printing and extra fields are fine."""
    client = memory_client(LIMITS)
    body = (
        '<?xml version="1.0" encoding="ISO-8859-1"?>\n'
        '<request xmlns="urn:example:frs">\n'
        "  <cmd_type> update </cmd_type>\n  <key>alice</key>\n"
        "  <biz_id>login</biz_id>\n  <trace>abc</trace>\n</request>\n"
    ).encode("latin-1")
    assert post(client, body, **{"Content-Type": "text/xml"}) == (200, 0, "recorded")


def test_window_rolls_on() -> None:
    """A restricted key is free again once its uses have slid out of the window."""
    clock = FakeClock()
    client = memory_client(LIMITS, clock)
    for _ in range(5):
        post(client, xml_request("update"))
        clock.advance(1)
    assert post(client, xml_request("query"))[1] == 1
    clock.advance(60 - 5 + 0.001)
    assert post(client, xml_request("query"))[1] == 0
    assert post(client, xml_request("update"))[1] == 0
    assert post(client, xml_request("update"))[1] == 1


def test_hostile_keys_are_digested_and_never_echoed(client: Client) -> None:
    """A key that is not a plain name counts under its own digest, apart from look-alikes,
    and never appears in an answer."""
    hostile = "a/../*\x01<b>&" + "x" * 500

    def update(key: str) -> tuple[int, int | None, str]:
        return post(
            client, json.dumps({"cmd_type": "update", "key": key, "biz_id": "login"}).encode()
        )

    assert [update(hostile)[1] for _ in range(5)] == [0] * 5
    status, result, msg = update(hostile)
    assert (status, result) == (200, 1)
    assert "<b>" not in msg and "xxxx" not in msg and "../" not in msg
    assert update(hostile + "y")[1] == 0
    assert update("a")[1] == 0
    assert key_segment(hostile).startswith("~")


def test_catch_all_biz_limit_and_exact_key_limits() -> None:
    """frs/*/* makes every biz id known; an exact key limit beats the wildcard."""
    client = memory_client({"frs/*/*": {"rate": "1/minute"}, "frs/login/vip": {"rate": "3/minute"}})
    assert [post(client, xml_request("update", biz_id="any"))[1] for _ in range(2)] == [0, 1]
    assert [post(client, xml_request("update", key="vip"))[1] for _ in range(4)] == [0, 0, 0, 1]


def test_shadow_limit_never_restricts() -> None:
    """A limit in shadow mode answers 0 and records, as the middleware would admit."""
    client = memory_client({"frs/login/*": {"rate": "1/minute", "mode": "shadow"}})
    assert [post(client, xml_request("update"))[1] for _ in range(3)] == [0, 0, 0]
    assert post(client, xml_request("query"))[1] == 0


def test_overload_is_a_503_not_a_verdict() -> None:
    """A full concurrency limit on project frs answers 503 with Retry-After and no result."""
    client = memory_client({"frs": {"concurrency": 0}, **LIMITS})
    response = client.post("/", data=xml_request("update"))
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    result, msg = answer_of(response.data)
    assert result is None and msg.startswith("GK-CONCURRENCY-LIMIT")


def test_biz_ids_are_hot_reloaded(tmp_path: Path) -> None:
    """A biz id added to the config file is served after the next reload check."""
    file = tmp_path / "gatekeeper.toml"
    file.write_text('[limits."frs/login/*"]\nrate = "5/minute"\n')
    clock = FakeClock()
    gk = GateKeeper({"reload": {"file": str(file), "every_seconds": 5}}, clock=clock)
    client = Client(FrequencyService(gk))
    status, result, msg = post(client, xml_request("update", biz_id="signup"))
    assert (status, result) == (400, None) and "unknown biz_id signup" in msg
    # Replaced by an atomic rename: swapped in at the next check (SPEC §4.10).
    replacement = tmp_path / "gatekeeper.toml.tmp"
    replacement.write_text(
        '[limits."frs/login/*"]\nrate = "5/minute"\n[limits."frs/signup/*"]\nrate = "1/hour"\n'
    )
    os.replace(replacement, file)
    clock.advance(5)
    assert [post(client, xml_request("update", biz_id="signup"))[1] for _ in range(2)] == [0, 1]


# --- consistency --------------------------------------------------------------------------


def test_concurrent_updates_admit_exactly_the_rate(keeper: GateKeeper) -> None:
    """50 simultaneous updates of one key give exactly 5 unrestricted answers; then query
    answers 1."""
    service = FrequencyService(keeper)

    def update(_: int) -> tuple[int, int | None, str]:
        return post(Client(service), xml_request("update"))

    answers = run_together(50, update)
    assert sorted(result for _, result, _ in answers) == [0] * 5 + [1] * 45
    assert post(Client(service), xml_request("query"))[1] == 1


# --- shared with the middleware -----------------------------------------------------------


def login_app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
    """A login endpoint: the password "right" logs in (200), anything else fails (401)."""
    ok = environ.get("QUERY_STRING") == "password=right"
    start_response("200 OK" if ok else "401 Unauthorized", [("Content-Type", "text/plain")])
    return [b"welcome" if ok else b"no"]


def login(site: Client, query: str = "", **environ: str) -> int:
    """One login through the middleware, its response closed (which releases it); the status."""
    with site.get(f"/login?{query}", environ_base=environ) as response:
        return response.status_code


def test_middleware_and_endpoint_share_one_window(backend_url: str, clock: FakeClock) -> None:
    """Logins through the middleware and FRS updates for the same caller fill one window."""
    gk = GateKeeper({"backend": backend_url, "limits": LIMITS}, clock=clock)
    try:
        site = Client(GateKeeperMiddleware(login_app, gk, identify=lambda env: ("frs", "login")))
        frs = Client(FrequencyService(gk))
        for _ in range(3):
            assert login(site, "password=right", HTTP_X_CALLER_ID="alice") == 200
        assert post(frs, xml_request("query"))[1] == 0
        assert [post(frs, xml_request("update"))[1] for _ in range(2)] == [0, 0]
        assert post(frs, xml_request("query"))[1] == 1
        assert login(site, "password=right", HTTP_X_CALLER_ID="alice") == 429
        assert login(site, HTTP_X_CALLER_ID="bob") == 401
    finally:
        gk.close()


def test_failed_logins_by_ip_are_shared_with_the_endpoint(
    backend_url: str, clock: FakeClock
) -> None:
    """With key "ip" and count [401], failed logins and FRS updates for that IP add up;
    successful logins do not count."""
    limits = {"frs/login/*": {"rate": "5/minute", "key": "ip", "count": [401]}}
    gk = GateKeeper({"backend": backend_url, "limits": limits}, clock=clock)
    try:
        site = Client(GateKeeperMiddleware(login_app, gk, identify=lambda env: ("frs", "login")))
        frs = Client(FrequencyService(gk))
        assert login(site, "password=right", REMOTE_ADDR="10.0.0.7") == 200
        assert [login(site, REMOTE_ADDR="10.0.0.7") for _ in range(2)] == [401, 401]
        updates = [post(frs, xml_request("update", key="10.0.0.7"))[1] for _ in range(4)]
        assert updates == [0, 0, 0, 1]
        assert login(site, "password=right", REMOTE_ADDR="10.0.0.7") == 429
        assert login(site, REMOTE_ADDR="10.0.0.8") == 401
    finally:
        gk.close()


# --- malformed input ----------------------------------------------------------------------

XML = "application/xml"
JSON = "application/json"
DEEP_JSON = b"[" * 30_000 + b"]" * 30_000
BILLION_LAUGHS = (
    b'<?xml version="1.0"?>\n<!DOCTYPE lolz [<!ENTITY lol "lol">'
    b'<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">'
    b'<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>'
    b"<request><cmd_type>query</cmd_type><key>&lol3;</key><biz_id>login</biz_id></request>"
)
EXTERNAL_ENTITY = (
    b'<?xml version="1.0"?>\n<!DOCTYPE r [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>'
    b"<request><cmd_type>query</cmd_type><key>&xxe;</key><biz_id>login</biz_id></request>"
)
EXTERNAL_DTD = (
    b'<?xml version="1.0"?>\n<!DOCTYPE request SYSTEM "http://127.0.0.1:9/frs.dtd">'
    b"<request><cmd_type>query</cmd_type><key>a</key><biz_id>login</biz_id></request>"
)

MALFORMED = [
    pytest.param(b"hello", "text/plain", 400, "neither XML nor JSON", id="not-xml-or-json"),
    pytest.param(b"", "", 400, "empty body", id="empty"),
    pytest.param(b"  \n ", XML, 400, "empty body", id="blank"),
    pytest.param(
        b"<request><cmd_type>query", XML, 400, "not well-formed XML (line 1", id="bad-xml"
    ),
    pytest.param(b'{"cmd_type": "query",', JSON, 400, "not valid JSON", id="bad-json"),
    pytest.param(b"<request/>", JSON, 400, "not valid JSON", id="xml-declared-json"),
    pytest.param(b'["query"]', JSON, 400, "must be an object", id="json-array"),
    pytest.param(DEEP_JSON, JSON, 400, "JSON nested too deeply", id="json-nesting"),
    pytest.param(
        b'{"cmd_type": "query", "biz_id": "login", "key": 1, "n": ' + b"9" * 5000 + b"}",
        JSON,
        400,
        "a JSON number of 5000 digits: at most 4000",
        id="json-5000-digit-number",
    ),
    pytest.param(b"\xff\xfe{", JSON, 400, "not valid JSON", id="json-bad-encoding"),
    pytest.param(
        b'<?xml version="1.0" encoding="no-such"?><request/>',
        XML,
        400,
        "not well-formed XML",
        id="xml-unknown-encoding",
    ),
    pytest.param(b"<req><key>a</key></req>", XML, 400, "root element must be <request>", id="root"),
    pytest.param(
        b"<request><cmd_type>query</cmd_type><biz_id>login</biz_id></request>",
        XML,
        400,
        "missing field: key",
        id="missing-key",
    ),
    pytest.param(
        b'{"cmd_type": "update", "key": "a"}',
        JSON,
        400,
        "missing field: biz_id",
        id="missing-biz-id",
    ),
    pytest.param(
        b'{"cmd_type": "", "key": " ", "biz_id": "login"}',
        JSON,
        400,
        "missing field: cmd_type, key",
        id="empty-fields",
    ),
    pytest.param(xml_request("delete"), XML, 400, "unknown cmd_type", id="unknown-cmd"),
    pytest.param(xml_request("QUERY"), XML, 400, "unknown cmd_type", id="cmd-case"),
    pytest.param(
        xml_request("query", biz_id="nope"),
        XML,
        400,
        "unknown biz_id nope: no rate limit",
        id="unknown-biz",
    ),
    pytest.param(xml_request("query", biz_id="a/b"), XML, 400, "invalid biz_id", id="biz-path"),
    pytest.param(xml_request("query", biz_id="*"), XML, 400, "invalid biz_id", id="biz-star"),
    pytest.param(
        b"<request><cmd_type>query</cmd_type><key>a</key><key>b</key><biz_id>login</biz_id>"
        b"</request>",
        XML,
        400,
        "duplicate field: key",
        id="xml-duplicate",
    ),
    pytest.param(
        b'{"cmd_type": "query", "key": "a", "key": "b", "biz_id": "login"}',
        JSON,
        400,
        "duplicate field: key",
        id="json-duplicate",
    ),
    pytest.param(
        b"<request><cmd_type>query</cmd_type><key><a/>b</key><biz_id>login</biz_id></request>",
        XML,
        400,
        "field key must be text",
        id="xml-element-field",
    ),
    pytest.param(
        b'{"cmd_type": "query", "key": ["a"], "biz_id": "login"}',
        JSON,
        400,
        "field key must be a string",
        id="json-list-field",
    ),
    pytest.param(BILLION_LAUGHS, XML, 400, "DTD or entity declarations", id="entity-expansion"),
    pytest.param(EXTERNAL_ENTITY, XML, 400, "DTD or entity declarations", id="external-entity"),
    pytest.param(EXTERNAL_DTD, XML, 400, "DTD or entity declarations", id="external-dtd"),
    pytest.param(
        xml_request("query") + b" " * MAX_BODY, XML, 413, "body too large", id="over-64KiB"
    ),
]


@pytest.mark.parametrize(("body", "content_type", "status", "msg"), MALFORMED)
def test_malformed_request_gets_a_response_naming_the_problem(
    body: bytes, content_type: str, status: int, msg: str
) -> None:
    """Each kind of bad input is answered with its status and a <response> saying why."""
    client = memory_client(LIMITS)
    headers = {"Content-Type": content_type} if content_type else {}
    got_status, result, got_msg = post(client, body, **headers)
    assert (got_status, result) == (status, None)
    assert msg in got_msg


def test_body_of_exactly_64_KiB_is_accepted() -> None:
    """The size limit is inclusive: a 65,536-byte request is served."""
    client = memory_client(LIMITS)
    body = xml_request("query")
    body += b" " * (MAX_BODY - len(body))
    assert len(body) == MAX_BODY
    assert post(client, body) == (200, 0, "not restricted")


@pytest.mark.parametrize("length", [str(10**9), "9" * 20, "9" * 5000], ids=["1e9", "20", "5000"])
def test_oversized_body_is_refused_unread(length: str) -> None:
    """A Content-Length over 64 KiB is answered 413 without reading the body, however
    many digits it has (int() refuses thousands: that must not become a 500)."""

    class Unreadable(io.BytesIO):
        def read(self, size: int | None = -1) -> bytes:
            raise AssertionError("the body was read")

    client = memory_client(LIMITS)
    response = client.post(
        "/", input_stream=Unreadable(), environ_overrides={"CONTENT_LENGTH": length}
    )
    assert response.status_code == 413
    assert answer_of(response.data) == (None, f"body too large: at most {MAX_BODY} bytes")


def test_leading_zeros_do_not_make_a_content_length_large() -> None:
    """Thousands of zeros before the digits are still the small length they spell."""
    body = xml_request("query")
    client = memory_client(LIMITS)
    response = client.post(
        "/", data=body, environ_overrides={"CONTENT_LENGTH": "0" * 5000 + str(len(body))}
    )
    assert (response.status_code, answer_of(response.data)) == (200, (0, "not restricted"))


def test_a_chunked_body_the_server_cannot_end_is_named_not_called_empty() -> None:
    """A chunked request on a server that does not mark the body's end
    (``wsgi.input_terminated``) cannot be read: the answer says so and asks for a
    Content-Length, rather than calling a sent body empty."""
    client = memory_client(LIMITS)
    response = client.post(
        "/",
        input_stream=io.BytesIO(xml_request("query")),
        environ_overrides={"CONTENT_LENGTH": "", "HTTP_TRANSFER_ENCODING": "chunked"},
    )
    assert response.status_code == 400
    assert "send a Content-Length" in answer_of(response.data)[1]


@pytest.mark.parametrize("length", ["abc", "-1", "1e3", "\u00b2"])
def test_invalid_content_length_is_a_400(length: str) -> None:
    """A Content-Length that is not a decimal number is refused."""
    service = FrequencyService({"limits": LIMITS})
    client = Client(service)
    response = client.post("/", data=b"", environ_overrides={"CONTENT_LENGTH": length})
    assert response.status_code == 400
    assert answer_of(response.data) == (None, "invalid Content-Length")


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "OPTIONS", "HEAD"])
def test_only_post_is_allowed(method: str) -> None:
    """Other methods get 405 with Allow: POST."""
    client = memory_client(LIMITS)
    response = client.open("/", method=method)
    assert response.status_code == 405
    assert response.headers["Allow"] == "POST"
    if method != "HEAD":
        assert answer_of(response.data) == (None, "method not allowed: use POST")


def test_input_is_never_echoed() -> None:
    """Markup and control characters in any field never reach the answer."""
    client = memory_client(LIMITS)
    for body in (
        xml_request("&lt;script&gt;alert(1)&lt;/script&gt;"),
        xml_request("query", biz_id="&lt;script&gt;"),
        json.dumps({"cmd_type": "q\u2028<x>", "key": "k", "biz_id": "login\r\nX: y"}).encode(),
    ):
        response = client.post("/", data=body, headers={"Content-Type": "application/xml"})
        assert response.status_code == 400
        assert b"script" not in response.data and b"<x>" not in response.data
        assert b"X: y" not in response.data
        answer_of(response.data)  # still well-formed


def test_respond_serves_framework_views() -> None:
    """respond() gives the same replies to a view that read the body itself."""
    service = FrequencyService({"limits": LIMITS})
    reply = service.respond("POST", xml_request("update"), accept="application/json")
    assert reply.status == "200 OK"
    assert ("Content-Type", "application/json") in reply.headers
    assert json.loads(reply.body) == {"result": 0, "msg": "recorded"}
    too_large = service.respond("POST", b" " * (MAX_BODY + 1))
    assert (too_large.status, answer_of(too_large.body)[0]) == ("413 Content Too Large", None)
    not_allowed = service.respond("GET", b"")
    assert not_allowed.status == "405 Method Not Allowed"
    assert ("Allow", "POST") in not_allowed.headers


# --- a real server ------------------------------------------------------------------------


def http_post(
    port: int, body: bytes | Iterable[bytes], content_type: str = XML, accept: str = ""
) -> tuple[int, bytes, http.client.HTTPResponse]:
    """One POST on a fresh connection (a chunked one when ``body`` is an iterable)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": content_type}
        if accept:
            headers["Accept"] = accept
        chunked = not isinstance(body, bytes)
        conn.request("POST", "/", body=body, headers=headers, encode_chunked=chunked)
        response = conn.getresponse()
        return response.status, response.read(), response
    finally:
        conn.close()


@pytest.fixture
def gunicorn_frs(backend_url: str, tmp_path: Path) -> Iterator[int]:
    """gunicorn serving ``FrequencyService("<config file>")``: one worker with 8 threads on
    the memory backend, two workers on the backends shared between processes."""
    config = tmp_path / "gatekeeper.toml"
    config.write_text(f'backend = "{backend_url}"\n[limits."frs/login/*"]\nrate = "5/minute"\n')
    workers = "1" if backend_url == "memory" else "2"
    app = f'gatekeeper_wsgi.frs:FrequencyService("{config}")'
    with Gunicorn(tmp_path, "--workers", workers, "--threads", "8", app) as server:
        yield server.port


@pytest.mark.slow
def test_served_by_gunicorn(gunicorn_frs: int) -> None:
    """Over real HTTP: 30 concurrent updates give exactly 5 zeros, then query, JSON,
    chunked bodies, malformed input and other methods behave as specified."""
    port = gunicorn_frs

    def update(_: int) -> tuple[int, int | None]:
        status, body, _response = http_post(port, xml_request("update"))
        return status, answer_of(body)[0]

    answers = run_together(30, update)
    assert sorted(answers) == [(200, 0)] * 5 + [(200, 1)] * 25

    status, body, response = http_post(port, xml_request("query"))
    assert status == 200 and response.getheader("Content-Type") == "application/xml; charset=utf-8"
    assert answer_of(body)[0] == 1

    fields = json.dumps({"cmd_type": "query", "key": "bob", "biz_id": "login"}).encode()
    status, body, _ = http_post(port, fields, JSON, accept="application/json")
    assert (status, json.loads(body)) == (200, {"result": 0, "msg": "not restricted"})

    chunks = [
        b"<request><cmd_type>update</cmd_type>",
        b"<key>carol</key><biz_id>login</biz_id></request>",
    ]
    status, body, _ = http_post(port, iter(chunks))
    assert (status, answer_of(body)) == (200, (0, "recorded"))

    status, body, _ = http_post(port, iter([b" " * (MAX_BODY + 1)]))
    assert (status, answer_of(body)[0]) == (413, None)
    status, body, _ = http_post(port, b" " * (MAX_BODY + 1))
    assert (status, answer_of(body)[0]) == (413, None)
    status, body, _ = http_post(port, BILLION_LAUGHS)
    assert status == 400 and "DTD" in answer_of(body)[1]

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/")
        response = conn.getresponse()
        assert (response.status, response.getheader("Allow")) == (405, "POST")
        response.read()
    finally:
        conn.close()
