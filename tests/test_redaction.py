"""No secret reaches a log (SPEC §4.8): the rejected-request log redacts secret headers and
form / JSON / query fields, and backend URLs are masked in the engine's ERROR line, the
status JSON and the CLI."""

from __future__ import annotations

import base64
import contextlib
import gzip
import io
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client, EnvironBuilder
from werkzeug.wrappers import Request

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.backends.memory import MemoryBackend
from gatekeeper_wsgi.cli import main, run_replay
from gatekeeper_wsgi.config import build_config
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.redact import REDACTED, SECRET_FIELDS, mask_text, mask_url
from gatekeeper_wsgi.rejectlog import flush, rejection_record
from gatekeeper_wsgi.status import StatusApp
from tests.logs import Lines, captured, ok_app

SECRET = "Hunter2-guess-5"


@pytest.fixture
def rejected_lines() -> Iterator[Lines]:
    """The lines the `gatekeeper.rejected` logger writes during the test."""
    with captured("gatekeeper.rejected", logging.INFO) as lines:
        yield lines


@pytest.fixture
def event_lines() -> Iterator[Lines]:
    """The lines the `gatekeeper` events logger writes during the test."""
    with captured("gatekeeper", logging.DEBUG) as lines:
        yield lines


def record_of(config: dict[str, Any] | None = None, **builder: Any) -> dict[str, Any]:
    env = EnvironBuilder(**{"path": "/login", **builder}).get_environ()
    rejected = Rejected("GK-RATE-LIMIT", level="caller", limit_path="site/login/*")
    return rejection_record(env, rejected, "rid", build_config(config or {}))


def json_posted(body: str | bytes, body_bytes: int) -> dict[str, Any]:
    """The record of a JSON POST of ``body``, logged up to ``body_bytes``."""
    config = {"rejected_log": {"body_bytes": body_bytes}}
    return record_of(config, method="POST", data=body, content_type="application/json")


@pytest.mark.parametrize(
    "header",
    [
        "Authorization",
        "Proxy-Authorization",
        "Cookie",
        "Set-Cookie",
        "X-Api-Key",
        "X-Apikey",
        "X-Auth-Token",
        "X-Csrf-Token",
        "X-Client-Secret",
        "X-Password",
        "Authentication-Info",
    ],
)
def test_secret_headers_are_redacted(header: str) -> None:
    """Every header of the SPEC's list, and any name containing token/secret/auth/…, is redacted."""
    record = record_of(headers={header: SECRET, "X-Caller-Id": "crm"})
    assert SECRET not in json.dumps(record)
    assert record["headers"][header.title()] == REDACTED
    assert record["headers"]["X-Caller-Id"] == "crm"


def test_configured_header_is_redacted_case_insensitively() -> None:
    """A header listed in `redact_headers` is redacted whatever case it is sent in."""
    record = record_of(
        {"rejected_log": {"redact_headers": ["X-Customer-Pin"]}}, headers={"x-customer-pin": "1234"}
    )
    assert record["headers"]["X-Customer-Pin"] == REDACTED


def test_login_form_password_is_redacted_and_the_rest_kept() -> None:
    """The refused login's form body keeps the user and loses the password."""
    record = record_of(
        method="POST",
        data=f"user=alice&password={SECRET}&csrfmiddlewaretoken=tok123&remember=1",
        content_type="application/x-www-form-urlencoded",
    )
    assert SECRET not in record["body"] and "tok123" not in record["body"]
    assert record["body"] == (
        "user=alice&password=[redacted]&csrfmiddlewaretoken=[redacted]&remember=1"
    )


@pytest.mark.parametrize(
    "field",
    ["password", "passwd", "secret", "token", "api_key", "apikey", "access_token", "Refresh_Token"],
)
def test_query_fields_are_redacted(field: str) -> None:
    """`?api_key=…` and the other secret fields are redacted in the logged query string."""
    record = record_of(query_string=f"page=2&{field}={SECRET}")
    assert record["query"] == f"page=2&{field}=[redacted]"


@pytest.mark.parametrize(
    "name", ["password[]", "user[password]", "user[Token][]", "user.api_key", "password%5B%5D"]
)
def test_nested_field_names_are_redacted(name: str) -> None:
    """Names that nest a secret field (PHP / Rails forms, dotted names) are secret too, in
    the query and in a form; a name that only contains one is not."""
    record = record_of(query_string=f"page=2&{name}={SECRET}&passwords=2")
    assert record["query"] == f"page=2&{name}=[redacted]&passwords=2"
    form = record_of(
        method="POST",
        data=f"{name}={SECRET}&user=alice",
        content_type="application/x-www-form-urlencoded",
    )
    assert form["body"] == f"{name}=[redacted]&user=alice"


