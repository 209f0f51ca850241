"""One naming policy for the integrations (issue 17 point 6): Django and Flask turn a name
from code into the same limit path segment and name an unresolved request alike, and the
adapters keep no sanitiser or token parser of their own."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from django.http import HttpResponse
from django.test import Client
from django.urls import path
from flask import Flask
from gatekeeper_wsgi.contrib.django.middleware import UNRESOLVED, service_segment
from gatekeeper_wsgi.contrib.flask import UNRESOLVED_SERVICE, GateKeeper
from hypothesis import given
from hypothesis import strategies as st

from gatekeeper_wsgi import naming
from gatekeeper_wsgi.config import CALLER_RE
from tests.django_project import configure

configure()

CONTRIB = Path(__file__).resolve().parent.parent / "contrib"
#: Names from code that are not plain names, and the segment the policy makes of them.
ODD_NAMES = {
    "order detail": "order_detail",
    "views.<locals>.checkout": "views._locals_.checkout",
    "café/menu": "caf_menu",
}

urlpatterns = [
    path(f"odd/{index}/", lambda request: HttpResponse("ok"), name=name)
    for index, name in enumerate(ODD_NAMES)
]


def test_there_is_one_unresolved_service() -> None:
    """Django's ``UNRESOLVED`` and Flask's ``UNRESOLVED_SERVICE`` are the core's constant."""
    assert UNRESOLVED is UNRESOLVED_SERVICE is naming.UNRESOLVED == "unresolved"


def test_django_and_flask_share_the_sanitiser() -> None:
    """Django's ``service_segment`` is the core's ``name_segment``, which Flask uses too."""
    assert service_segment is naming.name_segment
    for name, segment in ODD_NAMES.items():
        assert naming.name_segment(name) == segment


@given(st.from_regex(CALLER_RE, fullmatch=True))
def test_a_plain_name_is_kept_as_it_is(name: str) -> None:
    """A name that already is a plain path segment is never changed."""
    assert naming.name_segment(name) == name


@given(st.text(max_size=400))
def test_any_name_becomes_a_plain_segment(name: str) -> None:
    """Whatever the name (spaces, slashes, non-ASCII, 400 characters, empty), the segment
    is a plain name of at most 128 characters, never ``*``."""
    assert CALLER_RE.fullmatch(naming.name_segment(name))


def _flask_app() -> Flask:
    app = Flask("naming")
    app.config["GATEKEEPER"] = {
        "project": "site",
        "limits": {f"site/{segment}": {"concurrency": 0} for segment in ODD_NAMES.values()}
        | {f"site/{UNRESOLVED}": {"concurrency": 0}},
    }
    for index, name in enumerate(ODD_NAMES):
        app.add_url_rule(f"/odd/{index}/", endpoint=name, view_func=lambda: "ok")
    GateKeeper(app)
    return app


def test_django_and_flask_name_odd_names_and_unresolved_alike(settings: Any) -> None:
    """The same odd URL name (Django) and endpoint (Flask) is refused by the one limit on
    its sanitised segment, and a path matching nothing by the limit on ``unresolved``."""
    settings.ROOT_URLCONF = __name__
    settings.GATEKEEPER = {
        "project": "site",
        "limits": {f"site/{segment}": {"concurrency": 0} for segment in ODD_NAMES.values()}
        | {f"site/{UNRESOLVED}": {"concurrency": 0}},
    }
    django_client = Client()
    flask_client = _flask_app().test_client()
    paths = [f"/odd/{index}/" for index in range(len(ODD_NAMES))] + ["/nowhere/"]
    expected = [f"site/{segment}" for segment in ODD_NAMES.values()] + [f"site/{UNRESOLVED}"]
    for url, limit in zip(paths, expected, strict=True):
        django_response = django_client.get(url)
        with flask_client.get(url) as flask_response:
            assert django_response.status_code == flask_response.status_code == 503
            assert django_response.json()["limit"]["path"] == limit
            assert flask_response.get_json()["limit"]["path"] == limit


def _contrib_sources() -> list[tuple[str, ast.Module]]:
    return [
        (str(file.relative_to(CONTRIB)), ast.parse(file.read_text(encoding="utf-8")))
        for file in sorted(CONTRIB.rglob("*.py"))
    ]


@pytest.mark.parametrize(
    "needle",
    [
        # a second token check: the Authorization header, the cookie, constant-time compare
        "HTTP_AUTHORIZATION",
        "HTTP_COOKIE",
        "compare_digest",
        "Bearer ",
        # a second sanitiser: a character class of what a segment may not hold
        "^A-Za-z0-9",
    ],
)
def test_the_adapters_keep_no_parser_or_sanitiser_of_their_own(needle: str) -> None:
    """No Django or Flask module parses a token or sanitises a name itself: both call the
    core (``access``, ``naming``)."""
    found = [
        name
        for name, tree in _contrib_sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        # docstrings may say what a credential looks like; code may not look for one
        and needle in node.value
        and not _is_docstring(tree, node)
    ]
    assert found == []


def _is_docstring(tree: ast.Module, node: ast.Constant) -> bool:
    for owner in ast.walk(tree):
        if isinstance(owner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = owner.body
            if body and isinstance(body[0], ast.Expr) and body[0].value is node:
                return True
    return False
