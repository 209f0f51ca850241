"""The documentation stays true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from gatekeeper_wsgi.config import LIMIT_FIELDS, SECTIONS, TOP_LEVEL

DOCS = Path(__file__).resolve().parent.parent / "docs"


def documented_keys() -> set[str]:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.MULTILINE))


def test_every_configuration_key_is_documented() -> None:
    """Every key the configuration model accepts has a row in docs/configuration.md."""
    keys = set(TOP_LEVEL) | set(LIMIT_FIELDS)
    for fields in SECTIONS.values():
        keys |= set(fields)
    assert keys - documented_keys() == set()


def test_no_documented_key_is_unknown_to_the_model() -> None:
    """docs/configuration.md documents no key the model would reject."""
    keys = set(TOP_LEVEL) | set(LIMIT_FIELDS)
    for fields in SECTIONS.values():
        keys |= set(fields)
    assert documented_keys() - keys == set()