def test_configured_field_is_redacted_in_query_form_and_json() -> None:
    """A name in `redact_fields` is redacted in the query, a form body and a JSON body."""
    config = {"rejected_log": {"redact_fields": ["pin"]}}
    assert record_of(config, query_string="pin=1234&a=1")["query"] == "pin=[redacted]&a=1"
    form = record_of(
        config, method="POST", data="PIN=1234", content_type="application/x-www-form-urlencoded"
    )
    assert form["body"] == "PIN=[redacted]"
    body = record_of(config, method="POST", json={"pin": 1234, "card": {"pin": "9876"}})
    assert "1234" not in body["body"] and "9876" not in body["body"]
    assert json.loads(body["body"]) == {"pin": REDACTED, "card": {"pin": REDACTED}}


def test_json_body_is_redacted_nested_and_when_cut_short() -> None:
    """Secret JSON members are redacted at any depth, also in a body the cap cut in half."""
    payload = json.dumps({"user": "alice", "auth": {"password": SECRET}, "items": [1, 2]})
    whole = record_of(method="POST", data=payload, content_type="application/json")
    assert json.loads(whole["body"]) == {
        "user": "alice",
        "auth": {"password": REDACTED},
        "items": [1, 2],
    }
    cut_at = payload.index(SECRET) + 4
    cut = json_posted(payload, body_bytes=cut_at)
    assert cut["body_truncated"] is True
    assert SECRET[:4] not in cut["body"]
    assert '"password": "[redacted]"' in cut["body"]


def test_json_body_without_secrets_is_logged_as_sent() -> None:
    """A JSON body with nothing to redact keeps its exact bytes (replay sends the same)."""
    payload = '{"user":"alice",  "n":1.50}'
    record = record_of(method="POST", data=payload, content_type="application/json")
    assert record["body"] == payload


def test_multipart_and_mislabelled_bodies_are_redacted() -> None:
    """A multipart form field and a form sent as text/plain are redacted too."""
    boundary = "XyZ"
    multipart = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="user"\r\n\r\nalice\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="password"\r\n\r\n{SECRET}\r\n'
        f"--{boundary}--\r\n"
    )
    record = record_of(
        method="POST", data=multipart, content_type=f"multipart/form-data; boundary={boundary}"
    )
    assert SECRET not in record["body"] and "alice" in record["body"]
    plain = record_of(method="POST", data=f"password={SECRET}", content_type="text/plain")
    assert plain["body"] == "password=[redacted]"


def logged_bytes(record: dict[str, Any]) -> bytes:
    """Everything of a record's body that reaches the log, as bytes."""
    if "body_b64" in record:
        return base64.b64decode(record["body_b64"])
    return str(record.get("body", "")).encode()


PNG = b"\x89PNG\r\n\x1a\n\x00\x00\xff\xd8\xff"


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"user=\xff&password=" + SECRET.encode()),
        (
            "multipart/form-data; boundary=XX",
            b'--XX\r\nContent-Disposition: form-data; name="csrfmiddlewaretoken"\r\n\r\n'
            + SECRET.encode()
            + b'\r\n--XX\r\nContent-Disposition: form-data; name="avatar"; filename="a.png"'
            + b"\r\nContent-Type: image/png\r\n\r\n"
            + PNG
            + b"\r\n--XX--\r\n",
        ),
        ("application/json", b'{"note":"\xff","password":"' + SECRET.encode() + b'"}'),
    ],
    ids=["form", "multipart upload", "json"],
)
def test_a_body_with_bytes_that_are_not_utf8_is_redacted(content_type: str, body: bytes) -> None:
    """A stray byte, or a binary file uploaded beside a form's fields, hides no secret
    field from the log: werkzeug and Django read such a form with errors replaced. The
    body is logged as sent but for the secret values."""
    record = record_of(method="POST", data=body, content_type=content_type)
    logged = logged_bytes(record)
    assert SECRET.encode() not in logged and REDACTED.encode() in logged
    assert logged == body.replace(SECRET.encode(), REDACTED.encode())


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", f'{{"user":"bob","password":"{SECRET}"}}'),
        ("multipart/form-data; boundary=XX", f'{{"user":"bob","password":"{SECRET}"}}'),
        ("application/xml", f'{{"user":"bob","password":"{SECRET}"}}'),
        ("application/json", f"user=bob&password={SECRET}"),
        ("application/json", f"<login><password>{SECRET}</password></login>"),
        ("application/x-www-form-urlencoded", f"<login><password>{SECRET}</password></login>"),
    ],
)
def test_a_body_is_redacted_whatever_its_label_says(content_type: str, body: str) -> None:
    """A body labelled as another type than it is (curl -d posts JSON as a form) is read
    by apps as what it is (``json.loads(request.body)``, ``get_json(force=True)``): its
    secret fields are redacted all the same."""
    record = record_of(method="POST", data=body, content_type=content_type)
    assert record["body"] == body.replace(SECRET, REDACTED)


