"""Reading configuration files: ``.toml`` and Java-style ``.properties``.

Both formats load into the settings-dict shape of SPEC §3, together with a map from dotted
keys (``"caller.header"``, ``"limits.shop/checkout.concurrency"``) to 1-based line numbers,
so the validator can point at the line of a bad value::

    settings, lines = load_file("gatekeeper.properties")
    settings["limits"]["shop/checkout"]["concurrency"]   # "10" (properties values stay strings)
    lines["limits.shop/checkout.concurrency"]            # 7

Every problem raises :class:`~gatekeeper_wsgi.errors.ConfigError` naming the file and line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

from gatekeeper_wsgi.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:
    # Declared as a dependency for 3.10 only, so type checkers on newer Pythons may not see it.
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = ["MAX_FILE_BYTES", "file_kind", "load_file", "open_for_writing", "read_file"]


#: The largest configuration file read (SPEC §4.10); a larger one is a ConfigError.
MAX_FILE_BYTES = 16 * 1024 * 1024
_SUFFIXES = (".toml", ".properties")


def _check_suffix(file: str) -> str:
    suffix = Path(file).suffix.lower()
    if suffix not in _SUFFIXES:
        shown = repr(suffix) if suffix else "no suffix"
        raise ConfigError(
            "", f"unsupported file type ({shown}): expected .toml or .properties", file=file
        )
    return suffix


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, by its ``st_mode``: ``"a directory"``."""
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def read_file(path: str | os.PathLike[str]) -> tuple[bytes, os.stat_result]:
    """The bytes of a configuration file and the ``fstat`` of what was read.

    Only a regular file of at most MAX_FILE_BYTES is read (SPEC §4.10). It is opened
    non-blocking and checked on the opened descriptor, so a FIFO (which would block
    ``open`` until a writer comes) or a symlink to ``/dev/zero`` is refused at once, and
    no swap of the path between a check and the read can change what is read.
    """
    file = str(path)
    _check_suffix(file)
    if "\0" in file:  # os.open would raise ValueError: no file can be named so
        raise ConfigError("", "cannot read file: its name holds a NUL byte", file=repr(file))
    try:
        descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError("", f"cannot read file: {exc.strerror or exc}", file=file) from exc
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ConfigError(
                "", f"cannot read file: {file_kind(status.st_mode)}, not a regular file", file=file
            )
        too_big = ConfigError(
            "", f"cannot read file: larger than {MAX_FILE_BYTES >> 20} MiB", file=file
        )
        if status.st_size > MAX_FILE_BYTES:
            raise too_big
        chunks = []
        total = 0
        # The file may grow while it is read: read one byte past the cap to know.
        while chunk := os.read(descriptor, min(1 << 20, MAX_FILE_BYTES + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > MAX_FILE_BYTES:
                raise too_big
        return b"".join(chunks), status
    except OSError as exc:
        raise ConfigError("", f"cannot read file: {exc.strerror or exc}", file=file) from exc
    finally:
        os.close(descriptor)


try:
    import fcntl

    # Linux: a read lease, and the signal its breaking sends (see open_for_writing).
    _LEASE: tuple[int, int, int, int] | None = (
        fcntl.F_SETLEASE,  # type: ignore[attr-defined, unused-ignore]
        fcntl.F_SETSIG,  # type: ignore[attr-defined, unused-ignore]
        fcntl.F_RDLCK,
        fcntl.F_UNLCK,
    )
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _LEASE = None


def open_for_writing(path: str, inode: int) -> bool | None:
    """Whether any process, this one included, has the file at ``path`` (of inode
    ``inode``) open for writing right now: a writer rewriting it in place that may not be
    done. None when this system cannot tell.

    Linux refuses a read lease (``F_SETLEASE``) on a file that is open for writing
    anywhere, so a lease taken and dropped at once says nobody is writing it. Only the
    file's owner (or a process with ``CAP_LEASE``) may take one, on a file system that has
    leases; otherwise, and off Linux: None. A writer that opens the file in the
    microseconds the lease is held waits for it to be dropped, and this process is sent
    the lease's signal, set to SIGURG, which is ignored unless the application handles it
    (the default, SIGIO, would end the process).
    """
    if _LEASE is None:  # pragma: no cover - not Linux
        return None
    set_lease, set_signal, read_lease, unlock = _LEASE
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(descriptor).st_ino != inode:
            return None  # replaced since it was read: the caller's next check sees it
        fcntl.fcntl(descriptor, set_signal, signal.SIGURG)
        try:
            fcntl.fcntl(descriptor, set_lease, read_lease)
        except OSError as exc:
            return True if exc.errno in (errno.EAGAIN, errno.EBUSY) else None
        fcntl.fcntl(descriptor, set_lease, unlock)
        return False
    except OSError:
        return None
    finally:
        os.close(descriptor)


def load_file(
    path: str | os.PathLike[str],
    data: bytes | None = None,
    *,
    settings_keys: Collection[str] = (),
) -> tuple[dict[str, Any], Mapping[str, int]]:
    """Read a .toml or .properties configuration file into the settings-dict shape of SPEC §3.

    Returns (settings, lines): lines maps a dotted key to its 1-based line number.
    ``data`` is the file's content when the caller has read it already (:func:`read_file`).
    ``settings_keys`` are the settings' top-level keys: in a TOML file with a
    ``[gatekeeper]`` table, one of them beside that table (where it would be ignored) is
    an error, while other tables of a file shared with other settings are left alone.
    Any problem, however malformed the content, is a ConfigError naming the file.
    """
    file = str(path)
    suffix = _check_suffix(file)
    if data is None:
        data, _ = read_file(file)
    try:
        # Notepad and friends write a byte order mark; it is never part of the first key.
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            "", f"not valid UTF-8: {exc.reason}", file=file, line=_line_of_offset(data, exc.start)
        ) from exc
    try:
        if suffix == ".toml":
            return _load_toml(text, file, settings_keys)
        return _load_properties(text, file)
    except RecursionError as exc:
        raise ConfigError("", "nested too deeply", file=file) from exc


def _line_of_offset(data: bytes, offset: int) -> int:
    return len(re.findall(rb"\r\n|\r|\n", data[:offset])) + 1


# --------------------------------------------------------------------------- .properties

# java.util.Properties treats only these three as white space, not Python's str.isspace() set.
_WHITESPACE = " \t\f"
# Natural lines end at \n, \r or \r\n; str.splitlines() would also split at \v, \x1c, \u2028...
_LINE_TERMINATOR = re.compile(r"\r\n|\r|\n")
_SIMPLE_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_HEX4 = re.compile(r"[0-9A-Fa-f]{4}")
_SURROGATES = re.compile(r"[\ud800-\udfff]")


def _load_properties(text: str, file: str) -> tuple[dict[str, Any], dict[str, int]]:
    settings: dict[str, Any] = {}
    lines: dict[str, int] = {}
    seen: dict[str, int] = {}
    # Which flat key (and line) made a nested path a value or a table, to report conflicts.
    values: dict[tuple[str, ...], tuple[str, int]] = {}
    tables: dict[tuple[str, ...], tuple[str, int]] = {}

    for line, logical in _logical_lines(text, file):
        raw_key, raw_value = _split_key_value(logical)
        key = _unescape(raw_key, raw_key, file, line)
        value = _unescape(raw_value, key or raw_key, file, line)
        if not key:
            raise ConfigError("", f"empty key (value {value!r})", file=file, line=line)
        if key in seen:
            raise ConfigError(
                key, f"duplicate key, already set on line {seen[key]}", file=file, line=line
            )
        seen[key] = line
        segments = _segments(key, file, line)

        for depth in range(1, len(segments)):
            prefix = segments[:depth]
            if prefix in values:
                other, other_line = values[prefix]
                raise _conflict(key, other, other_line, file, line)
            tables.setdefault(prefix, (key, line))
        if segments in tables:
            other, other_line = tables[segments]
            raise _conflict(key, other, other_line, file, line)
        values[segments] = (key, line)

        node = settings
        for depth, segment in enumerate(segments[:-1], start=1):
            node = node.setdefault(segment, {})
            lines.setdefault(".".join(segments[:depth]), line)
        node[segments[-1]] = value
        lines[key] = line
    return settings, lines


def _conflict(key: str, other: str, other_line: int, file: str, line: int) -> ConfigError:
    return ConfigError(
        key,
        f"conflicts with {other!r} on line {other_line}: a key cannot be both a value and a table",
        file=file,
        line=line,
    )


def _segments(key: str, file: str, line: int) -> tuple[str, ...]:
    """Where a flat key lands in the nested settings dict."""
    head, _, rest = key.partition(".")
    if head == "limits" and rest:
        # Limit paths contain no dots but may contain '*', so only the last dot splits.
        path, dot, field = rest.rpartition(".")
        if not dot or not path or not field:
            raise ConfigError(
                key,
                "expected limits.<path>.<field>, e.g. limits.shop.concurrency",
                file=file,
                line=line,
            )
        return ("limits", path, field)
    if head == "routes" and rest:
        # A werkzeug rule may itself contain dots (/feed.xml), so it is taken whole.
        return ("routes", rest)
    if key.count(".") >= MAX_KEY_PARTS:
        # Each part's prefix is kept to find conflicts: quadratic in the parts (a 40 KB key
        # took seconds and gigabytes). No setting is more than a few parts deep.
        raise ConfigError(
            key, f"a key of more than {MAX_KEY_PARTS} dotted parts", file=file, line=line
        )
    segments = tuple(key.split("."))
    if "" in segments:
        raise ConfigError(key, "empty part in dotted key", file=file, line=line)
    return segments


def _logical_lines(text: str, file: str) -> Iterator[tuple[int, str]]:
    """Yield (line number where it starts, text) of each logical line that is not a comment."""
    natural = _LINE_TERMINATOR.split(text)
    if natural[-1] == "":
        # A final terminator ends the last line; it does not start an empty one.
        natural.pop()
    index = 0
    while index < len(natural):
        start = index + 1
        current = natural[index].lstrip(_WHITESPACE)
        index += 1
        if not current or current[0] in "#!":
            continue
        if current == "\\" and index < len(natural):
            # Properties.load quirk: a lone backslash continues into nothing, so the next
            # line still starts the logical line (and may be blank or a comment).
            continue
        parts = []
        while _continues(current):
            current = current[:-1]
            if index == len(natural):
                # Properties.load: a continuation at the end of the file continues into
                # nothing; the backslash is dropped and the line ends there.
                break
            parts.append(current)
            current = natural[index].lstrip(_WHITESPACE)
            index += 1
        parts.append(current)
        yield start, "".join(parts)


def _continues(natural_line: str) -> bool:
    trailing = len(natural_line) - len(natural_line.rstrip("\\"))
    return trailing % 2 == 1


def _split_key_value(logical: str) -> tuple[str, str]:
    """Split at the first unescaped '=', ':' or white space, as Properties.load does."""
    key_end = value_start = len(logical)
    has_separator = False
    escaped = False
    for index, char in enumerate(logical):
        if not escaped and char in "=:":
            key_end, value_start, has_separator = index, index + 1, True
            break
        if not escaped and char in _WHITESPACE:
            key_end, value_start = index, index + 1
            break
        escaped = char == "\\" and not escaped
    while value_start < len(logical):
        char = logical[value_start]
        if char not in _WHITESPACE:
            if has_separator or char not in "=:":
                break
            has_separator = True
        value_start += 1
    return logical[:key_end], logical[value_start:]


def _unescape(raw: str, key: str, file: str, line: int) -> str:
    if "\\" not in raw:
        return raw
    out: list[str] = []
    index = 0
    while index < len(raw):
        char = raw[index]
        index += 1
        if char != "\\":
            out.append(char)
            continue
        if index == len(raw):
            # Unreachable through _logical_lines (an odd trailing backslash continues the
            # line, or is dropped at the end of the file), kept so this function is total.
            break
        char = raw[index]
        index += 1
        if char == "u":
            digits = raw[index : index + 4]
            if not _HEX4.fullmatch(digits):
                raise ConfigError(
                    key, f"malformed \\uHHHH escape: \\u{digits}", file=file, line=line
                )
            out.append(chr(int(digits, 16)))
            index += 4
        else:
            out.append(_SIMPLE_ESCAPES.get(char, char))
    result = "".join(out)
    if _SURROGATES.search(result):
        # Java writes characters outside the BMP as two \uHHHH escapes (a UTF-16 pair).
        try:
            result = result.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                key, "\\uHHHH escape is an unpaired UTF-16 surrogate", file=file, line=line
            ) from exc
    return result


