"""Strict typing covers the Django plugin too (issue 17 point 5): django-stubs give mypy
Django's types, so no module switches a check off wholesale and requests are typed as
Django's ``HttpRequest``, not ``Any``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.django_project import configure

configure()

ROOT = Path(__file__).resolve().parent.parent
# A per-module mypy switch: "# mypy: disable-error-code=..." or "# mypy: allow-...".
_MODULE_SWITCH = re.compile(r"^#\s*mypy:", re.MULTILINE)


@pytest.mark.parametrize("package", ["gatekeeper_wsgi", "contrib"])
def test_no_module_switches_a_mypy_check_off(package: str) -> None:
    """No module of the core or the plugins carries a ``# mypy:`` switch."""
    switched = [
        str(file.relative_to(ROOT))
        for file in sorted((ROOT / package).rglob("*.py"))
        if _MODULE_SWITCH.search(file.read_text(encoding="utf-8"))
    ]
    assert switched == []


def test_django_requests_are_typed_as_http_requests() -> None:
    """The plugin's views, access rule and middleware take an ``HttpRequest``."""
    # Imported once Django is configured (the auth views need the app registry).
    from gatekeeper_wsgi.contrib.django import views
    from gatekeeper_wsgi.contrib.django.middleware import GateKeeperMiddleware

    for function in (views.status_json, views.dashboard, views.is_staff):
        assert inspect.signature(function).parameters["request"].annotation == "HttpRequest"
    call = inspect.signature(GateKeeperMiddleware.__call__)
    assert call.parameters["request"].annotation == "HttpRequest"
