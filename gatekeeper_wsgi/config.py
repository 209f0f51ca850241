"""The configuration model: one validated, immutable :class:`Config`.

It is built from a settings dict (Django ``settings.GATEKEEPER``, Flask
``app.config["GATEKEEPER"]``), a ``.toml`` file or a ``.properties`` file, all of the same
shape (SPEC §3). Values from ``.properties`` files arrive as strings and are converted here,
so every source goes through the same checks and the same error messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Any, AnyStr, Literal, TypeVar, get_args

from werkzeug.routing import Map, Rule
from werkzeug.routing.converters import NumberConverter
from werkzeug.utils import import_string

from gatekeeper_wsgi.adaptive import ALGORITHMS, AdaptiveSpec
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.limitindex import LimitIndex

# Re-exported: the configuration's value types, at the import path they always had.
from gatekeeper_wsgi.values import (
    CALLER_RE,
    DEFAULT_MAX_KEYS,
    LEVELS,
    Limit,
    Mode,
    QueueSpec,
    Rate,
    TimeoutHeader,
    scheme_of,
)

__all__ = [
    "CALLER_RE",
    "DEFAULT_MAX_KEYS",
    "FAULT_FORMATS",
    "MODES",
    "ON_BACKEND_ERROR",
    "BackendErrorPolicy",
    "CallerConfig",
    "Config",
    "FaultFormat",
    "Limit",
    "Mode",
    "QueueSpec",
    "Rate",
    "TimeoutHeader",
    "build_config",
    "check_limit",
    "config_file",
    "load_config",
    "merge_settings",
]

#: ``on_backend_error``: admit (fail open) or refuse (fail closed) while the backend is down.
BackendErrorPolicy = Literal["allow", "reject"]
#: ``fault.format``: negotiated by ``Accept``, or forced.
FaultFormat = Literal["auto", "xml", "json"]
# The accepted values, derived from the types so the two cannot drift apart.
MODES: tuple[Mode, ...] = get_args(Mode)
ON_BACKEND_ERROR: tuple[BackendErrorPolicy, ...] = get_args(BackendErrorPolicy)
FAULT_FORMATS: tuple[FaultFormat, ...] = get_args(FaultFormat)

_SEGMENT_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}|\*")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

_UNITS = {"second": 1.0, "minute": 60.0, "hour": 3600.0, "day": 86400.0}
_SHORT_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# Numbers of any length: one out of bounds is refused with the bounds (see Checker.rate).
_RATE_RE = re.compile(
    r"\s*([0-9]+)\s*/\s*"
    r"(?:(second|minute|hour|day)|([0-9]+(?:\.[0-9]+)?)?\s*([smhd]))\s*",
    re.ASCII,
)

#: The largest integer any setting takes (counts, sizes): larger is a typo or an attack.
MAX_INTEGER = 10**9
#: The longest delay or queue wait, in seconds (a week): it becomes a Retry-After.
MAX_SECONDS = 7 * 86400.0
#: The longest reload interval, in seconds (effectively "never").
MAX_RELOAD_SECONDS = 1e9
#: The longest rate window, in seconds (a year).
MAX_WINDOW = 366 * 86400.0
#: The most request-body bytes one rejected-log record may carry (the record cap).
MAX_LOGGED_BODY = 16 * 1024
#: The longest the rejected-log queue may be configured.
MAX_LOG_QUEUE = 1_000_000
# ASCII digits only (str.isdigit and \d accept "٣"): a sign, leading zeros, the digits
# that count (none for 0). Unambiguous, so matching a long string costs linear time.
_INTEGER_RE = re.compile(r"\s*([+-]?)(?=[0-9])0*([1-9][0-9]*)?\s*", re.ASCII)
# More digits than this are out of every integer setting's range: int() is not even tried.
_MAX_INTEGER_DIGITS = 12
# A number as a file writes it (what TOML and a dict take as a float): a sign, up to 40
# digits either side of the point (more than a double holds; thousands are refused before
# float() reads them), an exponent. A negative one is read, to be refused by its bound.
_NUMBER_RE = re.compile(
    r"\s*[+-]?(?:[0-9]{1,40}(?:\.[0-9]{0,40})?|\.[0-9]{1,40})(?:[eE][+-]?[0-9]{1,4})?\s*", re.ASCII
)
# How much of a bad value an error message quotes.
_SHOWN_CHARS = 100


def shown(value: object) -> str:
    """``repr(value)`` fit for an error message: short, control characters escaped (repr
    does that), and never failing (repr of a 5 000-digit int raises ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


@dataclass(frozen=True)
class CallerConfig:
    """The ``caller`` section: where the third level's name comes from."""

    header: str = "X-Caller-Id"
    required: bool = False
    default: str = "anonymous"
    #: callable(environ) -> str | None (a dotted path in settings is imported)
    resolver: Callable[..., str | None] | None = None


@dataclass(frozen=True)
class ReloadConfig:
    """The ``reload`` section: the operators' file and how often it is checked."""

    file: str | None = None
    every_seconds: float = 5.0
    every_requests: int = 1000


@dataclass(frozen=True)
class FaultConfig:
    """The ``fault`` section: how a ServiceFault is rendered."""

    format: FaultFormat = "auto"
    #: callable(rejected, request_id, environ) -> (content_type, body) (a dotted path in
    #: settings is imported)
    renderer: Callable[..., Any] | None = None


@dataclass(frozen=True)
class RejectedLogConfig:
    """The ``rejected_log`` section: what a ``gatekeeper.rejected`` record may hold."""

    #: header names redacted besides Authorization, Cookie (and Proxy-Authorization)
    redact_headers: tuple[str, ...] = ()
    #: form / JSON / query field names redacted besides SPEC §4.8's list
    redact_fields: tuple[str, ...] = ()
    #: request body bytes captured per rejected request
    body_bytes: int = 2048
    #: records waiting for the listener thread at most; more are dropped and counted
    queue_size: int = 10_000


@dataclass(frozen=True)
class DashboardConfig:
    """The ``dashboard`` section: access to the status endpoint and the dashboard."""

    #: bearer token for the status endpoint / dashboard outside Django/Flask auth; None = off
    token: str | None = None


@dataclass(frozen=True)
class Config:
    """The validated, immutable configuration (SPEC §3). Build it with :func:`build_config`."""

    project: str = "default"
    caller: CallerConfig = field(default_factory=CallerConfig)
    request_id_header: str = "X-Request-Id"
    backend: str = "memory"
    routes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    fault: FaultConfig = field(default_factory=FaultConfig)
    mode: Mode = "enforce"
    on_backend_error: BackendErrorPolicy = "allow"
    #: key "ip": an IPv6 address counts by its network of this many bits
    ipv6_prefix: int = 64
    reload: ReloadConfig = field(default_factory=ReloadConfig)
    limits: Mapping[str, Limit] = field(default_factory=lambda: MappingProxyType({}))
    rejected_log: RejectedLogConfig = field(default_factory=RejectedLogConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)

    @cached_property
    def limit_index(self) -> LimitIndex[Limit]:
        """The limits indexed by segment: which limit applies to a path, in O(segments)."""
        return LimitIndex(self.limits.values())

    @cached_property
    def caller_memo(self) -> dict[tuple[str, str, str], Any]:
        """The caller-level memo of :class:`~gatekeeper_wsgi.resolve.Route` (project,
        service, request value -> slots and delay): it lives and dies with this
        configuration, so a reload keeps nothing of the previous one alive."""
        return {}

    def with_code_limits(self, limits: Mapping[str, Mapping[str, Any]]) -> Config:
        """This configuration with limits defined in code (framework decorators) laid under
        its own, as :func:`load_config` lays them (a configured path wins): each code limit
        is checked here, the configuration, valid already, is not checked again."""
        if not limits:
            return self
        # The order load_config gives: code paths first, then the configuration's own.
        order = {**limits, **self.limits}
        merged = {
            path: self.limits[path] if path in self.limits else check_limit(path, limits[path])
            for path in order
        }
        return dataclasses.replace(self, limits=MappingProxyType(merged))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return all(
            _plain(getattr(self, name)) == _plain(getattr(other, name))
            for name in self.__dataclass_fields__
        )

    __hash__ = None  # type: ignore[assignment]


def _plain(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else value


# --- the schema, derived from the dataclasses above: accepted keys and their defaults ------


def _defaults(cls: type) -> dict[str, Any]:
    """The settings key -> default of a section's dataclass. A nested section's default
    is an empty table: its own dataclass supplies its defaults."""
    result: dict[str, Any] = {}
    for item in fields(cls):
        if not item.init:
            continue
        if item.default is not MISSING:
            result[item.name] = item.default
        elif item.default_factory is not MISSING:
            value = item.default_factory()
            result[item.name] = {} if is_dataclass(value) else value
    return result


#: section -> the dataclass it becomes
SECTION_TYPES: dict[str, type] = {
    "caller": CallerConfig,
    "fault": FaultConfig,
    "reload": ReloadConfig,
    "rejected_log": RejectedLogConfig,
    "dashboard": DashboardConfig,
}
# The defaults of the top level and of each section, written once: in the dataclasses.
_TOP_DEFAULTS = _defaults(Config)
_SECTION_DEFAULTS = {name: _defaults(cls) for name, cls in SECTION_TYPES.items()}
#: The keys of each section (for "did you mean" and the docs test).
SECTIONS: dict[str, tuple[str, ...]] = {
    name: tuple(defaults) for name, defaults in _SECTION_DEFAULTS.items()
}
#: The top-level keys.
TOP_LEVEL: tuple[str, ...] = tuple(_TOP_DEFAULTS)
#: The fields of a limit: the Limit dataclass's own, but its address.
LIMIT_FIELDS: tuple[str, ...] = tuple(
    item.name for item in fields(Limit) if item.init and item.name not in ("path", "segments")
)
#: The keys of a limit's ``adaptive`` table.
ADAPTIVE_FIELDS: tuple[str, ...] = tuple(item.name for item in fields(AdaptiveSpec))
_QUEUE_FIELDS: tuple[str, ...] = tuple(item.name for item in fields(QueueSpec))
_MARKERS = frozenset({"timeout_status", "timeout_header", "timeout_body"})
_Choice = TypeVar("_Choice", bound=str)
# An adaptive limit's max beyond this is surely a typo, not a concurrency.
_ADAPTIVE_MAX = 1_000_000
_DEFAULT_ADAPTIVE = AdaptiveSpec()


def merge_settings(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """Lay ``overlay`` (a file) over ``base`` (settings): its keys win, sections merge key
    by key and ``limits`` merge path by path (a path in the overlay replaces that path)."""
    merged = dict(base)
    for key, value in overlay.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = {**old, **value}
        else:
            merged[key] = value
    return merged


def _number_converter_arguments(rule: Rule) -> str | None:
    """What is wrong with the arguments of an ``int`` / ``float`` converter of ``rule``
    (bound into a map), or None: werkzeug takes ``min=x`` as the text "x" and fails
    only when a path is matched - inside a request, where the rule would then never
    apply."""
    for variable, converter in getattr(rule, "_converters", {}).items():
        if not isinstance(converter, NumberConverter):
            continue
        for argument in ("min", "max"):
            value = getattr(converter, argument, None)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                return f"{variable}: {argument} must be a number, got {shown(value)}"
        digits = getattr(converter, "fixed_digits", 0)
        if isinstance(digits, bool) or not isinstance(digits, int) or digits < 0:
            return f"{variable}: fixed_digits must be a whole number, got {shown(digits)}"
    return None


class _Checker:
    """Reads one settings dict, converting strings from .properties files, raising
    :class:`ConfigError` with key, value, expectation, and file:line where known."""

    def __init__(self, file: str | None, lines: Mapping[str, int] | None, whole_file: bool) -> None:
        self.file = file
        # Not `lines or {}`: a lazy map would locate every key just to say it is not empty.
        self.lines = lines if lines is not None else {}
        self.whole_file = whole_file

    def error(self, key: str, problem: str) -> ConfigError:
        line = None
        probe = key
        while probe:
            if probe in self.lines:
                line = self.lines[probe]
                break
            probe = probe.rpartition(".")[0]
            # Laid over settings, a section or `limits` table in the file does not make
            # each of its keys the file's: sections merge key by key, limits path by path.
            if not self.whole_file and "." not in probe:
                break
        # Settings laid under a file: a key the file does not hold came from the settings.
        file = self.file if line is not None or self.whole_file else None
        return ConfigError(key, problem, file=file, line=line)

    def bad(self, key: str, value: object, expected: str) -> ConfigError:
        return self.error(key, f"expected {expected}, got {shown(value)}")

    def unknown(self, key: str, name: str, allowed: tuple[str, ...]) -> ConfigError:
        close = difflib.get_close_matches(name, allowed, n=1) if len(name) <= 64 else []
        hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(allowed)}"
        return self.error(key, f"unknown key {shown(name)}{hint}")

    def mapping(self, key: str, value: object) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.bad(key, value, "a table / dict")
        for name in value:
            if not isinstance(name, str):
                raise self.bad(key, name, "string keys")
        return value

    def string(self, key: str, value: object, *, empty: bool = False) -> str:
        if not isinstance(value, str) or (not empty and not value.strip()):
            raise self.bad(key, value, "a non-empty string")
        return value.strip()

    def optional_string(self, key: str, value: object) -> str | None:
        if value is None or value == "":
            return None
        return self.string(key, value)

    def optional_path(self, key: str, value: object) -> str | None:
        if isinstance(value, os.PathLike):  # a pathlib.Path (Django's BASE_DIR / "...")
            value = os.fspath(value)
        text = self.optional_string(key, value)
        return None if text is None else self.no_nul(key, text)

    def no_nul(self, key: str, value: str) -> str:
        """``value``, a path or URL the OS will be given: one with a NUL byte names no file
        (the OS would be handed a shorter name, Python refuses it with ValueError)."""
        if "\0" in value:
            raise self.error(key, f"a NUL byte in {shown(value)}: no file can be named so")
        return value

    def boolean(self, key: str, value: object) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no"):
            return value.strip().lower() in ("true", "yes")
        raise self.bad(key, value, "true or false")

    def integer(self, key: str, value: object, minimum: int, maximum: int = MAX_INTEGER) -> int:
        number: int | float | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and (match := _INTEGER_RE.fullmatch(value)):
            sign, digits = match.group(1), match.group(2) or "0"
            if len(digits) <= _MAX_INTEGER_DIGITS:
                number = int(sign + digits)
            else:
                # int() of thousands of digits is slow, then refused; the sign says which
                # bound it is beyond, so the message is the one a dict's int gets.
                number = -math.inf if sign == "-" else math.inf
        if number is None or number < minimum:
            raise self.bad(key, value, f"an integer >= {minimum}")
        if number > maximum:
            raise self.bad(key, value, f"an integer >= {minimum} and <= {maximum}")
        return int(number)

    def number(
        self, key: str, value: object, *, positive: bool = False, maximum: float = MAX_SECONDS
    ) -> float:
        number: float | None = None
        if isinstance(value, int) and not isinstance(value, bool):
            # Compared as an int: float() of a huge int raises OverflowError.
            number = float(value) if -maximum <= value <= maximum else math.inf
        elif isinstance(value, float):
            number = value
        elif isinstance(value, str) and _NUMBER_RE.fullmatch(value):
            # float() alone would take "٣", "1_0", "inf" and thousands of digits.
            number = float(value)
        if number is None or number != number:
            raise self.bad(key, value, "a number of seconds")
        if number < 0 or (positive and number == 0):
            raise self.bad(key, value, "a number of seconds > 0" if positive else ">= 0 seconds")
        if number > maximum:
            raise self.bad(key, value, f"a number of seconds <= {maximum:g}")
        return number

    def items(self, key: str, value: object) -> list[object]:
        """A list, or in .properties files a comma-separated string."""
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return list(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        raise self.bad(key, value, "a list")

    def statuses(self, key: str, value: object) -> frozenset[int]:
        result = []
        for item in self.items(key, value):
            result.append(self.integer(key, item, 100, maximum=599))
        if not result:
            raise self.bad(key, value, "a non-empty list of HTTP status codes")
        return frozenset(result)

    def choice(self, key: str, value: object, choices: tuple[_Choice, ...]) -> _Choice:
        """One of ``choices`` (a Literal type's ``get_args``), typed as that Literal."""
        text = value.strip() if isinstance(value, str) else None
        for choice in choices:
            if choice == text:
                return choice
        raise self.bad(key, value, " or ".join(repr(c) for c in choices))

    def pattern(self, key: str, value: object) -> re.Pattern[str]:
        """A regular expression matched against text (a header value)."""
        return self.compiled(key, value, self.string(key, value))

    def body_pattern(self, key: str, value: object) -> re.Pattern[bytes]:
        """A regular expression searched in response bytes: valid as text, and its UTF-8
        encoding valid as a bytes pattern (``\\u0041`` and ``(?u)`` are text-only)."""
        text = self.pattern(key, value).pattern
        on_bytes = "a regular expression valid on the body's UTF-8 bytes"
        try:
            source = text.encode("utf-8")
        except UnicodeEncodeError:
            raise self.bad(key, value, f"{on_bytes} (no lone surrogates)") from None
        return self.compiled(key, value, source, on_bytes)

    def compiled(
        self,
        key: str,
        value: object,
        source: AnyStr,
        expected: str = "a valid regular expression",
    ) -> re.Pattern[AnyStr]:
        """``re.compile(source)``: whatever it raises for the pattern is a ConfigError (the
        one place configuration compiles a pattern)."""
        try:
            return re.compile(source)
        except (re.error, OverflowError, ValueError) as exc:
            # OverflowError: "the repetition number is too large" (x{4294967296});
            # ValueError: "ASCII and UNICODE flags are incompatible" ((?a)(?u)).
            problem = str(exc)
        except RecursionError:
            # The parser recurses once per nested group.
            problem = "groups nested too deeply"
        except MemoryError:
            problem = "too large to compile"
        raise self.bad(key, value, f"{expected} ({problem})")

    def field_name(self, key: str, value: object) -> str:
        name = self.string(key, value)
        if len(name) > 128 or not name.isprintable():
            raise self.bad(
                key, value, "a form / JSON field name of at most 128 printable characters"
            )
        return name

    def header_name(self, key: str, value: object) -> str:
        name = self.string(key, value)
        if not _HEADER_NAME_RE.fullmatch(name):
            raise self.bad(key, value, "an HTTP header name")
        return name

    # --- sections -------------------------------------------------------------------------

    def check(self, settings: Mapping[str, Any]) -> Config:
        settings = self.mapping("", settings)
        for name in settings:
            if name not in TOP_LEVEL:
                raise self.unknown(name, name, TOP_LEVEL)
        values = {**_TOP_DEFAULTS, **settings}
        project = self.string("project", values["project"])
        if not _SEGMENT_RE.fullmatch(project) or project == "*":
            raise self.bad("project", project, "a name of [A-Za-z0-9._:@-], at most 128 chars")
        limits = self.mapping("limits", values["limits"])
        return Config(
            project=project,
            caller=self.caller(values["caller"]),
            request_id_header=self.header_name("request_id_header", values["request_id_header"]),
            backend=self.backend(values["backend"]),
            routes=self.routes(values["routes"]),
            fault=self.fault(values["fault"]),
            mode=self.choice("mode", values["mode"], MODES),
            on_backend_error=self.choice(
                "on_backend_error", values["on_backend_error"], ON_BACKEND_ERROR
            ),
            ipv6_prefix=self.integer("ipv6_prefix", values["ipv6_prefix"], 1, 128),
            reload=self.reload(values["reload"]),
            limits=MappingProxyType(
                {path: self.limit(path, spec) for path, spec in limits.items()}
            ),
            rejected_log=self.rejected_log(values["rejected_log"]),
            dashboard=self.dashboard(values["dashboard"]),
        )

    def section(self, name: str, value: object) -> dict[str, Any]:
        """A section's keys, checked against its dataclass, over that dataclass's defaults."""
        section = self.mapping(name, value)
        for key in section:
            if key not in SECTIONS[name]:
                raise self.unknown(f"{name}.{key}", key, SECTIONS[name])
        return {**_SECTION_DEFAULTS[name], **section}

    def caller(self, value: object) -> CallerConfig:
        section = self.section("caller", value)
        default = self.string("caller.default", section["default"])
        if not CALLER_RE.fullmatch(default):
            raise self.bad("caller.default", default, "a caller name of [A-Za-z0-9._:@-]")
        resolver = self.dotted("caller.resolver", section["resolver"], "(environ) -> str | None")
        return CallerConfig(
            header=self.header_name("caller.header", section["header"]),
            required=self.boolean("caller.required", section["required"]),
            default=default,
            resolver=resolver,
        )

    def routes(self, value: object) -> Mapping[str, str]:
        routes = self.mapping("routes", value)
        result = {}
        for rule, service in routes.items():
            key = f"routes.{rule}"
            if not rule.startswith("/"):
                raise self.bad(key, rule, "a werkzeug rule starting with '/'")
            name = self.string(key, service)
            if not _SEGMENT_RE.fullmatch(name) or name == "*":
                raise self.bad(key, name, "a service name of [A-Za-z0-9._:@-]")
            checked = Rule(rule, endpoint=name)
            try:
                Map([checked])
            # werkzeug raises TypeError for an unknown converter argument and SyntaxError
            # for a variable named twice, besides ValueError and LookupError.
            except Exception as exc:
                raise self.bad(key, rule, f"a werkzeug rule ({exc})") from None
            numbers = _number_converter_arguments(checked)
            if numbers is not None:
                raise self.bad(key, rule, f"a werkzeug rule ({numbers})")
            result[rule] = name
        return MappingProxyType(result)

    def dotted(self, key: str, value: object, signature: str) -> Callable[..., Any] | None:
        """A callable, or the callable a dotted path (``pkg.mod:func``) names."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if callable(value):
            return value
        if not isinstance(value, str):
            raise self.bad(key, value, f"a dotted path or a callable {signature}")
        try:
            imported = import_string(value.strip())
        except Exception as exc:
            cause = getattr(exc, "exception", exc)  # werkzeug's ImportStringError wraps it
            raise self.bad(
                key, value, f"an importable 'package.module:function' ({cause})"
            ) from None
        if not callable(imported):
            raise self.bad(key, value, f"the path of a callable {signature}")
        return imported  # type: ignore[no-any-return]

    def backend(self, value: object) -> str:
        url = self.no_nul("backend", self.string("backend", value))
        try:
            scheme_of(url)
        except ValueError as exc:
            raise self.error("backend", str(exc)) from None
        return url

    def fault(self, value: object) -> FaultConfig:
        section = self.section("fault", value)
        renderer = self.dotted(
            "fault.renderer",
            section["renderer"],
            "(rejected, request_id, environ) -> (content_type, body)",
        )
        return FaultConfig(
            format=self.choice("fault.format", section["format"], FAULT_FORMATS),
            renderer=renderer,
        )

    def reload(self, value: object) -> ReloadConfig:
        section = self.section("reload", value)
        return ReloadConfig(
            file=self.optional_path("reload.file", section["file"]),
            every_seconds=self.number(
                "reload.every_seconds",
                section["every_seconds"],
                positive=True,
                maximum=MAX_RELOAD_SECONDS,
            ),
            every_requests=self.integer("reload.every_requests", section["every_requests"], 1),
        )

    def rejected_log(self, value: object) -> RejectedLogConfig:
        section = self.section("rejected_log", value)
        names = tuple(
            self.header_name("rejected_log.redact_headers", name)
            for name in self.items("rejected_log.redact_headers", section["redact_headers"])
        )
        fields = tuple(
            self.field_name("rejected_log.redact_fields", name)
            for name in self.items("rejected_log.redact_fields", section["redact_fields"])
        )
        return RejectedLogConfig(
            redact_headers=names,
            redact_fields=fields,
            body_bytes=self.integer(
                "rejected_log.body_bytes", section["body_bytes"], 0, maximum=MAX_LOGGED_BODY
            ),
            queue_size=self.integer(
                "rejected_log.queue_size", section["queue_size"], 1, maximum=MAX_LOG_QUEUE
            ),
        )

    def dashboard(self, value: object) -> DashboardConfig:
        section = self.section("dashboard", value)
        token = section["token"]
        if token is None or token == "":
            return DashboardConfig(token=None)
        # A secret: never quoted in the error (which reaches a log on a failed reload).
        # Printable ASCII, as an Authorization header carries it.
        if not isinstance(token, str) or not (token.isascii() and token.isprintable()):
            raise self.error(
                "dashboard.token",
                "expected a string of printable ASCII characters (what was given is not "
                "shown: the token is a secret)",
            )
        if token != token.strip():
            # All spaces: a "?token=%20" link would let anyone in. Spaces around it: a
            # bearer header's value is read without them, so it could never match.
            raise self.error(
                "dashboard.token",
                "expected a token without spaces around it (what was given is not shown: "
                "the token is a secret)",
            )
        return DashboardConfig(token=token)

    def limit(self, path: str, value: object) -> Limit:
        base = f"limits.{path}"
        spec = self.mapping(base, value)
        segments = tuple(path.split("/"))
        if not 1 <= len(segments) <= 3 or not all(_SEGMENT_RE.fullmatch(s) for s in segments):
            raise self.bad(
                base,
                path,
                "a path 'project', 'project/service' or 'project/service/caller' "
                "of names [A-Za-z0-9._:@-] or '*'",
            )
        for name in spec:
            if name not in LIMIT_FIELDS:
                raise self.unknown(f"{base}.{name}", name, LIMIT_FIELDS)
        level = LEVELS[len(segments) - 1]
        fields: dict[str, Any] = {}
        if "concurrency" in spec:
            concurrency = spec["concurrency"]
            if isinstance(concurrency, str) and concurrency.strip() == "auto":
                adaptive = self.adaptive(f"{base}.adaptive", spec.get("adaptive", {}))
                fields["adaptive"] = adaptive
                fields["concurrency"] = adaptive.max
            elif not isinstance(concurrency, str) or concurrency.strip().lstrip("+-").isdigit():
                fields["concurrency"] = self.integer(f"{base}.concurrency", concurrency, 0)
            else:
                raise self.bad(f"{base}.concurrency", concurrency, 'an integer >= 0 or "auto"')
        if "adaptive" in spec and "adaptive" not in fields:
            raise self.error(
                f"{base}.adaptive",
                "'adaptive' needs concurrency = \"auto\" on the same limit; "
                f"got concurrency {spec.get('concurrency')!r}",
            )
        if "rate" in spec:
            fields["rate"] = self.rate(f"{base}.rate", spec["rate"])
        if not ({"concurrency", "rate", "delay", *_MARKERS} & set(spec)):
            raise self.error(
                base,
                "a limit needs 'concurrency' or 'rate' (or sets delay/markers), "
                f"got {shown(dict(spec))}",
            )
        if "key" in spec:
            if level != "caller":
                raise self.error(
                    f"{base}.key",
                    f"'key' is only valid on the caller level (3 segments), "
                    f"not on the {level} level; got {shown(spec['key'])}",
                )
            fields["key"] = self.key(f"{base}.key", spec["key"])
        if "count" in spec:
            if "rate" not in spec:
                raise self.error(
                    f"{base}.count",
                    f"'count' needs a 'rate' on the same limit; got {shown(spec['count'])}",
                )
            count = spec["count"]
            if not (isinstance(count, str) and count.strip() == "all"):
                fields["count"] = self.statuses(f"{base}.count", count)
        if "max_keys" in spec:
            if "*" not in segments:
                raise self.error(
                    f"{base}.max_keys",
                    "'max_keys' bounds the keys a limit with a '*' segment counts separately; "
                    f"this path has none; got {shown(spec['max_keys'])}",
                )
            fields["max_keys"] = self.integer(f"{base}.max_keys", spec["max_keys"], 1)
        if "delay" in spec:
            fields["delay"] = self.number(f"{base}.delay", spec["delay"])
        markers = _MARKERS & set(spec)
        if markers and level == "caller":
            marker = sorted(markers)[0]
            raise self.error(
                f"{base}.{marker}",
                "timeout markers are settable on the project and service levels only; "
                f"got {shown(spec[marker])}",
            )
        if "timeout_status" in spec:
            fields["timeout_status"] = self.statuses(
                f"{base}.timeout_status", spec["timeout_status"]
            )
        if "timeout_header" in spec:
            fields["timeout_header"] = self.timeout_header(
                f"{base}.timeout_header", spec["timeout_header"]
            )
        if "timeout_body" in spec:
            fields["timeout_body"] = self.body_pattern(f"{base}.timeout_body", spec["timeout_body"])
        if "queue" in spec:
            if not {"concurrency", "rate"} & set(spec):
                raise self.error(
                    f"{base}.queue",
                    "'queue' is where requests wait while this limit is full: it needs "
                    f"'concurrency' or 'rate' on the same limit; got {shown(spec['queue'])}",
                )
            fields["queue"] = self.queue(f"{base}.queue", spec["queue"])
        if "mode" in spec:
            fields["mode"] = self.choice(f"{base}.mode", spec["mode"], MODES)
        return Limit(path=path, segments=segments, **fields)

    def adaptive(self, key: str, value: object) -> AdaptiveSpec:
        """The ``adaptive`` table; in .properties files ``vegas, min=2, max=50``."""
        if isinstance(value, str):
            table: dict[str, object] = {}
            given: dict[str, str] = {}  # name -> the part that set it
            for item in self.items(key, value):
                assert isinstance(item, str)
                name, sep, text = item.partition("=")
                if not sep:
                    name, text = "algorithm", item
                name = name.strip()
                if name in given:
                    # "Last wins" would hide which one the operator meant.
                    raise self.error(
                        f"{key}.{name}",
                        f"given twice: {shown(given[name])}, {shown(item)}; "
                        f"expected each of {', '.join(ADAPTIVE_FIELDS)} at most once",
                    )
                given[name] = item
                table[name] = text.strip()
            value = table
        spec = self.mapping(key, value)
        for name in spec:
            if name not in ADAPTIVE_FIELDS:
                raise self.unknown(f"{key}.{name}", name, ADAPTIVE_FIELDS)
        default = _DEFAULT_ADAPTIVE
        algorithm = self.choice(
            f"{key}.algorithm", spec.get("algorithm", default.algorithm), ALGORITHMS
        )
        low = self.integer(f"{key}.min", spec.get("min", default.min), 1, _ADAPTIVE_MAX)
        high = self.integer(f"{key}.max", spec.get("max", max(low, default.max)), 1, _ADAPTIVE_MAX)
        if high < low:
            raise self.bad(f"{key}.max", spec["max"], f"an integer >= min ({low})")
        if "initial" in spec:
            initial = self.integer(f"{key}.initial", spec["initial"], 1)
            if not low <= initial <= high:
                raise self.bad(
                    f"{key}.initial", spec["initial"], f"min <= initial <= max ({low}..{high})"
                )
        else:
            # The default start (10) moved into the bounds the user gave.
            initial = min(max(default.initial, low), high)
        return AdaptiveSpec(algorithm, low, high, initial)

    def rate(self, key: str, value: object) -> Rate:
        match = _RATE_RE.fullmatch(value) if isinstance(value, str) else None
        if match is None:
            raise self.bad(key, value, "a rate like '5/minute', '100/10s' or '2/h'")
        count, word, multiple, unit = match.groups()
        # float() of any length is inf at worst (out of bounds); int() of thousands of
        # digits is not taken, for a number that long is out of bounds anyway.
        seconds = _UNITS[word] if word else float(multiple or 1) * _SHORT_UNITS[unit]
        quota = int(count) if len(count) <= 12 else MAX_INTEGER + 1
        if not 1 <= quota <= MAX_INTEGER or not 0 < seconds <= MAX_WINDOW:
            raise self.bad(
                key,
                value,
                f"a rate of 1..{MAX_INTEGER} per a window longer than 0 and at most a year",
            )
        assert isinstance(value, str)
        return Rate(limit=quota, seconds=seconds, text=value.strip())

    def key(self, key: str, value: object) -> str:
        text = self.string(key, value)
        if text in ("caller", "ip", "user"):
            return text
        if text.startswith("header:"):
            name = self.header_name(key, text[len("header:") :].strip())
            return f"header:{name}"
        raise self.bad(key, value, "'caller', 'ip', 'user' or 'header:<Name>'")

    def timeout_header(self, key: str, value: object) -> TimeoutHeader:
        text = self.string(key, value)
        name, sep, regex = text.partition(":")
        if not sep or not _HEADER_NAME_RE.fullmatch(name.strip()) or not regex.strip():
            raise self.bad(key, value, "'Header-Name: regex'")
        return TimeoutHeader(name=name.strip(), pattern=self.pattern(key, regex.strip()), text=text)

    def queue(self, key: str, value: object) -> QueueSpec:
        if isinstance(value, str):
            parts: list[object] = [part.strip() for part in value.split(",")]
            if len(parts) != 2:
                raise self.bad(key, value, "'<size>, <wait seconds>'")
            size, wait = parts
        else:
            spec = self.mapping(key, value)
            for name in spec:
                if name not in _QUEUE_FIELDS:
                    raise self.unknown(f"{key}.{name}", name, _QUEUE_FIELDS)
            if "size" not in spec or "wait" not in spec:
                raise self.bad(key, value, "{'size': int, 'wait': seconds}")
            size, wait = spec["size"], spec["wait"]
        return QueueSpec(
            size=self.integer(f"{key}.size", size, 1),
            wait=self.number(f"{key}.wait", wait, positive=True),
        )


ConfigSource = Mapping[str, Any] | str | os.PathLike[str]


def config_file(source: ConfigSource) -> str | None:
    """The configuration file a source names: the path itself, or ``reload.file``."""
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    reload = source.get("reload")
    file = reload.get("file") if isinstance(reload, Mapping) else None
    return os.fspath(file) if isinstance(file, (str, os.PathLike)) and os.fspath(file) else None


def expand_source(source: ConfigSource) -> ConfigSource:
    """A configuration file whose ``reload.file`` names another file, read as settings
    that file is laid over (and watched), as a settings dict's ``reload.file`` is: the
    three forms of one configuration (dict, TOML, .properties) behave the same. A
    relative ``reload.file`` is found beside the file that names it. The file itself is
    validated first, so its errors name its own lines. Any other source as it is."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    path = os.fspath(source)
    from gatekeeper_wsgi.fileformats import load_file

    settings, lines = load_file(path, settings_keys=TOP_LEVEL)
    named = _other_file(settings, path)
    if named is None:
        return source
    build_config(settings, file=path, lines=lines)
    return {**settings, "reload": {**settings["reload"], "file": named}}


def _other_file(settings: Mapping[str, Any], file: str) -> str | None:
    """The file the ``reload.file`` of ``settings``, read from ``file``, names (a relative
    name beside ``file``), when it names one other than ``file`` itself."""
    reload = settings.get("reload")
    named = reload.get("file") if isinstance(reload, Mapping) else None
    if not isinstance(named, str) or not named:
        return None
    named = os.path.join(os.path.dirname(file), named)
    return None if os.path.abspath(named) == os.path.abspath(file) else named


def load_config(
    source: ConfigSource,
    *,
    code_limits: Mapping[str, Mapping[str, Any]] | None = None,
    data: bytes | None = None,
) -> Config:
    """The validated configuration of a settings dict (with its ``reload.file`` laid over
    it) or of a configuration file (with the one its ``reload.file`` names laid over it:
    :func:`expand_source`), plus limits defined in code (framework decorators), which the
    settings and the file override path by path. ``data`` is the content of the file laid
    over when the caller has read it already. Raises ConfigError."""
    if data is None:
        source = expand_source(source)
    if isinstance(source, (str, os.PathLike)):
        settings: Mapping[str, Any] = {}
    elif isinstance(source, Mapping):
        settings = source
    else:
        raise ConfigError("", f"expected a settings dict or a file path, got {shown(source)}")
    if code_limits:
        limits = settings.get("limits")
        limits = limits if isinstance(limits, Mapping) else {}
        settings = {**settings, "limits": {**code_limits, **limits}}
    file = config_file(source)
    if file is None:
        return build_config(settings)
    from gatekeeper_wsgi.fileformats import load_file

    file_settings, lines = load_file(file, data, settings_keys=TOP_LEVEL)
    if settings or data is not None:
        # ``data`` of the file alone: its reload (or its read at start-up, after
        # expand_source found it naming no other file).
        _check_no_other_file(file_settings, file, lines, laid_over=bool(settings))
    merged = merge_settings(settings, file_settings)
    return build_config(merged, file=file, lines=lines, whole_file=not settings)


def _check_no_other_file(
    file_settings: Mapping[str, Any], file: str, lines: Mapping[str, int], *, laid_over: bool
) -> None:
    """The file watched cannot name another one: a ``reload.file`` of its own would be
    reported (status page, ``gatekeeper check``) yet never read. The file laid over
    settings never can; a configuration file read alone can at start-up (expand_source),
    and a reload that starts naming one fails (the other file is laid over by a restart)."""
    if _other_file(file_settings, file) is not None:
        why = (
            "the file laid over the settings cannot name another file"
            if laid_over
            else "a reload cannot lay another file over this one (a restart does)"
        )
        raise ConfigError(
            "reload.file",
            f"{why}; got {shown(file_settings['reload']['file'])}",
            file=file,
            line=lines.get("reload.file"),
        )


def located(error: ConfigError, file: str | None) -> ConfigError:
    """``error`` (raised past validation, e.g. by a backend parsing its URL) with the file
    and line of its key, when the configuration ``file`` holds that key; otherwise
    ``error`` itself."""
    if file is None or error.file is not None or not error.key:
        return error
    from gatekeeper_wsgi.fileformats import load_file

    try:
        _, lines = load_file(file, settings_keys=TOP_LEVEL)
        line = lines.get(error.key)
    except ConfigError:
        return error  # the file changed meanwhile: say what is known
    if line is None:
        return error  # the key came from the settings the file was laid over
    return ConfigError(error.key, error.problem, file=file, line=line)


def check_limit(path: str, fields: Mapping[str, Any]) -> Limit:
    """One limit defined in code (a framework decorator) at ``path``, checked by the rules
    of a configured one; raises :class:`ConfigError` keyed ``limits.<path>.<field>``."""
    return _Checker(None, None, whole_file=True).limit(path, fields)


def build_config(
    settings: Mapping[str, Any],
    *,
    file: str | None = None,
    lines: Mapping[str, int] | None = None,
    whole_file: bool = True,
) -> Config:
    """Validate a settings dict and return the immutable :class:`Config`.

    ``file`` and ``lines`` (dotted key -> line number) let errors point into a file;
    ``whole_file=False`` says the file was laid over settings, so a key it does not hold
    came from the settings. Raises :class:`~gatekeeper_wsgi.errors.ConfigError`.
    """
    return _Checker(file, lines, whole_file).check(settings)