# --------------------------------------------------------------------------------- .toml

_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_AT_END = re.compile(r"\s*\(at end of document\)\s*$")
_SETTINGS_TABLE = "gatekeeper"


#: The most parts a dotted key or table name of a TOML file may have. tomllib's time grows
#: with the square of a key's parts (5 000 parts: 0.24 s, 20 000: seconds, a 16 MiB file:
#: hours, all of it in the request that checks for a reload), and no key of the
#: configuration has more than a few.
MAX_KEY_PARTS = 32
#: The most tables, arrays and dotted key parts a TOML file may hold. tomllib builds a
#: table, with its own bookkeeping, for every part of a key or table name it has not seen
#: (about 1 KB each: a few MiB of ``[t1.b.b.b…]`` headers took gigabytes, in the request
#: that checks for a reload); a configuration has a few per limit (a 5 000-limit file of
#: inline tables: 5 000), so this bounds the parse to about 100 MB and a second.
MAX_TOML_NODES = 100_000
# Strings and comments, whose dots are no key's: replaced before the search below, each
# by a bare word (a quoted key part stays a part) and its newlines (lines stay in place).
# A multi-line string ends at the last three quotes of the first run of three to five
# that no backslash escapes (a basic one's escapes are read, a literal one has none), so
# an escaped quote inside it cannot end it early and let the rest of the file pass for
# strings, keys hidden in between.
_TOML_OPAQUE = re.compile(
    r'"""(?:[^"\\]|\\[\s\S]|""?(?!"))*"{3,5}'
    r"|'''(?:[^']|''?(?!'))*'{3,5}"
    r'|"(?:[^"\\\n]|\\.)*"'
    r"|'[^'\n]*'|#[^\n]*"
)
# Blanks around a dot (a key may have them), dropped before the search below (a run is
# tried from its start only, so giving back costs the run once).
_TOML_BLANKS_BEFORE_DOT = re.compile(r"(?<![ \t])[ \t]+(?=\.)")
_TOML_BLANKS_AFTER_DOT = re.compile(r"\.[ \t]+")
# A key of more than MAX_KEY_PARTS parts, starting where a key starts (not after a part's
# letter or dot): each run is looked at once, and a part given back fails at once (a dot
# must follow it, and a part holds none), so the search is linear in the text. (Not
# possessive quantifiers: Python's re reads those from 3.11 on.)
_TOML_LONG_KEY = re.compile(
    rf"(?<![A-Za-z0-9_.-])(?:[A-Za-z0-9_-]+\.){{{MAX_KEY_PARTS}}}[A-Za-z0-9_-]"
)


