"""The rejected-request log (SPEC §7): one JSON line per rejection on ``gatekeeper.rejected``
with secrets redacted and the body up to a cap, written by a listener thread so a slow
handler never delays the response."""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from werkzeug.test import Client, EnvironBuilder

from gatekeeper_wsgi import GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.rejectlog import REDACTED, ReplayedBody, flush, rejection_record
from tests.conftest import replace_file
from tests.servers import DEADLINE, Gunicorn, Waitress, wait_until

APPS = str(Path(__file__).parent / "apps")


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


class ListHandler(logging.Handler):
    """Collects the formatted lines it is given, and the thread that gave them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.threads: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.threads.append(threading.current_thread().name)


@pytest.fixture
def rejected_logger() -> Iterator[logging.Logger]:
    """The `gatekeeper.rejected` logger at INFO, restored afterwards."""
    logger = logging.getLogger("gatekeeper.rejected")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger
    finally:
        assert flush()
        logger.setLevel(level)
        logger.propagate = propagate
        for handler in list(logger.handlers):
            logger.removeHandler(handler)


def environ(path: str = "/orders/7", **kwargs: Any) -> dict[str, Any]:
    return EnvironBuilder(path=path, **kwargs).get_environ()


def test_record_redacts_secrets_and_configured_headers() -> None:
    """Authorization, Cookie and configured headers are logged as [redacted]."""
    config = build_config({"rejected_log": {"redact_headers": ["X-Api-Key"]}})
    env = environ(
        headers={
            "Authorization": "Bearer s3cret",
            "Cookie": "a=s3cret",
            "X-API-KEY": "s3cret",
            "X-Caller-Id": "crm",
        }
    )
    record = rejection_record(env, Rejected("GK-CALLER-MISSING"), "rid-1", config)
    assert "s3cret" not in json.dumps(record)
    assert record["headers"]["Authorization"] == REDACTED
    assert record["headers"]["Cookie"] == REDACTED
    assert record["headers"]["X-Api-Key"] == REDACTED
    assert record["headers"]["X-Caller-Id"] == "crm"
    assert record["status"] == 400
    assert record["requestId"] == "rid-1"


def test_record_caps_the_body_and_says_so() -> None:
    """The body is captured up to rejected_log.body_bytes and marked truncated beyond."""
    config = build_config({"rejected_log": {"body_bytes": 4}})
    record = rejection_record(
        environ(method="POST", data=b"abcdefgh"), Rejected("GK-RATE-LIMIT"), "r", config
    )
    assert record["body"] == "abcd"
    assert record["body_truncated"] is True
    whole = rejection_record(
        environ(method="POST", data=b"abcd"), Rejected("GK-RATE-LIMIT"), "r", config
    )
    assert whole["body"] == "abcd"
    assert whole["body_truncated"] is False


def test_record_keeps_binary_bodies_and_odd_paths_exact() -> None:
    """A non-UTF-8 body is logged as base64; the path percent-encoded, the query raw."""
    config = build_config({})
    env = environ(method="PUT", data=b"\xff\x00\xfe", query_string="q=%20a&b")
    env["PATH_INFO"] = "/caf\xc3\xa9 x/\n"  # PEP 3333: the UTF-8 bytes as latin-1
    record = rejection_record(env, Rejected("GK-RATE-LIMIT"), "r", config)
    assert base64.b64decode(record["body_b64"]) == b"\xff\x00\xfe"
    assert "body" not in record
    assert record["path"] == "/caf%C3%A9%20x/%0A"
    assert record["query"] == "q=%20a&b"
    assert record["method"] == "PUT"


@pytest.mark.parametrize(
    ("uri", "logged"),
    [
        ("/a%2Fb/%41", "/a%2Fb/%41"),  # as sent: %2F is no "/" (another resource)
        ("/a%2Fb/%41?x=1", "/a%2Fb/%41"),
        ("http://example.com/a%2Fb/%41", "/a%2Fb/%41"),  # the absolute form
        ("/somewhere/else", "/a/b/A"),  # not this path (a proxy rewrote it): the decoded one
    ],
)
def test_the_path_is_logged_as_the_client_wrote_it(uri: str, logged: str) -> None:
    """Where the server hands over the request line (RAW_URI, REQUEST_URI), the logged
    path is the one sent, escapes and all, so a replay reaches the same resource; where
    it does not decode to the app's path, the app's path, percent-encoded."""
    config = build_config({})
    for name in ("RAW_URI", "REQUEST_URI"):
        env = environ()
        env["PATH_INFO"] = "/a/b/A"
        env[name] = uri
        assert rejection_record(env, Rejected("GK-RATE-LIMIT"), "r", config)["path"] == logged


def test_each_rejection_is_one_json_line_from_the_listener_thread(
    rejected_logger: logging.Logger,
) -> None:
    """A rejected request produces one escaped JSON line, handled off the request thread."""
    handler = ListHandler()
    rejected_logger.addHandler(handler)
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    response = Client(app).post(
        "/orders?x=1",
        data="é\r\nnext",
        headers={"X-Request-Id": "req-9", "X-Note": "\x1b[31m"},
    )
    assert response.status_code == 503
    assert flush()
    assert len(handler.lines) == 1
    line = handler.lines[0]
    assert line.isascii() and "\n" not in line and "\x1b" not in line
    record = json.loads(line)
    assert record["requestId"] == "req-9"
    assert record["code"] == "GK-CONCURRENCY-LIMIT"
    assert record["limit"] == {"path": "shop", "value": 0}  # a number, as in the JSON fault
    assert record["body"] == "é\r\nnext"
    assert record["headers"]["X-Note"] == "\x1b[31m"
    assert handler.threads[0] != threading.current_thread().name


def test_the_request_that_reloads_is_answered_and_logged_by_the_new_file(
    rejected_logger: logging.Logger, tmp_path: Path
) -> None:
    """The request whose admission swaps in a changed file is refused by the new limits,
    so its fault and its log line follow the new file as well: its fault format, and the
    fields it redacts (a secret an operator adds to redact_fields is never logged once)."""
    handler = ListHandler()
    rejected_logger.addHandler(handler)
    path = tmp_path / "gatekeeper.properties"
    path.write_text("fault.format = xml\nlimits.shop.concurrency = 5\n")
    settings = {"project": "shop", "reload": {"file": str(path), "every_requests": 1}}
    client = Client(GateKeeperMiddleware(ok_app, settings))
    assert client.get("/orders?ssn=123-45-6789").status_code == 200
    replace_file(
        path,
        "fault.format = json\nrejected_log.redact_fields = ssn\n"
        "limits.shop.concurrency = 5\nlimits.shop/orders.concurrency = 0\n",
    )
    response = client.get("/orders?ssn=123-45-6789")
    assert response.status_code == 503
    assert response.mimetype == "application/problem+json"
    assert response.json["limit"] == {"path": "shop/orders", "value": 0}
    assert flush()
    (line,) = handler.lines
    assert "123-45-6789" not in line
    assert json.loads(line)["query"] == f"ssn={REDACTED}"


def test_a_blocked_handler_does_not_delay_the_response(rejected_logger: logging.Logger) -> None:
    """While a handler hangs, rejected requests still complete; the lines come after."""
    entered = threading.Event()
    release = threading.Event()
    written: list[str] = []

    class BlockingHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            entered.set()
            release.wait(30)
            written.append(record.getMessage())

    rejected_logger.addHandler(BlockingHandler())
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    client = Client(app)
    first = client.get("/a", headers={"X-Request-Id": "one"})
    assert first.status_code == 503
    assert entered.wait(10), "the listener thread never reached the handler"
    # The handler is stuck on the first record; more rejections still answer at once.
    second = client.get("/b", headers={"X-Request-Id": "two"})
    assert second.status_code == 503
    assert written == []
    release.set()
    assert flush()
    assert [json.loads(line)["requestId"] for line in written] == ["one", "two"]


def test_a_handler_that_raises_does_not_end_the_log(
    rejected_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    """A handler raising on one record (a custom one, on a transient failure) is
    reported as logging reports a handler's error; the listener lives on, and every
    later record is delivered, none left waiting or dropped."""
    delivered: list[str] = []

    class FlakyHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not delivered and "first" in record.getMessage():
                delivered.append("failed")
                raise ConnectionError("the log server went away for a moment")
            delivered.append(json.loads(record.getMessage())["requestId"])

    rejected_logger.addHandler(FlakyHandler())
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    client = Client(app)
    assert client.get("/", headers={"X-Request-Id": "first"}).status_code == 503
    assert flush()
    for number in range(5):
        assert client.get("/", headers={"X-Request-Id": f"later-{number}"}).status_code == 503
    assert flush()
    assert delivered == ["failed", *(f"later-{number}" for number in range(5))]
    assert "ConnectionError: the log server went away" in capsys.readouterr().err
    assert app.gatekeeper.stats()["counters"]["rejected_log_dropped"] == 0


def test_a_path_with_a_lone_surrogate_is_logged_not_raised(
    rejected_logger: logging.Logger,
) -> None:
    """A path that is no PEP 3333 string (a lone surrogate no byte decodes to, from a
    server or test that built the environ itself) is logged percent-encoded; the client
    gets its fault."""
    handler = ListHandler()
    rejected_logger.addHandler(handler)
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    statuses: list[str] = []
    for path in ("/\ud800", "/a\udbff/\udc00", "/\udcff\udc7f"):
        env = environ()
        env["PATH_INFO"] = path
        body = app(env, lambda status, headers, exc_info=None: statuses.append(status))
        assert b"GK-CONCURRENCY-LIMIT" in b"".join(body)
    assert statuses == ["503 Service Unavailable"] * 3
    assert flush()
    assert [json.loads(line)["path"] for line in handler.lines] == [
        "/%ED%A0%80",
        "/a%ED%AF%BF/%ED%B0%80",
        "/%ED%B3%BF%ED%B1%BF",  # with another surrogate, an escaped byte is one too
    ]


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=300).map(lambda raw: raw.replace(b"\x00", b"\n")),
    taken=st.integers(0, 80),
    calls=st.lists(
        st.tuples(st.sampled_from(["read", "readline"]), st.one_of(st.none(), st.integers(-1, 90))),
        max_size=12,
    ),
)
def test_a_replayed_body_reads_as_the_body_did(
    data: bytes, taken: int, calls: list[tuple[str, int | None]]
) -> None:
    """A body whose first bytes were read already, handed out again first by a
    ReplayedBody, reads exactly as the untouched stream would, to any mix of PEP 3333's
    reads; and one that recorded what it handed out rewinds to the whole body."""
    original = io.BytesIO(data)
    replayed = ReplayedBody(original, original.read(taken))
    model = io.BytesIO(data)
    for method, size in calls:
        assert getattr(replayed, method)(size) == getattr(model, method)(size)
    assert b"".join(replayed) == model.read()
    recording = ReplayedBody(io.BytesIO(data), record=True)
    for method, size in calls:
        getattr(recording, method)(size)
    assert recording.rewound().read() == data


def test_a_replayed_body_whose_stream_fails_keeps_what_it_holds() -> None:
    """The stream's error reaches the reader (as it would without the replay), and the
    bytes the replay held are not lost with it."""
    replayed = ReplayedBody(_CutShortInput(b""), b"abc\ndef")
    with pytest.raises(OSError):
        replayed.read(100)
    assert replayed.readline() == b"abc\n"  # a whole line held: the stream is not asked
    with pytest.raises(OSError):
        replayed.readline()  # "def" has no end held: the stream is asked, and fails
    assert replayed.read(3) == b"def"
    with pytest.raises(OSError):
        replayed.read()


def test_nothing_is_read_or_queued_when_the_logger_is_off() -> None:
    """With gatekeeper.rejected below INFO, a rejection leaves the body unread, whatever
    its type (its format is told by its Content-Type, not by reading it)."""
    logger = logging.getLogger("gatekeeper.rejected")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        app = GateKeeperMiddleware(
            ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}}
        )
        payload = b"<payload>" + b"x" * 1000
        for content_type in ("application/json", None, "text/plain"):
            env = environ(method="POST", data=payload, content_type=content_type)
            stream = io.BytesIO(payload)
            env["wsgi.input"] = stream
            chunks = app(env, lambda status, headers, exc_info=None: lambda data: None)
            assert b"".join(chunks)
            assert stream.tell() == 0
    finally:
        logger.setLevel(level)


def body_fields(env: dict[str, Any], body_bytes: int = 2048) -> dict[str, Any]:
    """The body members of the record of a request with ``env``."""
    config = build_config({"rejected_log": {"body_bytes": body_bytes}})
    record = rejection_record(env, Rejected("GK-RATE-LIMIT"), "r", config)
    return {key: value for key, value in record.items() if key.startswith("body")}


def chunked_environ(body: bytes, *, terminated: bool) -> dict[str, Any]:
    """A chunked POST as a server hands it over: no Content-Length, the body's end marked
    (``wsgi.input_terminated``) or not."""
    env = environ(method="POST", content_type="application/json")
    env.pop("CONTENT_LENGTH", None)
    env["HTTP_TRANSFER_ENCODING"] = "chunked"
    env["wsgi.input"] = io.BytesIO(body)
    if terminated:
        env["wsgi.input_terminated"] = True
    return env


def test_a_body_whose_end_the_server_marks_is_read_up_to_the_cap() -> None:
    """Without a Content-Length, a terminated stream is read to its end (up to the cap),
    redacted like any other body and marked truncated only when it went on."""
    body = b'{"user": "alice", "password": "s3cret"}'
    assert body_fields(chunked_environ(body, terminated=True)) == {
        "body": '{"user": "alice", "password": "[redacted]"}',
        "body_truncated": False,
    }
    cut = body_fields(chunked_environ(body, terminated=True), body_bytes=16)
    assert cut == {"body": '{"user": "alice"', "body_truncated": True}


def test_a_chunked_body_the_server_does_not_mark_is_not_claimed_empty() -> None:
    """A chunked body on a server that does not say where it ends is left unread and
    logged as not captured, never as a complete empty body (replay skips it)."""
    env = chunked_environ(b'{"password": "s3cret"}', terminated=False)
    fields = body_fields(env)
    assert "body" not in fields and fields["body_truncated"] is True
    assert "not read" in fields["body_omitted"]
    assert env["wsgi.input"].tell() == 0


def test_a_request_without_a_body_is_logged_with_an_empty_complete_one() -> None:
    """No Content-Length and no Transfer-Encoding: HTTP says there is no body."""
    env = environ(method="GET")
    env.pop("CONTENT_LENGTH", None)
    assert body_fields(env) == {"body": "", "body_truncated": False}


class _CutShortInput:
    """A server's input that has ``arrived`` and then fails, as uWSGI's does when a client
    holds the rest of a declared body back past its socket-timeout."""

    def __init__(self, arrived: bytes) -> None:
        self._arrived = arrived

    def read(self, size: int = -1) -> bytes:
        if self._arrived:
            chunk, self._arrived = self._arrived[:size], self._arrived[size:]
            return chunk
        raise OSError("error during read(5000) on wsgi.input")

    readline = read


def test_what_arrived_before_the_server_gave_up_is_logged_as_cut() -> None:
    """A body the server stops reading mid-way (its own deadline, a client gone) is
    logged as far as it arrived, redacted, and marked cut; none at all as before."""
    env = environ(method="POST", data=b"", content_type="application/x-www-form-urlencoded")
    env["CONTENT_LENGTH"] = "5000"
    env["wsgi.input"] = _CutShortInput(b"user=alice&password=hunter2&note=" + b"x" * 66)
    fields = body_fields(env)
    assert fields["body_truncated"] is True
    assert fields["body"].startswith("user=alice&password=[redacted]&note=xxx")
    assert "hunter2" not in json.dumps(fields)
    env["wsgi.input"] = _CutShortInput(b"")
    assert body_fields(env) == {
        "body_omitted": "the server failed to read it: not read",
        "body_truncated": True,
    }


@pytest.mark.parametrize("length", [None, "5000"])
def test_a_body_the_server_fails_to_read_is_waited_for_once(
    rejected_logger: logging.Logger, length: str | None
) -> None:
    """A body whose read fails (a server's deadline, a client gone) is tried once for a
    rejected request: by the fault's look at its format, which tells the log, which does
    not wait a second time; logged as not read."""
    handler = ListHandler()
    rejected_logger.addHandler(handler)
    app = GateKeeperMiddleware(ok_app, {"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    reads: list[int] = []

    class FailingInput:
        def read(self, size: int = -1) -> bytes:
            reads.append(size)
            raise OSError("error during read on wsgi.input")

    env = environ(method="POST", data=b"")
    env.pop("CONTENT_TYPE", None)
    if length is None:
        env.pop("CONTENT_LENGTH", None)
        env["wsgi.input_terminated"] = True
    else:
        env["CONTENT_LENGTH"] = length
    env["wsgi.input"] = FailingInput()
    body = app(env, lambda status, headers, exc_info=None: None)
    assert b"GK-CONCURRENCY-LIMIT" in b"".join(body)
    assert flush()
    assert len(reads) == 1
    (line,) = handler.lines
    record = json.loads(line)
    assert record["body_omitted"] == "the server failed to read it: not read"
    assert "body" not in record


def test_an_unparseable_content_length_is_not_read() -> None:
    """A Content-Length that is not a number: the body is not read, and not claimed empty."""
    env = environ(method="POST", data=b"abc")
    env["CONTENT_LENGTH"] = "3x"
    fields = body_fields(env)
    assert fields["body_truncated"] is True and "Content-Length" in fields["body_omitted"]


def logged(log: Path, count: int) -> list[dict[str, Any]]:
    """The records of the rejected-request log file ``log``, once it holds ``count``."""
    lines = wait_until(
        lambda: len(text := log.read_text("utf-8").splitlines()) >= count and text,
        what=f"{count} lines in the rejected-request log",
    )
    return [json.loads(line) for line in lines]


def rejecting_server(kind: str, tmp_path: Path, log: Path) -> Gunicorn | Waitress:
    """A real server (``kind``) of the app that rejects every request and writes its
    rejected-request log to ``log``."""
    env = {"GK_TEST_REJECTED_LOG": str(log), "PYTHONPATH": APPS}
    if kind == "gunicorn":
        return Gunicorn(tmp_path, "--pythonpath", APPS, "rejected_log_app:app", env=env)
    return Waitress(tmp_path, "rejected_log_app:app", env=env)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gunicorn", "waitress"])
def test_a_chunked_body_is_logged_under_a_real_server(kind: str, tmp_path: Path) -> None:
    """A real server's chunked request (no Content-Length) is logged with its body,
    redacted, and cut at the cap with body_truncated when longer."""
    log = tmp_path / "rejected.jsonl"
    server = rejecting_server(kind, tmp_path, log)
    short = [b'{"user": "alice", ', b'"password": "s3cret"}']
    long = [b'{"user": "bob", "password": "s3cret", ', b'"pad": "' + b"x" * 100 + b'"}']
    with server:
        for chunks in (short, long):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
            try:
                connection.request(
                    "POST",
                    "/orders",
                    body=iter(chunks),
                    headers={"Content-Type": "application/json"},
                    encode_chunked=True,
                )
                response = connection.getresponse()
                response.read()
                assert response.status == 503
            finally:
                connection.close()
        first, second = logged(log, 2)
    if kind == "gunicorn":  # waitress buffers a chunked body and sets a Content-Length itself
        assert "Content-Length" not in first["headers"]
    assert first["body"] == '{"user": "alice", "password": "[redacted]"}'
    assert first["body_truncated"] is False
    assert second["body_truncated"] is True
    assert second["body"].startswith('{"user": "bob", "password": "[redacted]"')
    assert "s3cret" not in log.read_text("utf-8")


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["sync", "gthread"])
def test_a_held_back_body_does_not_hold_a_gunicorn_worker(worker: str, tmp_path: Path) -> None:
    """A refused request declaring a body it never sends (a slow-body attack) gets its
    503 at once: the log's read of the body gives up on it (logged as not sent), the
    connection is ended rather than read on, and the worker serves the next request,
    whose body is logged whole."""
    log = tmp_path / "rejected.jsonl"
    env = {"GK_TEST_REJECTED_LOG": str(log), "PYTHONPATH": APPS}
    args = ["--worker-class", worker, "--threads", "2", "--timeout", "300"]
    with Gunicorn(tmp_path, *args, "--pythonpath", APPS, "rejected_log_app:app", env=env) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as held:
            held.sendall(
                b"POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                b"Content-Length: 2048\r\n\r\nthe first bytes"
            )
            answer = b""
            while b"\r\n\r\n" not in answer:  # the whole head, however it is split
                chunk = held.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 ")
            while held.recv(65536):  # the rest of the response, then the server's close
                pass
        status, _ = server.request("/orders", "POST", {"Content-Type": "text/plain"})
        assert status == 503
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE)
        try:
            connection.request("POST", "/orders", body=b"a whole body")
            response = connection.getresponse()
            response.read()
            assert response.status == 503
        finally:
            connection.close()
        held_back, _, whole = logged(log, 3)
    assert held_back["body_truncated"] is True and "not sent" in held_back["body_omitted"]
    assert "body" not in held_back
    assert (whole["body"], whole["body_truncated"]) == ("a whole body", False)