@pytest.mark.parametrize(
    ("codec", "content_type"),
    [
        ("utf-16", "application/json; charset=utf-16"),
        ("utf-16", "application/json"),  # its byte order mark says so
        ("utf-16-le", "application/json"),  # nor that: its NUL bytes do
        ("utf-16-be", "text/plain"),
        ("utf-32", "application/json"),
        ("utf-16-le", "application/x-www-form-urlencoded; charset=UTF-16LE"),
    ],
)
def test_a_body_in_utf16_or_utf32_is_redacted_in_its_encoding(
    codec: str, content_type: str
) -> None:
    """ASCII-incompatible encodings hide no field: the secret is redacted, the rest is
    logged in the body's own encoding (so replay sends it as it came)."""
    if "urlencoded" in content_type:
        text = f"user=alice&password={SECRET}"
    else:
        text = json.dumps({"user": "alice", "password": SECRET})
    record = record_of(method="POST", data=text.encode(codec), content_type=content_type)
    logged = logged_bytes(record)
    assert SECRET.encode(codec)[2:] not in logged and SECRET.encode() not in logged
    decoded = logged.decode(codec)
    assert SECRET not in decoded and "alice" in decoded and REDACTED in decoded
    assert "body_omitted" not in record


def test_a_utf16_body_cut_inside_a_character_is_redacted() -> None:
    """The cap may cut a UTF-16 body at an odd byte, inside the secret: what is logged of
    it is still redacted."""
    body = json.dumps({"user": "alice", "password": SECRET}).encode("utf-16-le")
    cut_at = body.index(SECRET.encode("utf-16-le")) + 7
    record = json_posted(body, body_bytes=cut_at)
    assert record["body_truncated"] is True
    logged = logged_bytes(record)
    assert SECRET[:3].encode("utf-16-le") not in logged
    assert REDACTED in logged[: len(logged) // 2 * 2].decode("utf-16-le")


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_a_compressed_body_is_left_out(encoding: str) -> None:
    """A body sent with a Content-Encoding cannot be searched for fields: it is not
    logged at all (and replay skips the record)."""
    body = gzip.compress(json.dumps({"password": SECRET}).encode())
    record = record_of(
        method="POST",
        data=body,
        content_type="application/json",
        headers={"Content-Encoding": encoding},
    )
    assert "body" not in record and "body_b64" not in record
    assert encoding in record["body_omitted"] and record["body_truncated"] is True


def test_a_body_that_does_not_decode_in_its_charset_is_left_out() -> None:
    """Declared UTF-16 but cut to nonsense (a lone surrogate): left out, not logged raw."""
    record = record_of(
        method="POST", data=b"\x00\xd8\x41\x00", content_type="application/json; charset=utf-16-le"
    )
    assert "body" not in record and "body_b64" not in record
    assert "cannot be looked at" in record["body_omitted"]


def secrets_seen_by_werkzeug(body: bytes, content_type: str) -> list[str]:
    """The values Flask's request.form / request.files hold under secret names."""
    request = Request.from_values(data=body, content_type=content_type, method="POST")
    try:
        seen = [value for name, value in request.form.items(multi=True) if is_secret(name)]
        for name, upload in request.files.items(multi=True):
            if is_secret(name):
                seen.append(upload.read().decode("latin-1"))
    finally:
        request.close()
    return seen


def is_secret(name: str | None) -> bool:
    return name is not None and name.strip().lower() in SECRET_FIELDS


def readings(data: bytes) -> list[str]:
    """``data`` read in every encoding a reader of the log might try."""
    found = []
    for codec in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be", "latin-1"):
        with contextlib.suppress(UnicodeDecodeError):
            found.append(data.decode(codec))
    return found


@pytest.mark.parametrize(
    ("codec", "content_type"),
    [
        ("utf-32-le", "application/json"),  # no byte order mark: RFC 4627's NUL pattern
        ("utf-32-be", "application/json"),
        ("utf-32-le", "application/json; charset=utf32"),
        ("utf-32-le", "application/json; charset=UTF-32LE"),
        ("utf-32-be", 'application/json; charset="utf_32_be"'),
        ("utf-32-le", "application/x-www-form-urlencoded"),
    ],
)
def test_a_utf32_body_without_a_byte_order_mark_is_redacted(codec: str, content_type: str) -> None:
    """A UTF-32 body that json.loads (Flask's get_json, Django's json.loads(request.body))
    reads by its NUL bytes is not mistaken for UTF-16: its secret never reaches the log."""
    if "json" in content_type:
        text = json.dumps({"user": "alice", "password": SECRET})
    else:
        text = f"user=alice&password={SECRET}"
    record = record_of(method="POST", data=text.encode(codec), content_type=content_type)
    logged = logged_bytes(record)
    assert not any(SECRET in reading for reading in readings(logged))
    decoded = logged.decode(codec)
    assert "alice" in decoded and REDACTED in decoded
    if "json" in content_type:
        assert json.loads(logged) == {"user": "alice", "password": REDACTED}


def test_a_json_body_not_in_the_charset_it_declares_is_left_out() -> None:
    """UTF-32BE bytes labelled UTF-32LE: no reading is sure, so nothing of it is logged."""
    body = json.dumps({"password": SECRET}).encode("utf-32-be")
    record = record_of(method="POST", data=body, content_type="application/json; charset=UTF-32LE")
    assert "body" not in record and "body_b64" not in record
    assert record["body_truncated"] is True and "utf-32-le" in record["body_omitted"]


def test_a_form_whose_charset_werkzeug_ignores_is_redacted_as_it_reads_it() -> None:
    """ASCII form bytes labelled UTF-16: Django would read nonsense, werkzeug (which reads
    forms as UTF-8) reads the password. It is redacted as werkzeug reads it."""
    body = f"user=bob&password={SECRET}x".encode()
    assert len(body) % 2 == 0  # so that it is valid UTF-16 too
    content_type = "application/x-www-form-urlencoded; charset=utf-16-le"
    assert secrets_seen_by_werkzeug(body, content_type)
    record = record_of(method="POST", data=body, content_type=content_type)
    assert record["body"] == "user=bob&password=[redacted]"


@pytest.mark.parametrize("content_type", ["application/json", "text/plain"])
@pytest.mark.parametrize(
    "name", ["pass\\u0077ord", "\\u0070assword", "TOK\\u0045N", "api\\u005fkey", "secr\\u0065t"]
)
def test_a_secret_name_written_with_escapes_is_redacted(content_type: str, name: str) -> None:
    """``{"pass\u0077ord": ...}`` is ``password`` to JSON: redacted in a body cut by the cap
    (which does not parse) and in one labelled text/plain."""
    payload = f'{{"{name}": "{SECRET}", "user": "alice", "pad": "' + "x" * 3000 + '"}'
    assert any(is_secret(key) for key in json.loads(payload))
    cut = json_posted(payload, body_bytes=2048)
    assert cut["body_truncated"] is True
    assert SECRET not in cut["body"] and '"user": "alice"' in cut["body"]
    whole = record_of(method="POST", data=payload, content_type=content_type)
    assert SECRET not in whole["body"] and '"user": "alice"' in whole["body"]


def test_redacting_json_keeps_every_other_byte_as_sent() -> None:
    """Escapes, raw UTF-8, spacing and order survive: only the secret value changes, and
    the logged body is the JSON document that was sent, in UTF-8, bar the secret."""
    payload = '{"name": "caf\\u00e9 \\u2028", "token": "t",  "city":"Zürich 😀", "n": 1.50}'
    record = record_of(method="POST", data=payload.encode(), content_type="application/json")
    assert record["body"] == payload.replace('"token": "t"', '"token": "[redacted]"')
    assert json.loads(record["body"])["name"] == "caf\u00e9 \u2028"


@pytest.mark.parametrize("codec", ["utf-16", "utf-16-be", "utf-32-le"])
def test_redacting_wide_json_keeps_its_encoding_and_escapes(codec: str) -> None:
    """A UTF-16/32 JSON body is logged in its own encoding (its byte order mark too), with
    only the secret value replaced."""
    payload = '{"name": "caf\\u00e9", "token": "t", "city": "Zürich"}'
    body = payload.encode(codec)
    record = record_of(method="POST", data=body, content_type="application/json")
    expected = payload.replace('"t"', '"[redacted]"').encode(codec)
    assert logged_bytes(record) == expected


BOUNDARY = "XyZ"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def multipart(*parts: tuple[str, str]) -> bytes:
    """A multipart body of (Content-Disposition parameters, value) parts."""
    body = "".join(
        f"--{BOUNDARY}\r\nContent-Disposition: form-data; {params}\r\n\r\n{value}\r\n"
        for params, value in parts
    )
    return f"{body}--{BOUNDARY}--\r\n".encode()


PEM = (
    "-----BEGIN CERTIFICATE-----\r\nMIIB\r\n-----END CERTIFICATE-----\r\n"
    f"-----BEGIN PRIVATE KEY-----\r\n{SECRET}\r\n-----END PRIVATE KEY-----"
)


@pytest.mark.parametrize(
    "part",
    [
        pytest.param(('name="password"', f"hunter\r\n--x {SECRET}"), id="dash-line"),
        pytest.param(('name="secret"; filename="k.pem"', PEM), id="pem-bundle"),
        pytest.param(('name="password"', f"a\r\n--{BOUNDARY}x\r\n{SECRET}"), id="longer-marker"),
        pytest.param(("name*=utf-8''password", SECRET), id="rfc2231"),
        pytest.param(("name*=utf-8''pass%77ord", SECRET), id="rfc2231-escaped"),
        pytest.param(('name*0="pass"; name*1="word"', SECRET), id="rfc2231-continued"),
        pytest.param(('name="token"; filename="name=x"', SECRET), id="name-in-filename"),
        pytest.param(('filename="a"; name="token"', SECRET), id="filename-first"),
        pytest.param(('name = "password"', SECRET), id="spaces-around-equals"),
        pytest.param(('filename="a.txt"', SECRET), id="no-name"),
    ],
)
def test_a_secret_multipart_value_is_redacted_to_its_real_boundary(
    part: tuple[str, str],
) -> None:
    """What werkzeug reads as a secret field, or a part whose name cannot be told, is
    redacted up to the boundary the Content-Type names, never up to some other line
    starting with ``--``; the part after it is kept."""
    body = multipart(part, ('name="user"', "alice"))
    record = record_of(method="POST", data=body, content_type=MULTIPART)
    assert SECRET not in record["body"] and "hunter" not in record["body"]
    assert f'name="user"\r\n\r\nalice\r\n--{BOUNDARY}--' in record["body"]
    for seen in secrets_seen_by_werkzeug(body, MULTIPART):
        assert seen not in record["body"]


def test_a_part_django_would_start_inside_a_line_is_redacted() -> None:
    """Django ends a part at the boundary even inside a line and reads the headers after
    it: a secret part hidden that way is redacted too."""
    body = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="note"\r\n\r\n'
        f'hi --{BOUNDARY}\r\nContent-Disposition: form-data; name="password"\r\n\r\n'
        f"{SECRET}\r\n--{BOUNDARY}--\r\n"
    ).encode()
    record = record_of(method="POST", data=body, content_type=MULTIPART)
    assert SECRET not in record["body"]


