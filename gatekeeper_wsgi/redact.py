"""What is a secret, and how it is kept out of logs, status pages and the CLI (SPEC §4.8).

A leaf module (it imports nothing from the package), so the rejected-request log, the
engine's ERROR lines, the status JSON and ``gatekeeper check``/``status`` all use the same
rules::

    mask_url("redis://:hunter2@cache:6379/0?password=hunter3")
    # 'redis://:***@cache:6379/0?password=***'
    redact_query("user=alice&api_key=k1", SECRET_FIELDS)   # 'user=alice&api_key=[redacted]'
    is_secret_header("X-Auth-Token", frozenset())          # True
"""

from __future__ import annotations

import codecs
import json
import re
from typing import Any
from urllib.parse import unquote_plus, urlsplit, urlunsplit

__all__ = [
    "REDACTED",
    "SECRET_FIELDS",
    "SECRET_HEADERS",
    "is_secret_header",
    "mask_text",
    "mask_url",
    "redact_body",
    "redact_query",
]

#: the value written in place of a secret
REDACTED = "[redacted]"
#: header names (lower case) whose values are always secret
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie"})
# A header whose name contains one of these is secret too (X-Auth-Token, X-Api-Key, ...).
_SECRET_HEADER_PARTS = ("token", "secret", "password", "api-key", "apikey", "auth")
#: form / JSON / query field names (lower case) whose values are always secret
SECRET_FIELDS = frozenset(
    {
        "password",
        "passwd",
        "secret",
        "token",
        "api_key",
        "apikey",
        "access_token",
        "refresh_token",
        "csrfmiddlewaretoken",
    }
)
# What replaces a password in a URL: short, and not mistaken for a real one.
_MASK = "***"


def is_secret_header(name: str, extra: frozenset[str]) -> bool:
    """Whether a header's value must not be logged; ``extra`` holds configured names in
    lower case."""
    lower = name.lower()
    return (
        lower in SECRET_HEADERS or lower in extra or any(p in lower for p in _SECRET_HEADER_PARTS)
    )


def redact_query(query: str, fields: frozenset[str], mask: str = REDACTED) -> str:
    """``query`` (``a=1&b=2``, as sent) with the values of secret fields replaced.

    The text is kept as sent otherwise (order, encoding, separators), so a replay sends
    the same request apart from the secrets.
    """
    if "=" not in query:
        return query
    parts = re.split(r"([&;])", query)
    for index in range(0, len(parts), 2):
        name, sep, _ = parts[index].partition("=")
        if sep and unquote_plus(name).strip().lower() in fields:
            parts[index] = f"{name}={mask}"
    return "".join(parts)


def mask_url(url: str) -> str:
    """A URL fit to print: the password in its user info and the values of secret query
    fields replaced by ``***`` (``redis://:***@host/0?password=***``)."""
    try:
        parts = urlsplit(url)
        password = parts.password
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        # Not parseable as a URL (a bad port, a stray bracket): show only its scheme.
        return url.split("://", 1)[0] + "://…" if "://" in url else mask_text(url)
    netloc = parts.netloc
    if password is not None or (parts.username is not None and "@" in netloc):
        user = parts.username or ""
        if port is not None:
            host = f"{host}:{port}"
        netloc = f"{user}:{_MASK}@{host}" if password is not None else f"{user}@{host}"
    query = redact_query(parts.query, SECRET_FIELDS, _MASK)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# user:password@ in any URL inside a text, and password=... query or key=value pairs.
_URL_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)[^\s@/]*@")
_TEXT_FIELDS = re.compile(
    r"(?P<head>\b(?:" + "|".join(sorted(SECRET_FIELDS, key=len, reverse=True)) + r")=)[^&\s'\"]*",
    re.IGNORECASE,
)


def mask_text(text: str) -> str:
    """Free text (an exception message) with URL passwords and ``password=…`` values
    masked, for log lines that quote what a library said."""
    text = _URL_CREDENTIALS.sub(lambda m: m.group("head") + _MASK + "@", text)
    return _TEXT_FIELDS.sub(lambda m: m.group("head") + _MASK, text)


# --- request bodies --------------------------------------------------------------------------

# A JSON member whose name is a secret field, in text that may be cut short (a logged
# body is capped) and so not parse: the value is a string, possibly unterminated, or a
# bare token.
_JSON_MEMBER = re.compile(
    r'(?P<head>"(?P<name>(?:[^"\\]|\\.)*)"\s*:\s*)'
    r'(?P<value>"(?:[^"\\]|\\.)*"?|[^,{}\[\]\s]*)'
)
# multipart/form-data: the part's name, then its value up to the next boundary line.
_MULTIPART_PART = re.compile(
    r'(?P<head>content-disposition:[^\r\n]*\bname="?(?P<name>[^";\r\n]*)"?[^\r\n]*\r?\n'
    r"(?:[^\r\n]+\r?\n)*\r?\n)(?P<value>.*?)(?=\r?\n--|\Z)",
    re.IGNORECASE | re.DOTALL,
)


