"""docs/migration.md, django-ratelimit rows: each translation admits and refuses exactly the
requests django-ratelimit itself admits and refuses, on the same Django app and clients.

django-ratelimit counts in fixed windows whose edges depend on the wall clock; its clock
is frozen here (it reads ``time.time()`` in ``django_ratelimit.core``), so a sequence can
never straddle an edge. Ours counts by its own monotonic clock; every sequence fits well
inside a window.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import django_ratelimit.core
import pytest
from django.core.cache import cache
from django.http import HttpResponse
from django.test import Client
from django.urls import path
from django_ratelimit.decorators import ratelimit

from tests.django_project import configure

configure()

GATEKEEPER_FIRST = "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware"


class UserFromRemoteUser:
    """Stands in for authentication: ``request.user`` from the server's ``REMOTE_USER``."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        name = request.META.get("REMOTE_USER")
        request.user = types.SimpleNamespace(
            is_authenticated=bool(name), pk=name, get_username=lambda: name
        )
        return self.get_response(request)


def ok(request: Any) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [
    path("peer/login/", ratelimit(key="ip", rate="5/m")(ok), name="peer_login"),
    path("peer/me/", ratelimit(key="user", rate="5/m")(ok), name="peer_me"),
    path("peer/api/", ratelimit(key="header:x-api-key", rate="5/m")(ok), name="peer_api"),
    path("login/", ok, name="login"),
    path("me/", ok, name="me"),
    path("api/", ok, name="api"),
]

OURS = {
    "shop/login/*": {"rate": "5/minute", "key": "ip"},
    "shop/me/*": {"rate": "5/minute", "key": "user"},
    "shop/api/*": {"rate": "5/minute", "key": "header:X-Api-Key"},
}


@pytest.fixture(autouse=True)
def app(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This module's URLs behind GateKeeper, django-ratelimit's clock frozen, caches empty."""
    settings.ROOT_URLCONF = __name__
    settings.MIDDLEWARE = [GATEKEEPER_FIRST, f"{__name__}.UserFromRemoteUser"]
    settings.GATEKEEPER = {"project": "shop", "limits": OURS}
    frozen = django_ratelimit.core.time.time()
    monkeypatch.setattr(django_ratelimit.core, "time", types.SimpleNamespace(time=lambda: frozen))
    cache.clear()
    yield
    cache.clear()


def admitted(url: str, clients: list[dict[str, str]], times: int) -> dict[str, list[bool]]:
    """``times`` GETs per client (the clients taking turns): admitted or refused, in order."""
    client = Client()
    seen: dict[str, list[bool]] = {}
    for _ in range(times):
        for extra in clients:
            response = client.get(url, **extra)
            # django-ratelimit refuses with 403 (Ratelimited), gatekeeper-wsgi with 429.
            assert response.status_code in (200, 403, 429)
            seen.setdefault(repr(sorted(extra.items())), []).append(response.status_code == 200)
    return seen


@pytest.mark.parametrize(
    ("name", "clients"),
    [
        ("login", [{"REMOTE_ADDR": "10.0.0.1"}, {"REMOTE_ADDR": "10.0.0.2"}]),
        ("me", [{"REMOTE_USER": "alice"}, {"REMOTE_USER": "bob"}]),
        ("api", [{"HTTP_X_API_KEY": "k1"}, {"HTTP_X_API_KEY": "k2"}]),
    ],
    ids=["key=ip", "key=user", "key=header"],
)
def test_same_admissions_as_django_ratelimit(name: str, clients: list[dict[str, str]]) -> None:
    """`@ratelimit(key=…, rate="5/m")` and `"shop/<url name>/*": {"rate": "5/minute",
    "key": …}` admit the same five requests per key and refuse the rest."""
    theirs = admitted(f"/peer/{name}/", clients, 8)
    ours = admitted(f"/{name}/", clients, 8)
    assert ours == theirs
    assert list(theirs.values()) == [[True] * 5 + [False] * 3] * 2
