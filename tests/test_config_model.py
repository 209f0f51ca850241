"""The configuration model derives its schema from its dataclasses (issue 17 point 5): the
accepted keys, the defaults and the fixed choices are each written once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import pickle
import subprocess
import sys
from typing import get_args, get_type_hints

import pytest

from gatekeeper_wsgi import config as config_module
from gatekeeper_wsgi.adaptive import ALGORITHMS, AdaptiveSpec, Algorithm
from gatekeeper_wsgi.backends.base import Denial
from gatekeeper_wsgi.config import (
    ADAPTIVE_FIELDS,
    FAULT_FORMATS,
    LIMIT_FIELDS,
    MODES,
    ON_BACKEND_ERROR,
    SECTION_TYPES,
    SECTIONS,
    TOP_LEVEL,
    BackendErrorPolicy,
    Config,
    FaultFormat,
    Limit,
    Mode,
    build_config,
)
from gatekeeper_wsgi.errors import LEVELS, ConfigError, Level, LimitKind


def test_empty_settings_give_the_dataclass_defaults() -> None:
    """An empty settings dict validates to exactly the defaults the dataclasses declare."""
    assert build_config({}) == Config()


@pytest.mark.parametrize("section", sorted(SECTION_TYPES))
def test_each_section_key_defaults_to_its_dataclass_field(section: str) -> None:
    """Leaving out any one key of a section gives that section's dataclass default."""
    cls = SECTION_TYPES[section]
    defaults = cls()
    assert SECTIONS[section] == tuple(f.name for f in dataclasses.fields(cls))
    for name in SECTIONS[section]:
        built = getattr(build_config({section: {}}), section)
        assert getattr(built, name) == getattr(defaults, name), (section, name)


def test_the_accepted_keys_are_the_dataclass_fields() -> None:
    """Top-level keys, limit fields and adaptive keys are the fields of their dataclasses."""
    assert tuple(f.name for f in dataclasses.fields(Config)) == TOP_LEVEL
    assert set(LIMIT_FIELDS) == {f.name for f in dataclasses.fields(Limit) if f.init} - {
        "path",
        "segments",
    }
    assert tuple(f.name for f in dataclasses.fields(AdaptiveSpec)) == ADAPTIVE_FIELDS


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"projekt": "shop"}, "did you mean 'project'"),
        ({"caller": {"heder": "X-Caller"}}, "did you mean 'header'"),
        ({"mode": "enforcing"}, "'enforce' or 'shadow'"),
        ({"fault": {"format": "yaml"}}, "'auto' or 'xml' or 'json'"),
        ({"limits": {"shop": {"concurency": 1}}}, "did you mean 'concurrency'"),
    ],
)
def test_a_wrong_key_or_choice_is_refused_from_the_derived_schema(
    settings: dict[str, object], expected: str
) -> None:
    """A misspelt key or an unknown choice is refused, naming what the schema accepts."""
    with pytest.raises(ConfigError) as caught:
        build_config(settings)
    assert expected in str(caught.value)


def test_choice_tuples_are_derived_from_the_literal_types() -> None:
    """Every fixed choice's tuple is its Literal type's arguments, in order."""
    assert MODES == get_args(Mode) == ("enforce", "shadow")
    assert ON_BACKEND_ERROR == get_args(BackendErrorPolicy) == ("allow", "reject")
    assert FAULT_FORMATS == get_args(FaultFormat) == ("auto", "xml", "json")
    assert get_args(Algorithm) == ALGORITHMS
    assert LEVELS == get_args(Level) == ("project", "service", "caller")
    assert get_args(LimitKind) == ("concurrency", "rate")


def test_fixed_choice_fields_are_typed_by_their_literals() -> None:
    """The dataclass fields holding a fixed choice are annotated with its Literal type."""
    hints = get_type_hints(Config)
    assert hints["mode"] == Mode
    assert hints["on_backend_error"] == BackendErrorPolicy
    assert get_type_hints(config_module.FaultConfig)["format"] == FaultFormat
    assert get_type_hints(Limit)["level"] == Level
    assert get_type_hints(Denial)["kind"] == LimitKind


@pytest.mark.parametrize(
    ("settings", "field", "value"),
    [
        ({"mode": " shadow "}, "mode", "shadow"),
        ({"on_backend_error": "reject"}, "on_backend_error", "reject"),
    ],
)
def test_a_choice_is_stored_as_the_literal_itself(
    settings: dict[str, str], field: str, value: str
) -> None:
    """A choice read from a settings string (spaces stripped) is stored as the choice."""
    assert getattr(build_config(settings), field) == value


def test_the_checker_holds_no_second_copy_of_a_default() -> None:
    """No ``.get(key, "X-Caller-Id")`` in the checker: every default is the dataclasses'."""
    source = inspect.getsource(config_module._Checker)
    second_copies = [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and len(node.args) == 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value is not None
    ]
    assert second_copies == []


_UNPICKLE_AND_LOOK_UP = """
import pickle, sys
from gatekeeper_wsgi.config import build_config
limit = pickle.loads(sys.stdin.buffer.read())
fresh = build_config(eval(sys.argv[1])).limits["shop/orders"]
print({fresh: "found"}.get(limit, "missing"), {limit: "found"}.get(fresh, "missing"))
"""


def test_a_limit_hashes_as_its_fields_wherever_it_is_unpickled() -> None:
    """A limit keeps its hash once made (a route's limits are hashed on every Redis
    admission), and a limit unpickled in a process whose string hashes differ hashes
    there as an equal limit built there does: the kept hash does not travel."""
    settings = {
        "project": "shop",
        "limits": {"shop/orders": {"concurrency": 3, "rate": "5/minute", "delay": 2.5}},
    }
    limit = build_config(settings).limits["shop/orders"]
    assert hash(limit) == hash(limit) == hash(build_config(settings).limits["shop/orders"])
    assert dataclasses.replace(limit, concurrency=4) != limit
    payload = pickle.dumps(limit)
    for seed in ("1", "2"):
        looked_up = subprocess.run(
            [sys.executable, "-c", _UNPICKLE_AND_LOOK_UP, repr(settings)],
            input=payload,
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert looked_up.stdout.split() == [b"found", b"found"]