def test_a_multipart_body_without_a_boundary_is_redacted_to_its_end() -> None:
    """With no boundary to tell where the secret part ends, all after it is redacted."""
    body = multipart(('name="password"', SECRET), ('name="user"', "alice"))
    for content_type in ("multipart/form-data", "text/plain"):
        record = record_of(method="POST", data=body, content_type=content_type)
        assert SECRET not in record["body"]
        assert record["body"].endswith('name="password"\r\n\r\n[redacted]')


@pytest.mark.parametrize("content_type", ["application/json", MULTIPART, "text/plain", ""])
def test_hostile_bodies_never_break_the_record(content_type: str) -> None:
    """Bytes of any kind under any type give a record: logged, or left out saying why."""
    for body in (b"\x00" * 7, b"\xff\xfe\x00", b'{"a": [' * 3000, b"--XyZ" * 500, b"\x00{\x00"):
        record = record_of(method="POST", data=body, content_type=content_type)
        assert "body" in record or "body_b64" in record or record["body_omitted"]


def test_referer_query_is_redacted() -> None:
    """A token in the Referer's query string is redacted as in the request's own query."""
    record = record_of(headers={"Referer": f"https://shop/reset?token={SECRET}&step=2"})
    assert record["headers"]["Referer"] == "https://shop/reset?token=[redacted]&step=2"