def _redact_json_value(value: Any, fields: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {
            key: REDACTED if key.lower() in fields else _redact_json_value(item, fields)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_redact_json_value(item, fields) for item in value]
    return value


def _redact_json_members(text: str, fields: frozenset[str]) -> str:
    """Text that may be cut-short JSON, redacted member by member. A secret member whose
    value is an object or array is redacted up to the end of the text: what it holds
    cannot be told apart from what follows without parsing."""
    out: list[str] = []
    position = 0
    for match in _JSON_MEMBER.finditer(text):
        if match.group("name").lower() not in fields:
            continue
        out.append(text[position : match.start("value")])
        out.append(json.dumps(REDACTED))
        position = match.end("value")
        if not match.group("value") and text[position : position + 1] in ("{", "["):
            position = len(text)
            break
    out.append(text[position:])
    return "".join(out)


def _redact_json_text(text: str, fields: frozenset[str]) -> str:
    try:
        document = json.loads(text)
        redacted = _redact_json_value(document, fields)
        if redacted == document:
            return text  # nothing secret: the body is logged exactly as sent
        return json.dumps(redacted, ensure_ascii=False)
    except (ValueError, RecursionError):
        # Cut short by the body cap, or not JSON after all.
        return _redact_json_members(text, fields)


def _redact_multipart(text: str, fields: frozenset[str]) -> str:
    def part(match: re.Match[str]) -> str:
        if match.group("name").strip().lower() in fields:
            return match.group("head") + REDACTED
        return match.group(0)

    return _MULTIPART_PART.sub(part, text)


_CHARSET = re.compile(r";\s*charset\s*=\s*\"?([A-Za-z0-9._-]+)", re.IGNORECASE)
_WIDE_BOMS = (
    ("utf-32", (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)),
    ("utf-16", (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)),
)


def _wide_codec(body: bytes, content_type: str) -> tuple[str, bool] | None:
    """The codec of a body in an encoding in which ASCII is not ASCII bytes (UTF-16,
    UTF-32), which the field rules would not see through, and whether the body says so
    itself (its charset or byte order mark) rather than its NUL bytes suggesting it
    (ASCII text in UTF-16 has one in every other byte). None for any other body."""
    charset = _CHARSET.search(content_type)
    if charset is not None and charset.group(1).lower().startswith(("utf-16", "utf-32")):
        return charset.group(1).lower(), True
    for codec, marks in _WIDE_BOMS:
        if body.startswith(marks):
            return codec, True
    if b"\x00" in body[:64]:
        return ("utf-16-le" if body[1:2] == b"\x00" else "utf-16-be"), False
    return None


def _redact_text(text: str, mimetype: str, fields: frozenset[str]) -> str:
    if mimetype == "application/x-www-form-urlencoded":
        return redact_query(text, fields)
    if mimetype.startswith("multipart/"):
        return _redact_multipart(text, fields)
    if "json" in mimetype:
        return _redact_json_text(text, fields)
    return _redact_multipart(_redact_json_members(redact_query(text, fields), fields), fields)


def redact_body(body: bytes, content_type: str, fields: frozenset[str]) -> bytes | None:
    """The logged part of a request body with the values of secret fields replaced:
    urlencoded forms, JSON (also when cut short), multipart forms; a body of another type
    is searched with the form and JSON rules both, since a client may label it wrongly.
    A body in UTF-16 or UTF-32 is redacted as text and written back in its encoding; None
    when it says it is one but does not decode as such (its fields cannot be found: it
    must not be logged)."""
    if not body:
        return body
    mimetype = content_type.partition(";")[0].strip().lower()
    wide = _wide_codec(body, content_type)
    if wide is not None:
        codec, declared = wide
        try:
            # A body cut at the cap may end inside a character: that part stays as it is.
            decoder = codecs.getincrementaldecoder(codec)()
            text = decoder.decode(body)
            tail: bytes = decoder.getstate()[0]
        except (UnicodeError, LookupError):
            if declared:
                return None
        else:
            redacted = _redact_text(text, mimetype, fields)
            # Nothing secret: the bytes exactly as sent (a binary body with NUL bytes
            # that merely decodes is not rewritten).
            return body if redacted == text else redacted.encode(codec) + tail
    # latin-1 maps bytes to characters one to one, so the bytes that are not redacted
    # come back exactly, whatever their (ASCII-compatible) encoding.
    return _redact_text(body.decode("latin-1"), mimetype, fields).encode("latin-1", "replace")
