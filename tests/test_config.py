"""The configuration model: one validated, immutable Config from a dict, TOML or .properties."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi.config import Config, QueueSpec, Rate, build_config
from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.fileformats import load_file

# One configuration that uses every section and every limit field, in the three forms.
FULL_SETTINGS: dict[str, Any] = {
    "project": "shop",
    "caller": {"header": "X-Caller-Id", "required": True, "default": "guest"},
    "request_id_header": "X-Correlation-Id",
    "backend": "memory",
    "routes": {"/orders/<int:id>": "order"},
    "fault": {"format": "json"},
    "mode": "enforce",
    "on_backend_error": "reject",
    "reload": {"every_seconds": 2.5, "every_requests": 100},
    "rejected_log": {"redact_headers": ["X-Api-Key", "X-Secret"], "body_bytes": 512},
    "limits": {
        "shop": {"concurrency": 100, "delay": 2.0, "timeout_status": [502, 504]},
        "shop/checkout": {
            "concurrency": 10,
            "queue": {"size": 20, "wait": 1.5},
            "timeout_header": "X-Fault-Code: TIMEOUT|EXPIRED",
            "timeout_body": r"Timeout\s+expired",
        },
        "shop/checkout/crm": {"concurrency": 2, "delay": 5.0},
        "shop/login/*": {"rate": "5/minute", "key": "ip", "count": [401, 403], "max_keys": 5000},
        "shop/api/*": {"rate": "100/10s", "key": "header:X-Api-Key", "mode": "shadow"},
        "*/*/batch": {"concurrency": 1},
    },
}

FULL_TOML = r"""
[gatekeeper]
project = "shop"
request_id_header = "X-Correlation-Id"
backend = "memory"
mode = "enforce"
on_backend_error = "reject"

[gatekeeper.caller]
header = "X-Caller-Id"
required = true
default = "guest"

[gatekeeper.routes]
"/orders/<int:id>" = "order"

[gatekeeper.fault]
format = "json"

[gatekeeper.reload]
every_seconds = 2.5
every_requests = 100

[gatekeeper.rejected_log]
redact_headers = ["X-Api-Key", "X-Secret"]
body_bytes = 512

[gatekeeper.limits]
shop = { concurrency = 100, delay = 2.0, timeout_status = [502, 504] }
"shop/checkout/crm" = { concurrency = 2, delay = 5.0 }
"*/*/batch" = { concurrency = 1 }

[gatekeeper.limits."shop/checkout"]
concurrency = 10
queue = { size = 20, wait = 1.5 }
timeout_header = "X-Fault-Code: TIMEOUT|EXPIRED"
timeout_body = 'Timeout\s+expired'

[gatekeeper.limits."shop/login/*"]
rate = "5/minute"
key = "ip"
count = [401, 403]
max_keys = 5000

[gatekeeper.limits."shop/api/*"]
rate = "100/10s"
key = "header:X-Api-Key"
mode = "shadow"
"""

FULL_PROPERTIES = r"""
# the operators' file
project = shop
caller.header = X-Caller-Id
caller.required = true
caller.default : guest
request_id_header = X-Correlation-Id
backend = memory
routes./orders/<int\:id> = order
fault.format = json
mode = enforce
on_backend_error = reject
reload.every_seconds = 2.5
reload.every_requests = 100
rejected_log.redact_headers = X-Api-Key, X-Secret
rejected_log.body_bytes = 512
limits.shop.concurrency = 100
limits.shop.delay = 2.0
limits.shop.timeout_status = 502, 504
limits.shop/checkout.concurrency = 10
limits.shop/checkout.queue = 20, 1.5
limits.shop/checkout.timeout_header = X-Fault-Code: TIMEOUT|EXPIRED
limits.shop/checkout.timeout_body = Timeout\\s+expired
limits.shop/checkout/crm.concurrency = 2
limits.shop/checkout/crm.delay = 5.0
limits.shop/login/*.rate = 5/minute
limits.shop/login/*.key = ip
limits.shop/login/*.count = 401, \
                            403
limits.shop/login/*.max_keys = 5000
limits.shop/api/*.rate = 100/10s
limits.shop/api/*.key = header:X-Api-Key
limits.shop/api/*.mode = shadow
limits.*/*/batch.concurrency = 1
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def from_file(path: Path) -> Config:
    settings, lines = load_file(path)
    return build_config(settings, file=str(path), lines=lines)