def test_refused_login_through_the_middleware_logs_no_password(rejected_lines: Lines) -> None:
    """The example site's attack: refused logins log the user but never the password."""
    app = GateKeeperMiddleware(
        ok_app,
        {"project": "site", "limits": {"site/login/*": {"rate": "1/minute", "key": "ip"}}},
    )
    client = Client(app)
    for attempt in range(3):
        client.post(
            "/login",
            data={"user": "alice", "password": f"{SECRET}-{attempt}"},
            headers={"X-Api-Key": "k-" + SECRET, "X-Auth-Token": "t-" + SECRET},
            query_string={"api_key": "q-" + SECRET},
        )
    assert flush()
    assert len(rejected_lines.lines) == 2
    for line in rejected_lines.lines:
        assert SECRET not in line
        record = json.loads(line)
        assert "user=alice" in record["body"]
        assert record["query"] == "api_key=[redacted]"


def test_redact_fields_is_validated() -> None:
    """`redact_fields` must be a list of names; anything else is a ConfigError naming it."""
    assert build_config(
        {"rejected_log": {"redact_fields": "pin, otp"}}
    ).rejected_log.redact_fields == (
        "pin",
        "otp",
    )
    with pytest.raises(ConfigError, match=r"rejected_log\.redact_fields"):
        build_config({"rejected_log": {"redact_fields": [{"not": "a name"}]}})
    with pytest.raises(ConfigError, match=r"rejected_log\.redact_fields"):
        build_config({"rejected_log": {"redact_fields": ["x" * 129]}})