#: A number tomllib cannot read (int() refuses more than 4 300 digits).
_TOML_LONG_NUMBER = re.compile(r"[0-9][0-9_]{999,}")


# What tomllib makes a table or an array of: a dot between key parts, a brace, a bracket.
_TOML_NODE = re.compile(r"[.{\[]")


def _refuse_costly_toml(text: str, file: str) -> None:
    """A ConfigError for the first key of more than MAX_KEY_PARTS parts, before tomllib
    spends quadratic time on it, or for the part of the file past MAX_TOML_NODES tables,
    arrays and key parts, before it spends gigabytes on them."""
    dots = text.count(".")
    if dots < MAX_KEY_PARTS and dots + text.count("{") + text.count("[") <= MAX_TOML_NODES:
        return  # most files
    bare = _TOML_OPAQUE.sub(lambda found: "q" + "\n" * found.group().count("\n"), text)
    bare = _TOML_BLANKS_AFTER_DOT.sub(".", _TOML_BLANKS_BEFORE_DOT.sub("", bare))
    if (long_key := _TOML_LONG_KEY.search(bare)) is not None:
        raise ConfigError(
            "",
            f"invalid TOML: a key of more than {MAX_KEY_PARTS} dotted parts",
            file=file,
            line=bare.count("\n", 0, long_key.start()) + 1,
        )
    if bare.count(".") + bare.count("{") + bare.count("[") > MAX_TOML_NODES:
        past = next(islice(_TOML_NODE.finditer(bare), MAX_TOML_NODES, None))
        raise ConfigError(
            "",
            f"invalid TOML: more than {MAX_TOML_NODES} tables, arrays and dotted key parts"
            " (a configuration has a few per limit)",
            file=file,
            line=bare.count("\n", 0, past.start()) + 1,
        )


