"""The package runs on the oldest Python it declares (``requires-python`` in
pyproject.toml): no regular expression of it uses syntax newer than that. Possessive
quantifiers (``*+``, ``++``) and atomic groups (``(?>…)``) are Python 3.11's: on 3.10 the
package failed at import with ``re.error: multiple repeat``, after pip had installed it
without complaint. Checked on every compiled pattern the modules hold, by the parser of
Python's own ``re``."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest

import gatekeeper_wsgi

if sys.version_info >= (3, 11):
    from re import _parser as sre_parse  # type: ignore[attr-defined]

    import tomllib
else:  # pragma: no cover - the floor's own interpreter
    import sre_parse

    import tomli as tomllib

from tests.test_architecture import ROOT

#: re's opcodes for syntax the floor's re does not read, by the version that added it
NEWER = {"POSSESSIVE_REPEAT": (3, 11), "ATOMIC_GROUP": (3, 11)}


def floor() -> tuple[int, int]:
    """The oldest Python pyproject.toml declares (``>=3.10`` -> (3, 10))."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r">=\s*(\d+)\.(\d+)", declared)
    assert found is not None, declared
    return int(found.group(1)), int(found.group(2))


def patterns() -> Iterator[tuple[str, re.Pattern[str] | re.Pattern[bytes]]]:
    """(module.name, pattern) of every compiled pattern a core module holds."""
    for info in pkgutil.walk_packages(gatekeeper_wsgi.__path__, "gatekeeper_wsgi."):
        if info.name.startswith("gatekeeper_wsgi.contrib"):
            continue  # the plugins need their frameworks set up; they hold no such pattern
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, re.Pattern):
                yield f"{info.name}.{name}", value


def opcodes(parsed: Any) -> Iterator[str]:
    """The names of the opcodes of a parsed pattern, nested ones included."""
    for op, argument in parsed:
        yield str(op)
        for part in argument if isinstance(argument, (tuple, list)) else ():
            if isinstance(part, sre_parse.SubPattern):
                yield from opcodes(part)
            elif isinstance(part, list):  # a branch's alternatives
                for alternative in part:
                    if isinstance(alternative, sre_parse.SubPattern):
                        yield from opcodes(alternative)


def test_the_checker_finds_newer_syntax() -> None:
    """A possessive quantifier and an atomic group are found, nested in groups too (on
    3.10, whose re cannot read them at all, the parse itself fails)."""
    newer = r"(a|(?:b++)(?>c))"
    if sys.version_info < (3, 11):
        with pytest.raises(re.error):
            sre_parse.parse(newer)
        return
    found = set(opcodes(sre_parse.parse(newer)))
    assert {"POSSESSIVE_REPEAT", "ATOMIC_GROUP"} <= found


def test_the_package_patterns_read_on_the_oldest_python_declared() -> None:
    """No pattern of the package uses what the oldest declared Python's re cannot read."""
    oldest = floor()
    seen = dict(patterns())
    assert "gatekeeper_wsgi.redact._JSON_MEMBER" in seen  # the walk reaches the modules
    newer = {
        name: op
        for name, pattern in seen.items()
        for op in opcodes(sre_parse.parse(pattern.pattern, pattern.flags))
        if NEWER.get(op, (0, 0)) > oldest
    }
    assert newer == {}
