"""What is a secret, and how it is kept out of logs, status pages and the CLI (SPEC §4.8);
and how a failure of the user's code reaches the log: without its message, once a while.

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
import math
import re
import time
import traceback
from collections.abc import Callable
from email.message import Message
from email.utils import collapse_rfc2231_value
from typing import NamedTuple
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

from werkzeug.http import parse_options_header

__all__ = [
    "REDACTED",
    "SECRET_FIELDS",
    "SECRET_HEADERS",
    "BodyUnreadable",
    "Throttle",
    "failure_without_message",
    "is_secret_header",
    "mask_text",
    "mask_url",
    "redact_body",
    "redact_query",
    "split_query",
]

#: the value written in place of a secret
REDACTED = "[redacted]"
#: header names (lower case) whose values are always secret
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie"})
# A header whose name contains one of these is secret too (X-Auth-Token, X-Api-Key, ...).
_SECRET_HEADER_PARTS = ("token", "secret", "password", "api-key", "apikey", "auth")
#: form / JSON / XML / query field names (lower case) whose values are always secret
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


def split_query(query: str) -> list[str]:
    """A query string as sent, split into parameter, separator, parameter, ...: at '&' and
    ';' (the separators of application/x-www-form-urlencoded and of older parsers), so a
    parameter after either is found, and ``"".join`` gives the text back byte for byte."""
    return _QUERY_SEPARATORS.split(query)


_QUERY_SEPARATORS = re.compile(r"([&;])")


def redact_query(query: str, fields: frozenset[str], mask: str = REDACTED) -> str:
    """``query`` (``a=1&b=2``, as sent) with the values of secret fields replaced.

    The text is kept as sent otherwise (order, encoding, separators), so a replay sends
    the same request apart from the secrets.
    """
    if "=" not in query:
        return query
    parts = split_query(query)
    for index in range(0, len(parts), 2):
        name, sep, _ = parts[index].partition("=")
        if sep and _is_secret_name(unquote_plus(name), fields):
            parts[index] = f"{name}={mask}"
    return "".join(parts)


#: query fields of a URL whose values are secrets: the request fields, and the TLS key's
#: passphrase of a ``rediss://`` URL (redis-py's ``ssl_password``)
_URL_SECRET_FIELDS = SECRET_FIELDS | {"ssl_password"}


def mask_url(url: str) -> str:
    """A URL fit to print: the password in its user info and the values of secret query
    fields replaced by ``***`` (``redis://:***@host/0?password=***``)."""
    try:
        parts = urlsplit(url)
        password = parts.password
        parts.port  # noqa: B018 - raises ValueError for a port that is no number
    except ValueError:
        # Not parseable as a URL (a bad port, a stray bracket): show only its scheme.
        return url.split("://", 1)[0] + "://…" if "://" in url else mask_text(url)
    netloc = parts.netloc
    if password is not None or (parts.username is not None and "@" in netloc):
        user = parts.username or ""
        # host and port as written: an IPv6 address keeps its brackets
        host = netloc.rpartition("@")[2]
        netloc = f"{user}:{_MASK}@{host}" if password is not None else f"{user}@{host}"
    query = redact_query(parts.query, _URL_SECRET_FIELDS, _MASK)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# user:password@ in any URL inside a text, and password=... query or key=value pairs.
# A scheme begins where no scheme character precedes it: tried at every character of a
# long run of letters (an error message quoting a 1 MB key), each start would scan the
# rest of the run for "://" - quadratic.
_URL_CREDENTIALS = re.compile(
    r"(?P<head>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)[^\s@/]*@"
)
_TEXT_FIELDS = re.compile(
    # not \b: "ssl_password=" holds "password=" after an underscore, a word character
    r"(?P<head>(?<![A-Za-z0-9])(?:"
    + "|".join(sorted(SECRET_FIELDS, key=len, reverse=True))
    + r")=)[^&\s'\"]*",
    re.IGNORECASE,
)


def mask_text(text: str) -> str:
    """Free text (an exception message) with URL passwords and ``password=…`` values
    masked, for log lines that quote what a library said."""
    text = _URL_CREDENTIALS.sub(lambda m: m.group("head") + _MASK + "@", text)
    return _TEXT_FIELDS.sub(lambda m: m.group("head") + _MASK, text)


def failure_without_message(exc: BaseException) -> str:
    """What a log may say of an exception that the user's code (a resolver, a renderer,
    a hook) raised while it held a request: its type and where it was raised, without
    its message, which may quote the request's secrets (``KeyError: 'k-live-…'`` of a
    resolver that looks an API key up)."""
    frames = "".join(traceback.format_tb(exc.__traceback__)).rstrip()
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    return f"{name} (message not logged: it may quote the request)\n{frames}".rstrip()


class Throttle:
    """How often a repeating failure is logged: code of the user's (a resolver, a renderer)
    that fails on some input fails on every such request, during overload at that, and
    an ERROR line per request would flood the log and slow every answer. :meth:`due`
    counts each failure and says when one may be logged: at most once per ``interval``
    seconds of ``clock``, with the failures since the last one. Races between threads can
    only miscount, never log more often than one line per thread."""

    __slots__ = ("_clock", "_failures", "_logged", "interval")

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._logged = -math.inf
        self._failures = 0

    def due(self) -> int:
        """Count a failure: the failures to report in an ERROR now (this one included), or
        0 when the last ERROR is too recent (the next one reports this one too)."""
        self._failures += 1
        now = self._clock()
        if now - self._logged < self.interval:
            return 0
        failures, self._failures, self._logged = self._failures, 0, now
        return failures


# --- request bodies --------------------------------------------------------------------------


class BodyUnreadable(ValueError):
    """A request body whose secret fields cannot be found with confidence: it must not be
    logged. The message says why."""


# A JSON member whose name is a secret field, in text that may be cut short (a logged
# body is capped) and so not parse: the value is a string, possibly unterminated, or a
# bare token. Linear in the text: a name begins at a quote no backslash escapes (so a run
# of \" is not thousands of starts, each scanning to the end), and a part that gives back
# what it took fails at each step at once (its alternatives cannot overlap, and what
# follows a name is a quote, which neither takes). Plain quantifiers, not possessive
# ones: Python's re reads those from 3.11 on, and the package supports 3.10.
_JSON_MEMBER = re.compile(
    r'(?P<head>(?<!\\)"(?P<name>(?:[^"\\]|\\.)*)"\s*:\s*)'
    r'(?P<value>"(?:[^"\\]|\\.)*"?|[^,{}\[\]\s]*)'
)
_JSON = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _skip_space(text: str, position: int) -> int:
    """Where the JSON whitespace at ``position`` ends."""
    match = _JSON_SPACE.match(text, position)
    return match.end() if match else position


# Where a field name nests others: "password[]", "user[password]" (PHP, Rails and
# werkzeug's MultiDict readers of such forms), "user.password".
_NAME_PARTS = re.compile(r"[\[\].]")


def _is_secret_name(name: str, fields: frozenset[str]) -> bool:
    lower = name.strip().lower()
    if lower in fields:
        return True
    return _NAME_PARTS.search(lower) is not None and any(
        part.strip() in fields for part in _NAME_PARTS.split(lower)
    )


def _json_name(raw: str) -> str:
    """A member name as JSON reads it (``pass\\u0077ord`` is ``password``)."""
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        return raw  # not a JSON string: no parser reads it as a name
    return name if isinstance(name, str) else raw


def _splice(text: str, spans: list[tuple[int, int]], replacement: str) -> str:
    """``text`` with each span replaced; spans that overlap or touch are replaced as one."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[str] = []
    position = 0
    for start, end in merged:
        out.append(text[position:start])
        out.append(replacement)
        position = end
    out.append(text[position:])
    return "".join(out)


def _json_secret_spans(text: str, fields: frozenset[str]) -> list[tuple[int, int]]:
    """Where the values of secret members are in a complete JSON text, at any depth;
    ValueError if the text is not one JSON value. A walk over the text (no recursion, so
    deep nesting costs no stack) that leaves everything else as written."""
    spans: list[tuple[int, int]] = []
    # For each open object or array: its closing character, and where the secret
    # member's value it is began (-1 when it is not one).
    stack: list[tuple[str, int]] = []
    position = _skip_space(text, 0)
    secret_at = -1

    def member(position: int) -> tuple[int, int]:
        """A member's name and colon at ``position``: where its value starts, and that
        again if the member is secret (else -1)."""
        if text[position : position + 1] != '"':
            raise ValueError(f"expected a member name at {position}")
        name, position = _JSON.raw_decode(text, position)
        position = _skip_space(text, position)
        if text[position : position + 1] != ":":
            raise ValueError(f"expected ':' at {position}")
        position = _skip_space(text, position + 1)
        return position, (position if _is_secret_name(name, fields) else -1)

    while True:
        opener = text[position : position + 1]
        if opener in ("{", "["):
            closer = "}" if opener == "{" else "]"
            stack.append((closer, secret_at))
            secret_at = -1
            position = _skip_space(text, position + 1)
            if text[position : position + 1] != closer:
                if opener == "{":
                    position, secret_at = member(position)
                continue  # its first value
        else:
            # A string, number or literal (raw_decode never reaches a container here).
            _, end = _JSON.raw_decode(text, position)
            if secret_at >= 0:
                spans.append((secret_at, end))
                secret_at = -1
            position = end
            position = _skip_space(text, position)
        # After a value: close what ends here, then go on with the next value.
        while True:
            if not stack:
                if position != len(text):
                    raise ValueError(f"extra data at {position}")
                return spans
            closer, began = stack[-1]
            char = text[position : position + 1]
            if char == closer:
                stack.pop()
                position += 1
                if began >= 0:
                    spans.append((began, position))
                position = _skip_space(text, position)
                continue
            if char != ",":
                raise ValueError(f"expected ',' or {closer!r} at {position}")
            position = _skip_space(text, position + 1)
            if closer == "}":
                position, secret_at = member(position)
            break


def _redact_json_members(text: str, fields: frozenset[str]) -> str:
    """Text that may be cut-short JSON, redacted member by member. A name is compared as
    JSON reads it (escapes decoded). A secret member whose value is an object or array is
    redacted up to the end of the text: what it holds cannot be told apart from what
    follows without parsing."""
    spans: list[tuple[int, int]] = []
    for match in _JSON_MEMBER.finditer(text):
        if not _is_secret_name(_json_name(match.group("name")), fields):
            continue
        end = match.end("value")
        if not match.group("value") and text[end : end + 1] in ("{", "["):
            spans.append((match.start("value"), len(text)))
            break
        spans.append((match.start("value"), end))
    return _splice(text, spans, json.dumps(REDACTED))


def _redact_json_text(text: str, fields: frozenset[str]) -> str:
    """A JSON text with the values of its secret members replaced and every other
    character as sent (escapes, spacing and order included), so that replay sends the same
    document apart from the secrets."""
    try:
        spans = _json_secret_spans(text, fields)
    except ValueError:
        # Cut short by the body cap, or not JSON after all.
        return _redact_json_members(text, fields)
    return _splice(text, spans, json.dumps(REDACTED))


# multipart/form-data (RFC 7578). Line breaks as werkzeug accepts them (CRLF, LF or CR);
# a header line continued by one starting with a blank.
_LINE_BREAK = r"(?:\r\n|\n|\r)"
_CONTINUATION = re.compile(_LINE_BREAK + r"[ \t]")
# The blank line that ends a part's headers: werkzeug's three forms (Django's is CRLF CRLF).
_HEADERS_END = re.compile(r"\r\n\r\n|\r\r|\n\n")
# ``name=`` anywhere in a Content-Disposition, also inside another parameter's quoted
# value and in RFC 2231 form (``name*=utf-8''password``, ``name*0=``): every name any
# parser could take for the part's.
_NAME_PARAMETER = re.compile(
    r"(?:^|[;\s\"'])name(?P<star>\*)?(?:\*?\d+\*?)?\s*=\s*"
    r"(?:\"(?P<quoted>(?:[^\"\\]|\\.)*)\"?|(?P<token>[^;\s\"]*))",
    re.IGNORECASE,
)
_DISPOSITION_LINE = re.compile(r"^[ \t]*content-disposition[ \t]*:", re.IGNORECASE | re.MULTILINE)


def _email_parameter(value: str, name: str) -> str | None:
    """A parameter of a header value as the email package reads it (Django's multipart
    parser does), RFC 2231 forms decoded."""
    message = Message()
    message["content-disposition"] = value
    found = message.get_param(name, header="content-disposition")
    if isinstance(found, tuple):
        return collapse_rfc2231_value(found)
    return found


def _part_is_secret(headers: str, fields: frozenset[str]) -> bool:
    """Whether the value of a multipart part with these header lines must be redacted:
    some reading of its Content-Disposition names a secret field (werkzeug's, the email
    package's as Django uses it, or any ``name=`` in it), or its name cannot be told with
    confidence (no Content-Disposition, two of them, no name, or parsers that disagree)."""
    unfolded = _CONTINUATION.sub(" ", headers)
    dispositions = [
        value
        for header, colon, value in (line.partition(":") for line in unfolded.splitlines())
        if colon and header.strip(" \t").lower() == "content-disposition"
    ]
    if len(dispositions) != 1:
        return True
    disposition = dispositions[0].strip(" \t")
    werkzeug_name = parse_options_header(disposition)[1].get("name")
    try:
        email_name = _email_parameter(disposition, "name")
    except Exception:  # the email package on a hostile header: no confident name
        return True
    if werkzeug_name is None or email_name is None:
        return True
    if werkzeug_name.strip() != email_name.strip():
        return True
    names = {werkzeug_name, email_name}
    for match in _NAME_PARAMETER.finditer(disposition):
        value = match.group("quoted") or match.group("token") or ""
        if match.group("star"):
            value = unquote(value.rpartition("'")[2], errors="replace")
        names.add(value)
    return any(_is_secret_name(name, fields) for name in names)


def _line_break_before(text: str, at: int) -> int:
    """How many characters of line break (``\\r\\n``, ``\\n`` or ``\\r``) end at ``at``."""
    if text.startswith("\r\n", at - 2):
        return 2
    return 1 if at > 0 and text[at - 1] in "\r\n" else 0


def _delimiters(text: str, boundary: str) -> list[tuple[int, int, bool]]:
    """werkzeug's delimiter lines of ``boundary`` in ``text``, as (start, end, closing):
    a line break (the first may come without), ``--`` and the boundary, then ``--`` (the
    close delimiter) or blanks and a line break. Found with str.find, not a regular
    expression made of the boundary: the request chose it, and every such pattern would
    stay in the re module's cache (512 of any size)."""
    marker = "--" + boundary
    found: list[tuple[int, int, bool]] = []
    position = 0
    while (at := text.find(marker, position)) >= 0:
        position = at + 1
        before = _line_break_before(text, at)
        if not before and found:
            continue  # only the first may come without a line break
        after = at + len(marker)
        if text.startswith("--", after):
            found.append((at - before, after + 2, True))
            position = after + 2
            continue
        blanks = after
        while blanks < len(text) and text[blanks].isspace() and text[blanks] not in "\r\n":
            blanks += 1
        line_break = (
            2 if text.startswith("\r\n", blanks) else int(text[blanks : blanks + 1] in ("\r", "\n"))
        )
        if line_break:
            found.append((at - before, blanks + line_break, False))
            position = blanks + line_break
    return found


def _multipart_spans(text: str, boundary: str, fields: frozenset[str]) -> list[tuple[int, int]]:
    """Where the values of secret parts are in multipart ``text`` with ``boundary``, as
    werkzeug and Django each find the parts; a value cut short by the body cap runs to
    the end of the text.

    werkzeug (Flask) ends a part only at a real delimiter line, so a value may hold other
    lines starting with ``--`` (a PEM bundle's, say). Django ends one at any ``--`` and
    the boundary, even inside a line, and reads the headers after it. The value of a part
    is redacted when either finds it secret."""
    spans: list[tuple[int, int]] = []
    delimiters = _delimiters(text, boundary)
    for index, (_, end, closing) in enumerate(delimiters):
        if closing:
            break  # the close delimiter: what follows is the epilogue
        part_end = delimiters[index + 1][0] if index + 1 < len(delimiters) else len(text)
        headers_end = _HEADERS_END.search(text, end, part_end)
        if headers_end is None:
            continue  # cut inside its headers: no value in the text
        if _part_is_secret(text[end : headers_end.start()], fields):
            spans.append((headers_end.end(), part_end))
    marker = "--" + boundary
    starts = []
    position = 0
    while (at := text.find(marker, position)) >= 0:
        starts.append(at)
        position = at + len(marker)
    for index, start in enumerate(starts):
        part_start = start + len(marker)
        last = index + 1 == len(starts)
        part_end = len(text) if last else starts[index + 1]
        headers_end_at = text.find("\r\n\r\n", part_start, part_end)
        if headers_end_at < 0 or _DISPOSITION_LINE.search(text, part_start, headers_end_at) is None:
            continue  # no value, or not a field to Django (the close delimiter's "--")
        if _part_is_secret(text[part_start:headers_end_at], fields):
            value_end = part_end
            if not last:  # the line break before the marker is not the value's
                value_end -= text[value_end - 1 : value_end] == "\n"
                value_end -= text[value_end - 1 : value_end] == "\r"
            spans.append((headers_end_at + 4, max(value_end, headers_end_at + 4)))
    return spans


def _redact_multipart(text: str, boundaries: list[str], fields: frozenset[str]) -> str:
    """Multipart text with the values of secret parts replaced. Without a boundary (a
    mislabelled body, a Content-Type without one), where its parts end cannot be told:
    from the first part whose name is secret or uncertain, all is redacted."""
    spans: list[tuple[int, int]] = []
    for boundary in boundaries:
        spans.extend(_multipart_spans(text, boundary, fields))
    if not boundaries:
        for match in _DISPOSITION_LINE.finditer(text):
            headers_end = _HEADERS_END.search(text, match.start())
            if headers_end is None:
                break
            if _part_is_secret(text[match.start() : headers_end.start()], fields):
                spans.append((headers_end.end(), len(text)))
                break
    return _splice(text, spans, REDACTED)


# XML names (letters, digits, "_", "-", "."; non-ASCII letters too), a qualified one with
# its prefix. Matched only where a tag or an attribute can begin (after "<", after a
# blank), and the rest found with str.find: no pattern here backtracks over a run of
# hostile text, so a 16 KiB body costs linear time.
_XML_QNAME = re.compile(r"(?:[^\W\d][\w.\-]*:)?(?P<local>[^\W\d][\w.\-]*)")
_XML_ATTRIBUTE = re.compile(
    r"(?<!\S)(?:[^\W\d][\w.\-]*:)?(?P<local>[^\W\d][\w.\-]*)\s*=\s*"
    # A value cut by the body cap lacks its closing quote; one unquoted is not XML, but a
    # reader may take it all the same: both are values too.
    r"(?:\"(?P<double>[^\"]*)\"?|'(?P<single>[^']*)'?|(?P<bare>[^\s\"'/]+))"
)


def _xml_secret_spans(text: str, fields: frozenset[str]) -> list[tuple[int, int]]:
    """Where the values of secret elements and attributes are in an XML text (a SOAP
    envelope's ``<wsse:Password>``, ``<login password="…">``), matched by local name as
    form and JSON fields are: an element's whole content up to its end tag, or to the end
    of a body the cap cut inside it."""
    spans: list[tuple[int, int]] = []
    position = 0
    while (opening := text.find("<", position)) >= 0:
        position = opening + 1
        name = _XML_QNAME.match(text, position)
        if name is None:
            continue  # an end tag, a comment, a declaration, CDATA: nothing to look at
        closing = text.find(">", name.end())
        if closing < 0:
            closing = len(text)  # cut by the cap inside the tag
        elif "<" in text[name.end() : closing]:
            continue  # not a tag: the next "<" is looked at next
        attributes = text[name.end() : closing]
        if "=" in attributes:
            offset = name.end()
            for attribute in _XML_ATTRIBUTE.finditer(attributes):
                if _is_secret_name(attribute.group("local"), fields):
                    value = next(
                        group
                        for group in ("double", "single", "bare")
                        if attribute.group(group) is not None
                    )
                    spans.append((offset + attribute.start(value), offset + attribute.end(value)))
        position = closing + 1
        if attributes.endswith("/") or not _is_secret_name(name.group("local"), fields):
            continue
        end = text.find(f"</{name.group()}", position)
        spans.append((position, len(text) if end < 0 else end))
        position = len(text) if end < 0 else end
    return [(start, end) for start, end in spans if end > start]


def _redact_xml(text: str, fields: frozenset[str]) -> str:
    return _splice(text, _xml_secret_spans(text, fields), REDACTED) if "<" in text else text


def _redact_text(text: str, mimetype: str, boundaries: list[str], fields: frozenset[str]) -> str:
    """The declared type's rule first (it knows the body's structure), then the rules of
    the other types, whatever the label says: an app may read a body as another type than
    its label (``json.loads(request.body)`` on a form post, curl's ``-d`` default; Flask's
    ``get_json(force=True)``). A rule finds nothing in a body of another shape; where one
    does (a form-like text inside a JSON string), more is redacted, never less."""
    multipart = mimetype.startswith("multipart/")
    json_ = "json" in mimetype
    xml = "xml" in mimetype
    if multipart:
        text = _redact_multipart(text, boundaries, fields)
    elif json_:
        text = _redact_json_text(text, fields)
    elif xml:
        text = _redact_xml(text, fields)
    text = redact_query(text, fields)  # a form's own rule, and a pass over any other body
    if not json_:
        text = _redact_json_members(text, fields)
    if not xml:
        text = _redact_xml(text, fields)
    # Boundaries guessed from the text only where none was declared (a guess would take a
    # line of a declared part's value that starts with "--" for one).
    return text if multipart else _redact_multipart(text, [], fields)


# --- how a body is read as text ------------------------------------------------------------------

# Checked in this order: the UTF-32 LE mark begins with the UTF-16 LE one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
# The codecs json.loads decodes with "surrogatepass" (and so do we, to read what it
# reads), and the byte order Python's own "utf-16"/"utf-32" assume without a mark.
_UNICODE = frozenset({"utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"})
_NATIVE = "le" if "a".encode("utf-16")[-2:] == b"a\x00" else "be"
# Codecs in which ASCII bytes are ASCII characters: a body that fails to decode in one is
# still read through its bytes (as Django reads a form: with errors replaced).
_ASCII_SAFE = ("utf-8", "ascii", "iso8859-", "cp125", "latin-1")


class _Reading(NamedTuple):
    """One way a reader (werkzeug, Django, json.loads) turns a body into text."""

    codec: str
    #: a byte order mark in front, kept as sent
    mark: bytes = b""
    #: a body that must decode so (it says it is in this codec, and an app reads it so):
    #: one that does not is left out rather than logged
    required: bool = False
    #: "surrogatepass" where json.loads reads so (a lone surrogate is a character to it)
    errors: str = "strict"


def _reading(body: bytes, codec: str, required: bool, errors: str = "strict") -> _Reading:
    """How a body is read in ``codec`` (a name codecs.lookup gives): a byte order mark
    of its family decides the byte order and is kept aside."""
    family = codec[:6] if codec.startswith(("utf-16", "utf-32")) else codec
    if family.startswith("utf-8"):
        family = "utf-8"
    for mark, marked in _BOMS:
        if body.startswith(mark):
            if marked.startswith(family):
                return _Reading(marked, mark, required, errors)
            break
    if codec in ("utf-16", "utf-32"):
        codec = f"{codec}-{_NATIVE}"
    elif codec == "utf-8-sig":
        codec = "utf-8"
    return _Reading(codec, b"", required, errors if codec in _UNICODE else "strict")


def _codec(charset: str) -> str | None:
    """The text encoding ``charset`` names; None for an unknown one (werkzeug and Django
    read such a body as UTF-8) and for a codec that is not a text encoding: bz2, zlib,
    base64 ... are looked up by the same names, and one of them would inflate a 2 KiB
    body to gigabytes (str.decode refuses them, as every reader of a body does)."""
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        return None
    try:
        b"\0".decode(name)  # (not b"": that returns "" before the codec is looked at)
    except LookupError:  # "... is not a text encoding"
        return None
    except (UnicodeError, ValueError):  # a text encoding that takes no lone NUL
        pass
    return name


def _content_type(content_type: str) -> tuple[str, list[str], list[str]]:
    """The mimetype, charsets and multipart boundaries of a Content-Type, as werkzeug
    (Flask) and the email package (Django) read it; both, when they differ."""
    mimetype, params = parse_options_header(content_type)
    charsets = [params["charset"]] if params.get("charset") else []
    boundaries = [params["boundary"]] if params.get("boundary") else []
    try:
        message = Message()
        message["content-type"] = content_type
        found: dict[str, list[str]] = {"charset": [], "boundary": []}
        for name, value in message.get_params(failobj=[])[1:]:
            text = collapse_rfc2231_value(value) if isinstance(value, tuple) else value
            if name.lower() in found and text:
                found[name.lower()].append(text)
        # Of a parameter given many times, a reader takes the first (the email package) or
        # the last (a dict of them: werkzeug, Django): only those two are read so.
        for mine, given in ((charsets, found["charset"]), (boundaries, found["boundary"])):
            for text in given[:1] + given[-1:]:
                if text not in mine:
                    mine.append(text)
    except Exception:  # the email package's parser on a hostile header: werkzeug's stands
        pass
    return mimetype.strip().lower(), charsets, boundaries


def _readings(body: bytes, mimetype: str, charsets: list[str]) -> list[_Reading]:
    """Every way an app may read ``body`` as text: in its declared charset (Django), as
    JSON per RFC 4627/8259 (json.loads guesses UTF-8/16/32 from its NUL bytes or byte order
    mark, whatever the charset says), in UTF-16/32 when NUL bytes suggest it, and through
    its bytes as UTF-8 (werkzeug's forms)."""
    readings = []
    for charset in charsets:
        codec = _codec(charset)
        if codec is not None:
            readings.append(_reading(body, codec, not codec.startswith(_ASCII_SAFE)))
    if "json" in mimetype:
        codec = json.detect_encoding(body)
        readings.append(_reading(body, codec, not codec.startswith("utf-8"), "surrogatepass"))
    elif b"\x00" in body[:64] or body.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        for codec in ("utf-32-le", "utf-32-be", "utf-16-le", "utf-16-be"):
            readings.append(_reading(body, codec, False))
    readings.append(_reading(body, "utf-8", False, "surrogatepass"))
    # And through its bytes whatever they are: werkzeug and Django read a form with
    # errors replaced, so a stray byte (a binary upload's part) hides none of its fields
    # from the app. Undecodable bytes are carried as escapes and written back as sent.
    readings.append(_Reading("utf-8", b"", False, "surrogateescape"))
    return list(dict.fromkeys(readings))


def _decode(body: bytes, reading: _Reading) -> tuple[str, bytes] | None:
    """The text of ``body`` in ``reading`` and the bytes of a character the body cap cut
    in two (left as they are); None when it does not decode so."""
    try:
        decoder = codecs.getincrementaldecoder(reading.codec)(reading.errors)
        text = decoder.decode(body[len(reading.mark) :])
        tail: bytes = decoder.getstate()[0]
    except (UnicodeError, LookupError, ValueError):
        return None
    # More than a cut character left over (a shift sequence of UTF-7 never closed, say)
    # is text this reading cannot show: it does not decode.
    return (text, tail) if len(tail) <= 3 else None


def redact_body(body: bytes, content_type: str, fields: frozenset[str]) -> bytes:
    """The logged part of a request body with the values of secret fields replaced:
    urlencoded forms, JSON (also when cut short), multipart forms, XML (SOAP); every body
    is searched with every rule, since a client may label it wrongly.

    The body is read as each reader of it would (:func:`_readings`: its charset, JSON's
    own encoding rules, its bytes) and redacted in that encoding, everything but the
    secret values kept byte for byte. Raises :class:`BodyUnreadable` when its secret
    fields cannot be found with confidence: it does not decode in the encoding it says it
    is in, or two readings of it hold different secret fields.
    """
    if not body:
        return body
    mimetype, charsets, boundaries = _content_type(content_type)
    redacted: dict[bytes, str] = {}
    for reading in _readings(body, mimetype, charsets):
        decoded = _decode(body, reading)
        if decoded is None:
            if reading.required:
                raise BodyUnreadable(f"not text in {reading.codec}: its fields cannot be looked at")
            continue
        text, tail = decoded
        changed = _redact_text(text, mimetype, boundaries, fields)
        if changed == text:
            continue
        try:
            out = reading.mark + changed.encode(reading.codec, reading.errors) + tail
        except UnicodeError:
            raise BodyUnreadable(
                f"its secret fields cannot be written back in {reading.codec}"
            ) from None
        redacted.setdefault(out, reading.codec)
    if not redacted:
        return body  # nothing secret: the bytes exactly as sent
    if len(redacted) > 1:
        raise BodyUnreadable(
            "it holds secret fields read as "
            + " and as ".join(dict.fromkeys(redacted.values()))
            + ": it cannot be redacted for both"
        )
    return next(iter(redacted))