def _load_toml(
    text: str, file: str, settings_keys: Collection[str]
) -> tuple[dict[str, Any], Mapping[str, int]]:
    _refuse_costly_toml(text, file)
    try:
        document: dict[str, Any] = tomllib.loads(text)
    except RecursionError as exc:
        raise ConfigError(
            "",
            "invalid TOML: arrays or tables nested too deeply",
            file=file,
            line=_deepest_line(text),
        ) from exc
    except ValueError as exc:
        if not isinstance(exc, tomllib.TOMLDecodeError):
            # int() refusing thousands of digits: tomllib lets its ValueError through.
            long_number = _TOML_LONG_NUMBER.search(text)
            if long_number is None:  # pragma: no cover - int() refuses only those
                raise ConfigError(
                    "", "invalid TOML: a number of thousands of digits", file=file
                ) from exc
            number_line = text.count("\n", 0, long_number.start()) + 1
            raise ConfigError(
                _key_on_line(text, number_line),
                "invalid TOML: a number of thousands of digits (no setting takes one that long)",
                file=file,
                line=number_line,
            ) from exc
        message = str(exc)
        line: int | None = None
        key = ""
        if position := _TOML_POSITION.search(message):
            line = int(position.group(1))
            message = f"{message[: position.start()]} (column {position.group(2)})"
            key = _duplicate_key(text, line, message)
        elif at_end := _TOML_AT_END.search(message):
            # "The end" is more useful as the last line with text than as a blank one after it.
            line = text.rstrip().count("\n") + 1
            message = f"{message[: at_end.start()]} (at end of file)"
        raise ConfigError(key, f"invalid TOML: {message}", file=file, line=line) from exc

    prefix: tuple[str, ...] = ()
    settings = document
    if _SETTINGS_TABLE in document:
        settings = document[_SETTINGS_TABLE]
        prefix = (_SETTINGS_TABLE,)
        if not isinstance(settings, dict):
            located = _TomlLocator(text, ()).locate()
            raise ConfigError(
                _SETTINGS_TABLE,
                f"expected a table, got {settings!r}",
                file=file,
                line=located.get(_SETTINGS_TABLE),
            )
        # In document order, so the first one in the file is reported.
        for key in document:
            if key in settings_keys:
                located = _TomlLocator(text, ()).locate()
                raise ConfigError(
                    key,
                    f"beside the [{_SETTINGS_TABLE}] table, where it would be ignored; "
                    f"move it under [{_SETTINGS_TABLE}]",
                    file=file,
                    line=located.get(key),
                )
    return settings, _LazyLines(_TomlLocator(text, prefix).locate)