# --- backend URLs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://app:hunter2@cache/0?password=hunter3", "redis://app:***@cache/0?password=***"),
        ("rediss://cache/0?password=hunter3&db=1", "rediss://cache/0?password=***&db=1"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("shared:///run/gk.shm", "shared:///run/gk.shm"),
        ("memory", "memory"),
        ("redis://:hunter2@cache:notaport/0", "redis://…"),
    ],
)
def test_mask_url(url: str, shown: str) -> None:
    """Passwords in the user info and in secret query fields are masked; nothing else changes."""
    assert mask_url(url) == shown


def test_mask_text_masks_urls_inside_messages() -> None:
    """A library's message quoting a URL with a password is masked before it is logged."""
    text = mask_text("cannot connect to redis://u:hunter2@h:1/0 (password=hunter3)")
    assert "hunter2" not in text and "hunter3" not in text


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_backend_error_log_line_masks_the_redis_password(event_lines: Lines) -> None:
    """The ERROR for an unreachable Redis (a real refused connection) shows no password."""
    pytest.importorskip("redis")
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0?password=hunter3"
    gk = GateKeeper({"backend": url, "limits": {"default": {"concurrency": 1}}})
    try:
        gk.admit("default", "svc", "crm").release()
    finally:
        gk.close()
    errors = [line for line in event_lines.lines if "failed" in line]
    assert errors, event_lines.lines
    assert all("hunter" not in line for line in event_lines.lines)
    assert any("redis://:***@127.0.0.1" in line for line in errors)


def test_status_json_masks_the_backend_url() -> None:
    """The status JSON shows the configured backend URL with its passwords masked."""
    url = "redis://:hunter2@cache:6379/0?password=hunter3"
    gk = GateKeeper({"backend": url}, backend=MemoryBackend())
    try:
        response = Client(StatusApp(gk, token="t")).get(
            "/status.json", headers={"Authorization": "Bearer t"}
        )
    finally:
        gk.close()
    assert response.status_code == 200
    assert "hunter" not in response.get_data(as_text=True)
    assert response.json is not None
    assert response.json["config"]["backend"] == "redis://:***@cache:6379/0?password=***"