def config_error(settings: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build_config(settings)
    return info.value


# ------------------------------------------------------------------ one model, three forms


def test_dict_toml_and_properties_build_equal_configs(tmp_path: Path) -> None:
    """The same configuration written as a dict, TOML or .properties is the same Config."""
    from_dict = build_config(FULL_SETTINGS)
    from_toml = from_file(write(tmp_path, "gatekeeper.toml", FULL_TOML))
    from_properties = from_file(write(tmp_path, "gatekeeper.properties", FULL_PROPERTIES))
    assert from_toml == from_dict
    assert from_properties == from_dict


def test_gatekeeper_accepts_each_form(tmp_path: Path) -> None:
    """GateKeeper(dict), GateKeeper("x.toml") and GateKeeper("x.properties") agree."""
    toml_path = write(tmp_path, "gatekeeper.toml", FULL_TOML)
    properties_path = write(tmp_path, "gatekeeper.properties", FULL_PROPERTIES)
    expected = GateKeeper(FULL_SETTINGS).config
    assert GateKeeper(toml_path).config == expected
    assert GateKeeper(str(properties_path)).config == expected


def test_toml_at_top_level_equals_gatekeeper_table(tmp_path: Path) -> None:
    """A TOML file may hold the settings at top level instead of under [gatekeeper]."""
    top_level = FULL_TOML.replace("[gatekeeper]\n", "").replace("[gatekeeper.", "[")
    assert from_file(write(tmp_path, "top.toml", top_level)) == build_config(FULL_SETTINGS)


def test_config_values_are_converted(tmp_path: Path) -> None:
    """Strings from .properties become the typed values the engine uses."""
    config = from_file(write(tmp_path, "gatekeeper.properties", FULL_PROPERTIES))
    checkout = config.limits["shop/checkout"]
    assert checkout.queue == QueueSpec(size=20, wait=1.5)
    assert checkout.timeout_header is not None
    assert checkout.timeout_header.name == "X-Fault-Code"
    assert checkout.timeout_header.pattern.search("EXPIRED")
    assert checkout.timeout_body is not None
    assert checkout.timeout_body.search(b"<x>Timeout   expired</x>")
    login = config.limits["shop/login/*"]
    assert login.rate == Rate(limit=5, seconds=60.0, text="5/minute")
    assert login.count == frozenset({401, 403})
    assert (login.key, login.level, login.wildcard) == ("ip", "caller", True)
    assert config.limits["shop"].timeout_status == frozenset({502, 504})
    assert config.caller.required is True
    assert config.reload.every_seconds == 2.5
    assert config.rejected_log.redact_headers == ("X-Api-Key", "X-Secret")


def test_differences_are_seen() -> None:
    """Two configurations that differ in one limit field do not compare equal."""
    changed = {**FULL_SETTINGS, "limits": {**FULL_SETTINGS["limits"], "shop": {"concurrency": 99}}}
    assert build_config(changed) != build_config(FULL_SETTINGS)


def test_config_is_immutable() -> None:
    """A built Config cannot be changed behind the engine's back."""
    config = build_config(FULL_SETTINGS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.project = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.limits["shop"] = config.limits["shop/checkout"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.limits["shop"].concurrency = 1  # type: ignore[misc]


def test_defaults() -> None:
    """An empty settings dict is a valid configuration with the documented defaults."""
    config = build_config({})
    assert config.project == "default"
    assert config.caller.header == "X-Caller-Id"
    assert config.caller.default == "anonymous"
    assert config.caller.required is False
    assert config.backend == "memory"
    assert config.mode == "enforce"
    assert config.on_backend_error == "allow"
    assert (config.reload.every_seconds, config.reload.every_requests) == (5.0, 1000)
    assert dict(config.limits) == {}
    assert config == Config()


# ------------------------------------------------------------------------- rate parsing


@pytest.mark.parametrize(
    ("text", "limit", "seconds"),
    [
        ("5/second", 5, 1.0),
        ("5/minute", 5, 60.0),
        ("2/hour", 2, 3600.0),
        ("1000/day", 1000, 86400.0),
        ("100/10s", 100, 10.0),
        ("7/s", 7, 1.0),
        ("7/m", 7, 60.0),
        ("2/h", 2, 3600.0),
        ("3/2h", 3, 7200.0),
        ("3/5m", 3, 300.0),
        ("10/1.5s", 10, 1.5),
        (" 5 / minute ", 5, 60.0),
    ],
)
def test_rate_parsing(text: str, limit: int, seconds: float) -> None:
    """Rates read as N per second/minute/hour/day or per <k> s/m/h."""
    rate = build_config({"limits": {"shop": {"rate": text}}}).limits["shop"].rate
    assert rate is not None
    assert (rate.limit, rate.seconds) == (limit, seconds)
    assert rate.text == text.strip()


@pytest.mark.parametrize(
    "text",
    ["5", "5/", "/minute", "five/minute", "5/week", "5/minutes", "0/minute", "-1/second", "5/0s"],
)
def test_malformed_rates_are_rejected(text: str) -> None:
    """A rate that is not 'N/unit' with N >= 1 is a ConfigError quoting it."""
    error = config_error({"limits": {"shop": {"rate": text}}})
    assert error.key == "limits.shop.rate"
    assert repr(text) in str(error)
    assert "rate" in error.problem


# ------------------------------------------------------------------------ invalid input

# id, settings, key named, value shown, expectation stated
INVALID_SETTINGS: list[tuple[str, dict[str, Any], str, str, str]] = [
    ("unknown top-level key", {"limts": {}}, "limts", "'limts'", "did you mean 'limits'"),
    (
        "unknown limit field",
        {"limits": {"shop": {"concurency": 1}}},
        "limits.shop.concurency",
        "'concurency'",
        "did you mean 'concurrency'",
    ),
    (
        "unknown section key",
        {"caller": {"heder": "X"}},
        "caller.heder",
        "'heder'",
        "did you mean 'header'",
    ),
    (
        "negative concurrency",
        {"limits": {"shop": {"concurrency": -1}}},
        "limits.shop.concurrency",
        "-1",
        "an integer >= 0",
    ),
    (
        "concurrency of the wrong type",
        {"limits": {"shop": {"concurrency": "ten"}}},
        "limits.shop.concurrency",
        "'ten'",
        "an integer >= 0",
    ),
    (
        "boolean is not a number",
        {"limits": {"shop": {"concurrency": True}}},
        "limits.shop.concurrency",
        "True",
        "an integer >= 0",
    ),
    (
        "malformed rate",
        {"limits": {"shop": {"rate": "5 per minute"}}},
        "limits.shop.rate",
        "'5 per minute'",
        "a rate like '5/minute'",
    ),
    (
        "key on the service level",
        {"limits": {"shop/login": {"concurrency": 1, "key": "ip"}}},
        "limits.shop/login.key",
        "'ip'",
        "only valid on the caller level",
    ),
    (
        "key on the project level",
        {"limits": {"shop": {"concurrency": 1, "key": "user"}}},
        "limits.shop.key",
        "'user'",
        "only valid on the caller level",
    ),
    (
        "unknown key kind",
        {"limits": {"shop/login/*": {"concurrency": 1, "key": "cookie"}}},
        "limits.shop/login/*.key",
        "'cookie'",
        "'caller', 'ip', 'user' or 'header:<Name>'",
    ),
    (
        "timeout status on the caller level",
        {"limits": {"shop/api/*": {"concurrency": 1, "timeout_status": [504]}}},
        "limits.shop/api/*.timeout_status",
        "[504]",
        "project and service levels only",
    ),
    (
        "timeout header on the caller level",
        {"limits": {"shop/api/crm": {"concurrency": 1, "timeout_header": "X-F: T"}}},
        "limits.shop/api/crm.timeout_header",
        "'X-F: T'",
        "project and service levels only",
    ),
    (
        "bad regex in timeout_body",
        {"limits": {"shop": {"concurrency": 1, "timeout_body": "Timeout("}}},
        "limits.shop.timeout_body",
        "'Timeout('",
        "a valid regular expression",
    ),
    (
        "bad regex in timeout_header",
        {"limits": {"shop": {"concurrency": 1, "timeout_header": "X-Fault: [A-"}}},
        "limits.shop.timeout_header",
        "'[A-'",
        "a valid regular expression",
    ),
    (
        "repeat count over the regex engine's maximum in timeout_body",
        {"limits": {"shop": {"concurrency": 1, "timeout_body": "x{99999999999}"}}},
        "limits.shop.timeout_body",
        "'x{99999999999}'",
        "a valid regular expression (the repetition number is too large)",
    ),
    (
        "repeat count over the regex engine's maximum in timeout_header",
        {"limits": {"shop": {"concurrency": 1, "timeout_header": "X-A: x{4294967296}"}}},
        "limits.shop.timeout_header",
        "'x{4294967296}'",
        "a valid regular expression (the repetition number is too large)",
    ),
    (
        "regex flags the engine refuses together",
        {"limits": {"shop": {"concurrency": 1, "timeout_body": "(?a)(?u)x"}}},
        "limits.shop.timeout_body",
        "'(?a)(?u)x'",
        "a valid regular expression (ASCII and UNICODE flags are incompatible)",
    ),
    (
        "text-only escape in timeout_body, searched in bytes",
        {"limits": {"shop": {"concurrency": 1, "timeout_body": "\\u0041"}}},
        "limits.shop.timeout_body",
        "'\\\\u0041'",
        "a regular expression valid on the body's UTF-8 bytes (bad escape",
    ),
    (
        "lone surrogate in timeout_body",
        {"limits": {"shop": {"concurrency": 1, "timeout_body": "\ud800"}}},
        "limits.shop.timeout_body",
        "'\\ud800'",
        "(no lone surrogates)",
    ),
    (
        "timeout_header without a name",
        {"limits": {"shop": {"concurrency": 1, "timeout_header": "TIMEOUT"}}},
        "limits.shop.timeout_header",
        "'TIMEOUT'",
        "'Header-Name: regex'",
    ),
    (
        "timeout status out of range",
        {"limits": {"shop": {"concurrency": 1, "timeout_status": [504, 999]}}},
        "limits.shop.timeout_status",
        "999",
        "expected an integer >= 100 and <= 599",
    ),
    (
        "count without rate",
        {"limits": {"shop/login/*": {"concurrency": 1, "count": [401]}}},
        "limits.shop/login/*.count",
        "[401]",
        "needs a 'rate'",
    ),
    (
        "max_keys on a limit without a wildcard",
        {"limits": {"shop/checkout": {"concurrency": 5, "max_keys": 10}}},
        "limits.shop/checkout.max_keys",
        "10",
        "with a '*' segment",
    ),
    (
        "queue on a limit that counts nothing",
        {"limits": {"shop": {"delay": 2, "queue": {"size": 5, "wait": 1}}}},
        "limits.shop.queue",
        "{'size': 5, 'wait': 1}",
        "needs 'concurrency' or 'rate'",
    ),
    (
        "queue of size zero",
        {"limits": {"shop": {"concurrency": 1, "queue": {"size": 0, "wait": 1}}}},
        "limits.shop.queue.size",
        "0",
        "an integer >= 1",
    ),
    (
        "queue without wait",
        {"limits": {"shop": {"concurrency": 1, "queue": {"size": 5}}}},
        "limits.shop.queue",
        "{'size': 5}",
        "{'size': int, 'wait': seconds}",
    ),
    (
        "queue string with one part",
        {"limits": {"shop": {"concurrency": 1, "queue": "20"}}},
        "limits.shop.queue",
        "'20'",
        "'<size>, <wait seconds>'",
    ),
    (
        "queue waiting no time",
        {"limits": {"shop": {"concurrency": 1, "queue": {"size": 5, "wait": 0}}}},
        "limits.shop.queue.wait",
        "0",
        "> 0",
    ),
    ("bad global mode", {"mode": "log"}, "mode", "'log'", "'enforce' or 'shadow'"),
    (
        "bad limit mode",
        {"limits": {"shop": {"concurrency": 1, "mode": "off"}}},
        "limits.shop.mode",
        "'off'",
        "'enforce' or 'shadow'",
    ),
    (
        "path with four segments",
        {"limits": {"a/b/c/d": {"concurrency": 1}}},
        "limits.a/b/c/d",
        "'a/b/c/d'",
        "'project/service/caller'",
    ),
    (
        "path with an empty segment",
        {"limits": {"shop//crm": {"concurrency": 1}}},
        "limits.shop//crm",
        "'shop//crm'",
        "'project/service/caller'",
    ),
    (
        "path with a space",
        {"limits": {"shop/check out": {"concurrency": 1}}},
        "limits.shop/check out",
        "'shop/check out'",
        "'project/service/caller'",
    ),
    (
        "path with a partial wildcard",
        {"limits": {"shop/log*": {"concurrency": 1}}},
        "limits.shop/log*",
        "'shop/log*'",
        "or '*'",
    ),
    (
        "limit that limits nothing",
        {"limits": {"shop": {}}},
        "limits.shop",
        "{}",
        "'concurrency' or 'rate'",
    ),
    (
        "limits not a table",
        {"limits": ["shop"]},
        "limits",
        "['shop']",
        "a table / dict",
    ),
    ("negative delay", {"limits": {"shop": {"delay": -2}}}, "limits.shop.delay", "-2", ">= 0"),
    (
        "max_keys zero",
        {"limits": {"shop/*": {"concurrency": 1, "max_keys": 0}}},
        "limits.shop/*.max_keys",
        "0",
        "an integer >= 1",
    ),
    ("wildcard project", {"project": "*"}, "project", "'*'", "a name of"),
    (
        "caller.required not a boolean",
        {"caller": {"required": "maybe"}},
        "caller.required",
        "'maybe'",
        "true or false",
    ),
    (
        "caller header not a header name",
        {"caller": {"header": "X Caller"}},
        "caller.header",
        "'X Caller'",
        "an HTTP header name",
    ),
    (
        "bad on_backend_error",
        {"on_backend_error": "ignore"},
        "on_backend_error",
        "'ignore'",
        "'allow' or 'reject'",
    ),
    ("bad fault format", {"fault": {"format": "html"}}, "fault.format", "'html'", "'xml'"),
    (
        "reload every zero seconds",
        {"reload": {"every_seconds": 0}},
        "reload.every_seconds",
        "0",
        "> 0",
    ),
    (
        "route not starting with a slash",
        {"routes": {"orders": "order"}},
        "routes.orders",
        "'orders'",
        "starting with '/'",
    ),
    (
        "route converter given an unknown argument",
        {"routes": {"/o/<int(foo=1):id>": "order"}},
        "routes./o/<int(foo=1):id>",
        "'/o/<int(foo=1):id>'",
        "a werkzeug rule (",
    ),
    (
        "route naming a variable twice",
        {"routes": {"/<path:a>/<path:a>": "order"}},
        "routes./<path:a>/<path:a>",
        "'/<path:a>/<path:a>'",
        "a werkzeug rule (",
    ),
    (
        # werkzeug takes min=x as the text "x" and fails only when a request is matched
        "route number converter with a bound that is no number",
        {"routes": {"/o/<int(min=x):id>": "order"}},
        "routes./o/<int(min=x):id>",
        "'/o/<int(min=x):id>'",
        "id: min must be a number, got 'x'",
    ),
    (
        "route number converter with fixed_digits that are no number",
        {"routes": {"/o/<int(fixed_digits=x):f>": "order"}},
        "routes./o/<int(fixed_digits=x):f>",
        "'/o/<int(fixed_digits=x):f>'",
        "fixed_digits must be a whole number",
    ),
]


@pytest.mark.parametrize(
    "spec",
    [
        {"timeout_body": "(" * 5000 + ")" * 5000},
        {"timeout_header": "X-A: " + "(" * 5000 + "x" + ")" * 5000},
    ],
    ids=["timeout_body", "timeout_header"],
)
def test_regexes_nested_too_deeply_are_config_errors(spec: dict[str, str]) -> None:
    """5 000 nested groups: a ConfigError naming the key, not a RecursionError."""
    (name,) = spec
    with pytest.raises(ConfigError) as info:
        GateKeeper({"limits": {"shop": {"concurrency": 1, **spec}}})
    assert info.value.key == f"limits.shop.{name}"
    assert "a valid regular expression (groups nested too deeply)" in info.value.problem


def test_a_few_hundred_nested_groups_are_a_valid_regex() -> None:
    """Nesting the regex engine can compile is accepted."""
    nested = "(" * 200 + "Timeout" + ")" * 200
    limit = build_config({"limits": {"shop": {"concurrency": 1, "timeout_body": nested}}})
    body = limit.limits["shop"].timeout_body
    assert body is not None and body.search(b"a Timeout")


@pytest.mark.parametrize(
    ("settings", "key", "value", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in INVALID_SETTINGS],
)
def test_invalid_settings_name_key_value_and_expectation(
    settings: dict[str, Any], key: str, value: str, expected: str
) -> None:
    """Every invalid setting is a ConfigError that names the key, the value and what is expected."""
    error = config_error(settings)
    message = str(error)
    assert error.key == key
    assert message.startswith(f"{key}: ")
    assert value in message
    assert expected in message
    assert error.file is None


def test_there_are_at_least_fifteen_distinct_invalid_inputs() -> None:
    """The invalid-input table covers at least 15 distinct mistakes with distinct messages."""
    messages = {str(config_error(case[1])) for case in INVALID_SETTINGS}
    assert len(messages) == len(INVALID_SETTINGS) >= 15


def test_config_error_is_a_value_error() -> None:
    """ConfigError can be caught as ValueError by code that knows nothing of gatekeeper."""
    with pytest.raises(ValueError, match="did you mean 'project'"):
        build_config({"projct": "shop"})


def test_unknown_backend_scheme_fails_at_construction() -> None:
    """An unknown backend URL is refused when the GateKeeper is built, quoting the URL."""
    with pytest.raises(ConfigError) as info:
        GateKeeper({"backend": "mongodb://db:27017"})
    message = str(info.value)
    assert info.value.key == "backend"
    assert "'mongodb://db:27017'" in message
    assert "memory" in message and "redis" in message and "shared" in message


def test_memory_backend_takes_no_address() -> None:
    """'memory://somewhere' is a mistake, not silently the local memory backend."""
    with pytest.raises(ConfigError, match="memory://somewhere"):
        GateKeeper({"backend": "memory://somewhere"})


def test_gatekeeper_rejects_other_config_types() -> None:
    """Passing neither a dict nor a path is a ConfigError saying what was expected."""
    with pytest.raises(ConfigError, match="a settings dict or a file path"):
        GateKeeper(42)  # type: ignore[arg-type]


# --------------------------------------------------------------- invalid files: file:line

INVALID_FILES: list[tuple[str, str, str, int, str]] = [
    (
        "negative concurrency in properties",
        "gatekeeper.properties",
        """\
        project = shop
        limits.shop.concurrency = -1
        """,
        2,
        "limits.shop.concurrency: expected an integer >= 0, got '-1'",
    ),
    (
        "unknown key in properties",
        "gatekeeper.properties",
        """\
        project = shop
        # comment
        limits.shop.concurency = 5
        """,
        3,
        "limits.shop.concurency: unknown key 'concurency'; did you mean 'concurrency'?",
    ),
    (
        "duplicate property key",
        "gatekeeper.properties",
        """\
        limits.shop.concurrency = 5
        project = shop
        limits.shop.concurrency = 6
        """,
        3,
        "limits.shop.concurrency: duplicate key, already set on line 1",
    ),
    (
        "malformed queue in properties",
        "gatekeeper.properties",
        """\
        limits.shop.concurrency = 5
        limits.shop.queue = 20; 1.5
        """,
        2,
        "limits.shop.queue: expected '<size>, <wait seconds>', got '20; 1.5'",
    ),
    (
        "TOML syntax error",
        "gatekeeper.toml",
        """\
        [gatekeeper]
        project = "shop"

        [gatekeeper.limits.shop]
        concurrency =
        """,
        5,
        "invalid TOML",
    ),
    (
        "TOML wrong type",
        "gatekeeper.toml",
        """\
        [gatekeeper]
        project = "shop"

        [gatekeeper.limits."shop/checkout"]
        concurrency = 10
        delay = "soon"
        """,
        6,
        "limits.shop/checkout.delay: expected a number of seconds, got 'soon'",
    ),
    (
        "TOML key on a non-caller level",
        "gatekeeper.toml",
        """\
        [gatekeeper.limits]
        shop = { concurrency = 10 }
        "shop/login" = { rate = "5/minute", key = "ip" }
        """,
        3,
        "limits.shop/login.key: 'key' is only valid on the caller level",
    ),
    (
        "TOML limits table beside [gatekeeper]",
        "gatekeeper.toml",
        """\
        [gatekeeper]
        project = "shop"

        [limits.shop]
        concurrency = 10
        """,
        4,
        "limits: beside the [gatekeeper] table, where it would be ignored; "
        "move it under [gatekeeper]",
    ),
    (
        "TOML top-level key before [gatekeeper]",
        "gatekeeper.toml",
        """\
        # operators' file
        backend = "redis://cache:6379/0"

        [gatekeeper]
        project = "shop"
        """,
        2,
        "backend: beside the [gatekeeper] table",
    ),
    (
        "TOML dotted key beside [gatekeeper]",
        "gatekeeper.toml",
        """\
        project = "shop"
        limits.shop.concurrency = 3
        [gatekeeper.limits.shop]
        concurrency = 10
        """,
        1,
        "project: beside the [gatekeeper] table",
    ),
]


def test_properties_continuation_at_end_of_file_is_dropped(tmp_path: Path) -> None:
    """`limits.shop.concurrency = 5\\` as the last line reads as 5, as Java's
    Properties.load reads it (the backslash continues into nothing)."""
    path = write(tmp_path, "gatekeeper.properties", "project = shop\nlimits.shop.concurrency = 5\\")
    gk = GateKeeper(path)
    assert gk.config.limits["shop"].concurrency == 5
    gk.close()


@pytest.mark.parametrize(
    ("name", "text", "line", "expected"),
    [pytest.param(*case[1:], id=case[0]) for case in INVALID_FILES],
)
def test_invalid_files_name_file_and_line(
    tmp_path: Path, name: str, text: str, line: int, expected: str
) -> None:
    """A bad file is a ConfigError pointing at file:line with key, value and expectation."""
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        GateKeeper(path)
    error = info.value
    assert (error.file, error.line) == (str(path), line)
    assert str(error).startswith(f"{path}:{line}: ")
    assert expected in str(error)


def test_toml_other_tables_beside_gatekeeper_are_allowed(tmp_path: Path) -> None:
    """A TOML file shared with other settings keeps its own tables beside [gatekeeper]."""
    path = write(
        tmp_path,
        "app.toml",
        """\
        title = "shop site"

        [database]
        url = "postgres://db/shop"

        [gatekeeper]
        project = "shop"

        [gatekeeper.limits.shop]
        concurrency = 10

        [tool.other]
        mode = "unrelated"
        """,
    )
    config = GateKeeper(path).config
    assert config.project == "shop"
    assert config.limits["shop"].concurrency == 10
    assert config.mode == "enforce"


def test_toml_without_gatekeeper_table_still_refuses_unknown_keys(tmp_path: Path) -> None:
    """Without a [gatekeeper] table, every top-level key is a setting: unknown ones fail."""
    path = write(tmp_path, "gatekeeper.toml", 'project = "shop"\n\n[database]\nurl = "x"\n')
    with pytest.raises(ConfigError, match="unknown key 'database'") as info:
        GateKeeper(path)
    assert (info.value.file, info.value.line) == (str(path), 3)


HUGE = "9" * 5000
BIG = 10**13


def _shop(**fields: Any) -> dict[str, Any]:
    return {"limits": {"shop": {"concurrency": 1, **fields}}}


@pytest.mark.parametrize(
    ("text", "settings"),
    [
        ("limits.shop.concurrency = 9999999999999", _shop(concurrency=BIG)),
        (f"limits.shop.concurrency = {HUGE}", _shop(concurrency=BIG)),
        ("limits.shop.concurrency = -9999999999999", _shop(concurrency=-BIG)),
        ("reload.every_requests = 9999999999999", {"reload": {"every_requests": BIG}}),
        (
            "limits.shop/*/*.concurrency = 1\nlimits.shop/*/*.max_keys = 99999999999999",
            {"limits": {"shop/*/*": {"concurrency": 1, "max_keys": BIG}}},
        ),
        ("ipv6_prefix = 9999999999999", {"ipv6_prefix": BIG}),
        ("rejected_log.queue_size = 9999999999999", {"rejected_log": {"queue_size": BIG}}),
        (
            "limits.shop.concurrency = 1\nlimits.shop.timeout_status = 9999999999999",
            _shop(timeout_status=[BIG]),
        ),
        (
            "limits.shop.concurrency = 1\nlimits.shop.queue = 99999999999999, 1",
            _shop(queue={"size": BIG, "wait": 1}),
        ),
        (
            "limits.shop.concurrency = auto\nlimits.shop.adaptive = max=99999999999999",
            _shop(concurrency="auto", adaptive={"max": BIG}),
        ),
    ],
    ids=[
        "13 digits",
        "5000 digits",
        "negative",
        "every_requests",
        "max_keys",
        "ipv6_prefix",
        "queue_size",
        "timeout_status",
        "queue size",
        "adaptive max",
    ],
)
def test_long_integers_in_files_state_the_bound_of_the_dict_form(
    tmp_path: Path, text: str, settings: dict[str, Any]
) -> None:
    """An integer of many digits in a file is refused with the bound the dict form states."""
    expected = config_error(settings)
    path = write(tmp_path, "gatekeeper.properties", f"project = shop\n{text}\n")
    with pytest.raises(ConfigError) as info:
        GateKeeper(path)
    error = info.value
    assert (error.key, error.file, error.line) == (expected.key, str(path), text.count("\n") + 2)
    assert error.problem.partition(", got")[0] == expected.problem.partition(", got")[0]
    assert len(str(error)) < 400


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        (
            f'[gatekeeper]\nproject = "shop"\n\n[gatekeeper.limits.shop]\nconcurrency = {HUGE}\n',
            "limits.shop.concurrency",
            5,
        ),
        (
            f'project = "shop"\n[limits."shop/login/*"]\nrate = "5/minute"\ndelay = {HUGE}\n',
            "limits.shop/login/*.delay",
            4,
        ),
        (f'project = "shop"\nipv6_prefix = {HUGE}\n', "ipv6_prefix", 2),
        (
            f'project = "shop"\nlimits = {{ shop = {{ concurrency = {HUGE} }} }}\n',
            "limits.shop.concurrency",
            2,
        ),
    ],
    ids=["table", "quoted table", "top level", "inline tables"],
)
def test_a_number_of_thousands_of_digits_in_toml_names_its_key(
    tmp_path: Path, text: str, key: str, line: int
) -> None:
    """tomllib cannot read a number of thousands of digits at all: the error still names
    the key whose value it is, with the file and line, as every other ConfigError does."""
    path = write(tmp_path, "gatekeeper.toml", text)
    with pytest.raises(ConfigError, match="a number of thousands of digits") as info:
        GateKeeper(path)
    assert (info.value.key, info.value.file, info.value.line) == (key, str(path), line)
    assert len(str(info.value)) < 400


def test_long_concurrency_message(tmp_path: Path) -> None:
    """A 13-digit concurrency says the real bound, 10**9."""
    path = write(tmp_path, "gatekeeper.properties", "limits.shop.concurrency = 9999999999999\n")
    with pytest.raises(ConfigError) as info:
        GateKeeper(path)
    assert str(info.value) == (
        f"{path}:1: limits.shop.concurrency: "
        "expected an integer >= 0 and <= 1000000000, got '9999999999999'"
    )


def test_leading_zeros_do_not_make_an_integer_long(tmp_path: Path) -> None:
    """Zeros before the digits are not counted as digits: 0000000000000005 is 5."""
    path = write(tmp_path, "gatekeeper.properties", "limits.shop.concurrency = 0000000000000005\n")
    assert GateKeeper(path).config.limits["shop"].concurrency == 5


def test_unsupported_file_type(tmp_path: Path) -> None:
    """A .yaml file is refused, naming the file and the formats that work."""
    path = write(tmp_path, "gatekeeper.yaml", "project: shop\n")
    with pytest.raises(ConfigError, match=r"expected \.toml or \.properties") as info:
        GateKeeper(path)
    assert info.value.file == str(path)


def test_missing_file(tmp_path: Path) -> None:
    """A configuration path that does not exist is a ConfigError naming it."""
    path = tmp_path / "missing.properties"
    with pytest.raises(ConfigError) as info:
        GateKeeper(path)
    assert info.value.file == str(path)
    assert "cannot read" in str(info.value)


# ---------------------------------------------------------------- settings plus a file


def test_file_laid_over_settings(tmp_path: Path) -> None:
    """File keys win over settings, sections merge key by key, limits merge path by path."""
    path = write(
        tmp_path,
        "ops.properties",
        """\
        caller.required = false
        limits.shop/checkout.concurrency = 4
        limits.shop/login/*.rate = 5/minute
        """,
    )
    settings = {
        "project": "shop",
        "caller": {"header": "X-System", "required": True},
        "reload": {"file": str(path), "every_seconds": 30},
        "limits": {
            "shop": {"concurrency": 100},
            "shop/checkout": {"concurrency": 10, "delay": 3.0},
        },
    }
    config = GateKeeper(settings).config
    assert config.project == "shop"
    assert config.caller.header == "X-System"
    assert config.caller.required is False
    assert config.reload.every_seconds == 30
    assert set(config.limits) == {"shop", "shop/checkout", "shop/login/*"}
    assert config.limits["shop"].concurrency == 100
    # A path the file sets replaces that path of the settings as a whole.
    assert config.limits["shop/checkout"].concurrency == 4
    assert config.limits["shop/checkout"].delay is None
    assert config.limits["shop/login/*"].rate == Rate(5, 60.0, "5/minute")


def test_merge_error_in_file_names_file_line(tmp_path: Path) -> None:
    """With settings plus a file, a bad key from the file is reported at its file:line."""
    path = write(tmp_path, "ops.properties", "project = shop\nlimits.shop.rate = lots\n")
    with pytest.raises(ConfigError) as info:
        GateKeeper({"reload": {"file": str(path)}, "limits": {"shop/a": {"concurrency": 1}}})
    assert (info.value.file, info.value.line) == (str(path), 2)
    assert "'lots'" in str(info.value)


def test_merge_error_in_settings_names_no_file(tmp_path: Path) -> None:
    """With settings plus a file, a bad key from the settings is not blamed on the file."""
    path = write(tmp_path, "ops.properties", "limits.shop.concurrency = 5\n")
    with pytest.raises(ConfigError) as info:
        GateKeeper({"reload": {"file": str(path)}, "limits": {"shop/a": {"concurrency": -5}}})
    assert info.value.file is None
    assert str(info.value) == "limits.shop/a.concurrency: expected an integer >= 0, got -5"


MAIN_FILES = {
    "toml": '[gatekeeper]\nproject = "shop"\nreload = {{ file = "{ops}" }}\n'
    "limits = {{ shop = {{ concurrency = 100 }} }}\n",
    "properties": "project = shop\nreload.file = {ops}\nlimits.shop.concurrency = 100\n",
}


@pytest.mark.parametrize("kind", sorted(MAIN_FILES))
def test_a_configuration_file_lays_the_file_it_names_over_itself(tmp_path: Path, kind: str) -> None:
    """A configuration file that sets reload.file is the settings that file is laid
    over, and that file is the one watched - as with a settings dict: the README's three
    forms of one configuration behave the same. A relative name is found beside the file
    that names it."""
    import os

    from gatekeeper_wsgi.cli import run_check

    ops = tmp_path / "ops.properties"
    ops.write_text("limits.shop.concurrency = 1\n")
    main = tmp_path / f"main.{kind}"
    main.write_text(MAIN_FILES[kind].format(ops="ops.properties"))
    as_dict = {
        "project": "shop",
        "reload": {"file": str(ops)},
        "limits": {"shop": {"concurrency": 100}},
    }
    gk = GateKeeper(str(main))
    try:
        assert gk.config == GateKeeper(as_dict).config
        assert gk.config.limits["shop"].concurrency == 1
        temporary = tmp_path / "ops.new"
        temporary.write_text("limits.shop.concurrency = 2\n")
        os.replace(temporary, ops)
        assert gk.reload() is True
        assert gk.config.limits["shop"].concurrency == 2
    finally:
        gk.close()
    ops.write_text("limits.shop.concurrency = -1\n")
    out = io.StringIO()
    assert run_check(str(main), out) == 1
    assert f"{ops}:1: limits.shop.concurrency" in out.getvalue()


def test_the_file_laid_over_settings_cannot_name_another(tmp_path: Path) -> None:
    """The file laid over the settings is the one watched: a reload.file of its own, which
    would be reported yet never read, is a ConfigError with its file and line."""
    ops = tmp_path / "ops.properties"
    ops.write_text(f"limits.shop.concurrency = 2\nreload.file = {tmp_path / 'third.properties'}\n")
    with pytest.raises(ConfigError, match=rf"{ops}:2: reload.file: .* cannot name another"):
        GateKeeper({"project": "shop", "reload": {"file": str(ops)}})
    ops.write_text(f"limits.shop.concurrency = 2\nreload.file = {ops}\n")  # itself: fine
    assert GateKeeper({"project": "shop", "reload": {"file": str(ops)}}).config.limits


def test_a_reload_that_starts_naming_another_file_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A configuration file read alone may name a reload.file at start-up (laid over it);
    a reload of it that starts naming one fails, keeping the configuration in force, rather
    than reporting a file it never reads."""
    main = tmp_path / "gk.properties"
    main.write_text("project = shop\nlimits.shop.concurrency = 50\n")
    ops = tmp_path / "ops.properties"
    ops.write_text("limits.shop.concurrency = 1\n")
    gk = GateKeeper(str(main))
    try:
        replacement = tmp_path / "next.properties"
        replacement.write_text(main.read_text() + "reload.file = ops.properties\n")
        os.replace(replacement, main)
        with caplog.at_level(logging.ERROR, logger="gatekeeper"):
            assert gk.reload() is False
        assert f"{main}:3: reload.file: a reload cannot" in caplog.text
        assert gk.config.limits["shop"].concurrency == 50
        assert gk.config.reload.file is None
    finally:
        gk.close()
    # at start-up the same file lays the other one over
    restarted = GateKeeper(str(main))
    try:
        assert restarted.config.limits["shop"].concurrency == 1
    finally:
        restarted.close()


def test_reload_file_may_be_a_path_object(tmp_path: Path) -> None:
    """reload.file as a pathlib.Path (Django's ``BASE_DIR / "gatekeeper.properties"``) is
    the file it names, as a str is."""
    ops = tmp_path / "ops.properties"
    ops.write_text("limits.shop.concurrency = 3\n")
    config = build_config({"project": "shop", "reload": {"file": ops}})
    assert config.reload.file == str(ops)
    gk = GateKeeper({"project": "shop", "reload": {"file": ops}})
    try:
        assert gk.config.limits["shop"].concurrency == 3
    finally:
        gk.close()


@pytest.mark.parametrize(
    "rate", ["9999999999999/second", "5/1234567890123s", "9" * 5000 + "/s", "5/" + "9" * 5000 + "s"]
)
def test_a_rate_number_of_any_length_is_refused_with_the_bounds(rate: str) -> None:
    """A rate's N or window longer than its bounds allow is refused with those bounds,
    however many digits it has (not as a rate that does not parse)."""
    error = config_error({"limits": {"shop": {"rate": rate}}})
    assert error.key == "limits.shop.rate"
    assert "a rate of 1..1000000000 per a window longer than 0 and at most a year" in str(error)


@pytest.mark.parametrize("token", [90817263544, "t\u00f6k-s3cret", "s3cret\x01x", ["s3cret"]])
def test_a_bad_dashboard_token_is_refused_without_showing_it(token: object) -> None:
    """A dashboard token that is no printable ASCII text (a number in a TOML file, a
    non-ASCII one no Authorization header can carry) is a ConfigError that does not quote
    it (SPEC 4.8)."""
    error = config_error({"dashboard": {"token": token}})
    assert error.key == "dashboard.token" and "printable ASCII" in str(error)
    assert "s3cret" not in str(error) and "90817263544" not in str(error)


@pytest.mark.parametrize("token", ["   ", " s3cret", "s3cret "])
def test_a_dashboard_token_with_spaces_around_it_is_refused(token: str) -> None:
    """A token of spaces alone would let a ``?token=%20%20%20`` link in; spaces around a
    token would never match a bearer header (read without them): both refused, the token
    not quoted."""
    error = config_error({"dashboard": {"token": token}})
    assert error.key == "dashboard.token" and "spaces around it" in str(error)
    assert "s3cret" not in str(error)


def test_a_reload_with_a_bad_token_logs_no_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The ERROR of a reload refused for its token does not quote it either."""
    file = tmp_path / "gk.toml"
    file.write_text('[gatekeeper]\nproject = "shop"\n')
    gk = GateKeeper(str(file))
    try:
        replacement = tmp_path / "next.toml"
        replacement.write_text(
            '[gatekeeper]\nproject = "shop"\n[gatekeeper.dashboard]\ntoken = 90817263544\n'
        )
        os.replace(replacement, file)
        with caplog.at_level(logging.ERROR, logger="gatekeeper"):
            assert gk.reload() is False
        assert "dashboard.token" in caplog.text and "90817263544" not in caplog.text
    finally:
        gk.close()


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("path.properties", "limits." + "a" * 1_000_000 + ".concurrency = 1\n", 1),
        ("top.properties", "b" * 1_000_000 + " = 1\n", 1),
        ("top.toml", "[gatekeeper]\n" + "c" * 1_000_000 + " = 1\n", 2),
        ("limit.toml", '[gatekeeper.limits."' + "d" * 100_000 + '"]\nconcurrency = 1\n', 1),
    ],
)
def test_a_huge_key_makes_a_short_message(name: str, text: str, line: int, tmp_path: Path) -> None:
    """A hostile file's megabyte key is quoted in part (with its length), as a bad value
    is: the ConfigError, and so the reload's ERROR line, stays short, and still names the
    file, the line and what was wrong."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        GateKeeper(str(path))
    message = str(raised.value)
    assert len(message) < 2_000
    assert message.startswith(f"{path}:{line}: ")
    assert "characters)" in message
    with pytest.raises(ConfigError) as in_settings:
        GateKeeper({"limits": {"x" * 10_000: {"concurrency": 1}}})
    assert len(str(in_settings.value)) < 2_000
    assert in_settings.value.key == "limits." + "x" * 10_000  # the key itself stays whole