# A TOML key's parts: bare, "basic" or 'literal', separated by dots.
_TOML_KEY_PART = re.compile(r"""\s*(?:([A-Za-z0-9_-]+)|"((?:[^"\\]|\\.)*)"|'([^']*)')\s*(?:\.|$)""")
_TOML_TABLE_HEADER = re.compile(r"\s*\[([^\[\]]+)\]\s*(?:#.*)?")
_TOML_DECLARED = re.compile(r"Cannot declare \((.*)\) twice")


def _toml_key_parts(key: str) -> list[str] | None:
    """The parts of a dotted TOML key (escapes of a basic string left as written); None
    if ``key`` is not one."""
    parts = []
    position = 0
    while position < len(key):
        found = _TOML_KEY_PART.match(key, position)
        if found is None or found.end() == position:
            return None
        parts.append(next(part for part in found.groups() if part is not None))
        position = found.end()
    return parts


def _duplicate_key(text: str, line: int, message: str) -> str:
    """The settings key a duplicate in a TOML document names (tomllib's message says
    only where): a table declared twice is in its message; a value set twice is the key
    before ``=`` on its line under the table last declared above it. "" otherwise."""
    if declared := _TOML_DECLARED.search(message):
        parts = re.findall(r"'((?:[^'\\]|\\.)*)'", declared.group(1))
    elif message.startswith("Cannot overwrite a value"):
        lines = text.split("\n")
        name = _toml_key_parts(lines[line - 1].split("=", 1)[0]) if line <= len(lines) else None
        if name is None:
            return ""
        table: list[str] = []
        for above in reversed(lines[: line - 1]):
            if header := _TOML_TABLE_HEADER.fullmatch(above):
                table = _toml_key_parts(header.group(1)) or []
                break
        parts = table + name
    else:
        return ""
    if parts[:1] == [_SETTINGS_TABLE]:
        parts = parts[1:]
    return ".".join(parts)