def test_cli_check_masks_the_backend_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gatekeeper check` prints the backend URL masked, for a valid and an invalid file."""
    good = tmp_path / "good.toml"
    good.write_text('backend = "redis://:hunter2@cache/0?password=hunter3"\n', encoding="utf-8")
    assert main(["check", str(good)]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('backend = "redis://:hunter2@cache/0?cluster=maybe"\n', encoding="utf-8")
    main(["check", str(bad)])
    captured = capsys.readouterr()
    assert "hunter" not in captured.out + captured.err
    assert "redis://:***@cache/0" in captured.out


def test_cli_status_masks_the_backend_url(capsys: pytest.CaptureFixture[str]) -> None:
    """`gatekeeper status` against an unreachable Redis reports it without the password."""
    pytest.importorskip("redis")
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0?password=hunter3"
    main(["status", "--json", "--backend", url])
    captured = capsys.readouterr()
    assert "hunter" not in captured.out + captured.err
    assert json.loads(captured.out)["backend"].startswith("redis://:***@127.0.0.1:")


def test_replay_says_what_a_redacted_body_means(tmp_path: Path) -> None:
    """A dry-run replay of a record with redacted fields says they go out as [redacted]."""
    log = tmp_path / "rejected.jsonl"
    record = record_of(
        method="POST",
        data=f"user=alice&password={SECRET}",
        content_type="application/x-www-form-urlencoded",
    )
    log.write_text(json.dumps(record) + "\n", encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, "http://127.0.0.1:9", dry_run=True, out=out) == 0
    assert "redacted in the log" in out.getvalue()
    for codec in ("utf-16", "utf-32"):  # logged as body_b64: the note is there too
        record = record_of(
            method="POST",
            data=f'{{"user": "alice", "password": "{SECRET}"}}'.encode(codec),
            content_type=f"application/json; charset={codec}",
        )
        assert "body_b64" in record
        log.write_text(json.dumps(record) + "\n", encoding="utf-8")
        out = io.StringIO()
        assert run_replay(log, "http://127.0.0.1:9", dry_run=True, out=out) == 0
        assert "redacted in the log" in out.getvalue(), codec
    help_text = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(help_text):
        main(["replay", "--help"])
    assert "[redacted]" in help_text.getvalue()


ENVELOPE = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    '<soap:Envelope xmlns:soap="http://schemas.xmlsoap.org/soap/envelope/">'
    "<soap:Header><wsse:Security><wsse:UsernameToken><wsse:Username>alice</wsse:Username>"
    f'<wsse:Password Type="#PasswordText">{SECRET}-1</wsse:Password>'
    "</wsse:UsernameToken></wsse:Security></soap:Header>"
    f"<soap:Body><login password='{SECRET}-2' user=\"alice\">"
    f"<token><![CDATA[{SECRET}-3]]></token><Token/><api_key>{SECRET}-4</api_key>"
    "</login></soap:Body></soap:Envelope>"
)


@pytest.mark.parametrize(
    "content_type", ["text/xml; charset=utf-8", "application/soap+xml", "text/plain"]
)
def test_xml_elements_and_attributes_are_redacted(content_type: str) -> None:
    """A SOAP envelope's secret elements (a WS-Security password) and attributes are
    redacted by local name, prefix or not, everything else kept as sent; also when the
    body is mislabelled."""
    record = record_of(method="POST", data=ENVELOPE, content_type=content_type)
    body = record["body"]
    assert SECRET not in body
    assert body.count(REDACTED) == 4
    assert "<wsse:Username>alice</wsse:Username>" in body
    assert f'<wsse:Password Type="#PasswordText">{REDACTED}</wsse:Password>' in body
    assert f"password='{REDACTED}' user=\"alice\"" in body and "<Token/>" in body


@pytest.mark.parametrize("cut", ["<password>", "<login password='", '<login password="'])
def test_an_xml_secret_cut_by_the_cap_is_redacted_to_the_end(cut: str) -> None:
    """A body the cap cuts inside a secret element or attribute value: what is left of
    the secret is redacted too."""
    text = f"<a>{cut}{SECRET}-and-more"
    config = {"rejected_log": {"body_bytes": len(text) - 4}}
    record = record_of(config, method="POST", data=text, content_type="text/xml")
    assert SECRET not in record["body"] and record["body_truncated"] is True
    assert record["body"].endswith(REDACTED)


def test_hostile_xml_is_redacted_in_linear_time() -> None:
    """Bodies built to make a pattern backtrack (long names, runs of '<', attributes
    without values) come back unchanged, each in one pass (no timing asserted: a
    quadratic pass over 16 KiB would take seconds)."""
    config = {"rejected_log": {"body_bytes": 16384}}
    for hostile in ["<" + "a" * 16000, "<a " + "b " * 8000 + "=", "<" * 16000, "<a =" * 4000]:
        record = record_of(config, method="POST", data=hostile, content_type="text/xml")
        assert record["body"] == hostile


def test_a_refused_soap_request_logs_its_500_and_no_password(rejected_lines: Lines) -> None:
    """Through the middleware, a refused SOAP 1.1 call gets its SOAP fault (HTTP 500), and
    the log says 500 too, with the envelope's secrets redacted."""
    app = GateKeeperMiddleware(ok_app, {"project": "site", "limits": {"site": {"concurrency": 0}}})
    response = Client(app).post(
        "/orders",
        data=ENVELOPE,
        headers={"Content-Type": "text/xml; charset=utf-8", "SOAPAction": '"urn:order"'},
    )
    assert response.status_code == 500
    assert flush()
    [line] = rejected_lines.lines
    assert SECRET not in line
    record = json.loads(line)
    assert (record["status"], record["code"]) == (500, "GK-CONCURRENCY-LIMIT")
    assert "<wsse:Username>alice</wsse:Username>" in record["body"]


@pytest.mark.parametrize("codec", ["bz2", "zlib", "base64", "uu", "quopri", "rot13"])
def test_a_charset_that_is_no_text_encoding_is_not_decoded(codec: str) -> None:
    """A Content-Type charset naming a codec that is not a text encoding (bz2 would
    inflate a 2 KiB body to gigabytes) is read as no reader reads it: not at all. The
    body is looked at as UTF-8 bytes, as werkzeug and Django read an unknown charset."""
    import bz2

    bomb = bz2.compress(b"\0" * 10_000_000)
    record = record_of(
        method="POST",
        data=bomb,
        content_type=f"application/x-www-form-urlencoded; charset={codec}",
    )
    assert len(logged_bytes(record)) <= len(bomb)
    form = record_of(
        method="POST",
        data=f"user=bob&password={SECRET}",
        content_type=f"application/x-www-form-urlencoded; charset={codec}",
    )
    assert form["body"] == f"user=bob&password={REDACTED}"


@pytest.mark.parametrize(
    "hostile",
    ['"' + '\\"' * 8000, '"a' * 8000, '"\\"a' * 5000, '"a":"' * 3000 + '"password":"' + SECRET],
    ids=["escaped-quotes", "quote-letter", "mixed", "members"],
)
def test_hostile_json_bodies_are_redacted_in_one_pass(hostile: str) -> None:
    """Bodies built to make the JSON member search start over at every quote (runs of
    escaped quotes) are read in one pass (no timing asserted: a pass per quote over
    16 KiB took the better part of a second) and still redacted."""
    config = {"rejected_log": {"body_bytes": 16384}}
    record = record_of(config, method="POST", data=hostile, content_type="application/json")
    assert SECRET not in logged_bytes(record).decode("utf-8", "replace")


def test_a_boundary_given_many_times_is_read_as_its_readers_read_it() -> None:
    """Of a boundary parameter repeated hundreds of times, the first and the last are the
    ones the email package and a dict of parameters (werkzeug, Django) take: a part
    delimited by either is redacted, whatever the others say."""
    others = "; ".join(f"boundary=x{n}" for n in range(300))
    body = (
        f'--LAST\r\nContent-Disposition: form-data; name="password"\r\n\r\n{SECRET}\r\n--LAST--\r\n'
    )
    record = record_of(
        method="POST",
        data=body,
        content_type=f"multipart/form-data; boundary=FIRST; {others}; boundary=LAST",
    )
    assert SECRET not in record["body"]


def test_masking_an_error_quoting_a_huge_key_is_linear() -> None:
    """An error message quoting a 1 MB key (``gatekeeper check`` of a file that is one long
    line) is masked in one pass: unchanged, with URLs in it still masked (no timing
    asserted: the quadratic pass it replaced took minutes on a megabyte)."""
    for hostile in ["x" * 1_000_000, "x:" * 500_000, "a://" * 250_000]:
        assert mask_text(hostile) == hostile
    assert mask_text("k" * 100_000 + " redis://:pw@h/0") == "k" * 100_000 + " redis://:***@h/0"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:pw@[::1]:7250/0", "redis://u:***@[::1]:7250/0"),  # brackets kept
        (
            "rediss://:pw@h:1/0?ssl_password=KEY&ssl_cert_reqs=none",
            "rediss://:***@h:1/0?ssl_password=***&ssl_cert_reqs=none",
        ),
    ],
)
def test_a_masked_url_stays_a_url_with_every_secret_masked(url: str, shown: str) -> None:
    """An IPv6 host keeps its brackets (the port stays apart from the address), and a
    rediss:// URL's TLS key passphrase (ssl_password) is masked, in the URL and in a
    message quoting it."""
    assert mask_url(url) == shown
    assert mask_text(f"backend {url} failed") == f"backend {shown} failed"