def _key_on_line(text: str, line: int) -> str:
    """The dotted settings key on ``line`` of ``text``, whose value is a number of
    thousands of digits: located as :func:`_load_toml` locates a key, in the text with
    each such number cut to one digit (which the parser takes); "" if none is found."""
    patched = _TOML_LONG_NUMBER.sub("0", text)
    try:
        document = tomllib.loads(patched)
    except ValueError:  # another fault in the file: the line alone is reported
        return ""
    prefix = (_SETTINGS_TABLE,) if isinstance(document.get(_SETTINGS_TABLE), dict) else ()
    located = _TomlLocator(patched, prefix).locate()
    # The last key noted on the line is the innermost (an inline table's member).
    keys = [key for key, at in located.items() if at == line]
    return keys[-1] if keys else ""


# What moves the nesting of a TOML document: brackets and braces, newlines (to count lines),
# and what hides brackets from it (strings on one line, comments).
_TOML_NESTING = re.compile(r""""(?:[^"\\\n]|\\.)*"|'[^'\n]*'|#[^\n]*|[\[\]{}\n]""")


def _deepest_line(text: str) -> int:
    """The line where the brackets of ``text`` first nest deepest: where a document nested
    too deeply for the parser goes wrong."""
    depth = deepest = 0
    line = at = 1
    for match in _TOML_NESTING.finditer(text):
        token = match.group()
        if token == "\n":
            line += 1
        elif token in "[{":
            depth += 1
            if depth > deepest:
                deepest, at = depth, line
        elif token in "]}":
            depth -= 1
    return at


class _LazyLines(Mapping[str, int]):
    """Key -> line of a TOML file, located only when first asked for: the validator asks
    only to report an error, and locating walks the text character by character (most
    of the cost of loading a valid file of thousands of limits)."""

    def __init__(self, locate: Callable[[], dict[str, int]]) -> None:
        self._locate: Callable[[], dict[str, int]] | None = locate
        self._lines: dict[str, int] = {}

    def _located(self) -> dict[str, int]:
        if self._locate is not None:
            self._lines = self._locate()
            self._locate = None  # drops the text it held
        return self._lines

    def __getitem__(self, key: str) -> int:
        return self._located()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._located())

    def __len__(self) -> int:
        return len(self._located())


class _TomlLocator:
    """Best-effort map from dotted key to the line that defines it in a valid TOML text.

    tomllib reports no positions, so this walks the text knowing just enough TOML (headers,
    dotted and quoted keys, strings, arrays, inline tables) not to mistake a string's
    content for a key. It never raises; a key it cannot place is simply absent.
    """

    def __init__(self, text: str, prefix: tuple[str, ...]) -> None:
        self.text = text
        self.prefix = prefix
        self.pos = 0
        self.line = 1
        self.lines: dict[str, int] = {}

    def locate(self) -> dict[str, int]:
        # Absurdly nested arrays or inline tables: keep what was found so far.
        with contextlib.suppress(RecursionError):
            self._document()
        return self.lines

    def _document(self) -> None:
        table: tuple[str, ...] = ()
        while self._peek():
            before = self.pos
            self._skip_space(newlines=True)
            if self._peek() == "[":
                self._advance(2 if self._peek(1) == "[" else 1)
                line = self.line
                table = tuple(self._key())
                self._note(table, line)
            elif self._peek():
                self._key_value(table)
            self._skip_to_line_end()
            if self.pos == before:
                self._advance()

    def _key_value(self, base: tuple[str, ...] | None) -> None:
        line = self.line
        key = self._key()
        self._skip_space(newlines=False)
        if not key or self._peek() != "=":
            return
        self._advance()
        self._skip_space(newlines=False)
        path = None if base is None else base + tuple(key)
        if path is not None:
            self._note(path, line)
        self._value(path)

    def _key(self) -> list[str]:
        segments: list[str] = []
        while True:
            self._skip_space(newlines=False)
            char = self._peek()
            if char == '"':
                segments.append(self._basic_string())
            elif char == "'":
                segments.append(self._literal_string())
            else:
                start = self.pos
                while (char := self._peek()) and (
                    (char.isascii() and char.isalnum()) or char in "-_"
                ):
                    self._advance()
                if self.pos == start:
                    return segments
                segments.append(self.text[start : self.pos])
            self._skip_space(newlines=False)
            if self._peek() != ".":
                return segments
            self._advance()

    def _value(self, path: tuple[str, ...] | None) -> None:
        char = self._peek()
        if char == "{":
            self._inline_table(path)
        elif char == "[":
            self._array()
        elif char in ('"', "'"):
            if self.text.startswith(char * 3, self.pos):
                self._multiline_string(char)
            elif char == '"':
                self._basic_string()
            else:
                self._literal_string()
        else:
            while (char := self._peek()) and char not in ",]}#\n":
                self._advance()

    def _inline_table(self, path: tuple[str, ...] | None) -> None:
        self._sequence("}", lambda: self._key_value(path))

    def _array(self) -> None:
        # Tables inside arrays have no dotted key of their own.
        self._sequence("]", lambda: self._value(None))

    def _sequence(self, close: str, item: Callable[[], None]) -> None:
        """Items separated by commas up to ``close``; stops at anything it cannot read."""
        self._advance()
        while self._peek():
            self._skip_space(newlines=True)
            char = self._peek()
            if char == close:
                self._advance()
                return
            if char == ",":
                self._advance()
                continue
            before = self.pos
            item()
            if self.pos == before:
                return

    def _basic_string(self) -> str:
        self._advance()
        out: list[str] = []
        while (char := self._peek()) and char not in '"\n':
            if char == "\\":
                out.append(self._escape())
            else:
                out.append(char)
                self._advance()
        if char == '"':
            self._advance()
        return "".join(out)

    def _escape(self) -> str:
        code = self._peek(1)
        self._advance(2)
        width = {"u": 4, "U": 8}.get(code)
        if width is None:
            simple = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", "e": "\x1b"}
            return simple.get(code, code)
        digits = self.text[self.pos : self.pos + width]
        self._advance(len(digits))
        try:
            return chr(int(digits, 16))
        except ValueError:
            return ""

    def _literal_string(self) -> str:
        self._advance()
        start = self.pos
        while (char := self._peek()) and char not in "'\n":
            self._advance()
        value = self.text[start : self.pos]
        if char == "'":
            self._advance()
        return value

    def _multiline_string(self, quote: str) -> None:
        self._advance(3)
        while char := self._peek():
            if char == "\\" and quote == '"':
                self._advance(2)
            elif self.text.startswith(quote * 3, self.pos):
                self._advance(3)
                # Up to two quotes right before the closing delimiter belong to the content.
                for _ in range(2):
                    if self._peek() == quote:
                        self._advance()
                return
            else:
                self._advance()

    def _note(self, path: tuple[str, ...], line: int) -> None:
        if path[: len(self.prefix)] != self.prefix:
            return
        relative = path[len(self.prefix) :]
        for depth in range(1, len(relative) + 1):
            self.lines.setdefault(".".join(relative[:depth]), line)

    def _peek(self, ahead: int = 0) -> str:
        index = self.pos + ahead
        return self.text[index] if index < len(self.text) else ""

    def _advance(self, count: int = 1) -> None:
        end = min(self.pos + count, len(self.text))
        self.line += self.text.count("\n", self.pos, end)
        self.pos = end

    def _skip_space(self, *, newlines: bool) -> None:
        while char := self._peek():
            if char in " \t" or (newlines and char in "\r\n"):
                self._advance()
            elif char == "#" and newlines:
                self._skip_to_line_end()
            else:
                return

    def _skip_to_line_end(self) -> None:
        end = self.text.find("\n", self.pos)
        self._advance((len(self.text) if end < 0 else end) - self.pos)
