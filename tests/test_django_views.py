"""The status JSON and dashboard views from `include("gatekeeper_wsgi.contrib.django.urls")`:
staff only by default, or the dashboard token; never limited themselves."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from gatekeeper_wsgi.access import COOKIE_NAME
from tests.django_project import configure

configure()

TOKEN = "test-token"


def gatekeeper(settings: Any, **extra: Any) -> None:
    """A configuration that blocks the whole project, so only exempt views answer."""
    settings.GATEKEEPER = {
        "project": "site",
        "dashboard": {"token": TOKEN},
        "limits": {"site": {"concurrency": 0}},
        **extra,
    }


@pytest.fixture
def staff_client(django_user_model: Any) -> Client:
    """A client logged in as an active staff user."""
    user = django_user_model.objects.create_user("ops", password="x", is_staff=True)
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_staff_user_gets_the_status_json(settings: Any, staff_client: Client) -> None:
    """Staff see live counters and in-flight per limit, even with the project blocked."""
    gatekeeper(settings)
    assert staff_client.get("/work/").status_code == 503
    response = staff_client.get(reverse("gatekeeper:status"))
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    payload = response.json()
    assert payload["stats"]["counters"]["rejected"] == {"GK-CONCURRENCY-LIMIT": 1}
    assert payload["config"]["project"] == "site"


@pytest.mark.django_db
def test_staff_user_gets_the_dashboard(settings: Any, staff_client: Client) -> None:
    """The dashboard page is served under the include's prefix and polls status.json there."""
    gatekeeper(settings)
    response = staff_client.get(reverse("gatekeeper:dashboard"))
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    assert b"/gk/status.json" in response.content


@pytest.mark.django_db
def test_non_staff_user_is_forbidden(settings: Any, django_user_model: Any) -> None:
    """A logged-in user without is_staff gets 403 on both views."""
    gatekeeper(settings)
    client = Client()
    client.force_login(django_user_model.objects.create_user("eve", password="x"))
    assert client.get(reverse("gatekeeper:status")).status_code == 403
    assert client.get(reverse("gatekeeper:dashboard")).status_code == 403


@pytest.mark.django_db
def test_anonymous_browser_is_sent_to_login(settings: Any) -> None:
    """An anonymous visitor of the dashboard is redirected to LOGIN_URL."""
    gatekeeper(settings)
    response = Client().get(reverse("gatekeeper:dashboard"))
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=/gk/")


@pytest.mark.django_db
def test_anonymous_json_client_gets_a_bearer_challenge(settings: Any) -> None:
    """The JSON endpoint does not redirect: an anonymous client is asked for the token."""
    gatekeeper(settings)
    response = Client().get(reverse("gatekeeper:status"))
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.django_db
def test_dashboard_token_admits_a_scraper(settings: Any) -> None:
    """The `dashboard.token` as a bearer token opens the JSON; a wrong one does not."""
    gatekeeper(settings)
    url = reverse("gatekeeper:status")
    good = Client().get(url, headers={"Authorization": f"Bearer {TOKEN}"})
    assert good.status_code == 200
    assert "counters" in good.json()["stats"]
    wrong = Client().get(url, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403


@pytest.mark.django_db
def test_the_mount_without_its_slash_is_never_limited(settings: Any) -> None:
    """`/gatekeeper` (no slash) is answered by Django's APPEND_SLASH redirect to the
    dashboard, not refused by the project's limit (which blocks everything here)."""
    gatekeeper(settings)
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.common.CommonMiddleware"]
    url = reverse("gatekeeper:dashboard")
    assert url.endswith("/")
    response = Client().get(url.rstrip("/") + "?token=" + TOKEN)
    assert response.status_code == 301
    assert response["Location"] == url + "?token=" + TOKEN
    assert Client().get("/no-such-page").status_code == 503  # other redirects stay limited


@pytest.mark.django_db
def test_token_link_is_exchanged_for_a_cookie(settings: Any) -> None:
    """A ?token= link to the dashboard redirects to it without the token, setting an
    HttpOnly, SameSite=Strict cookie that then opens the page and the JSON."""
    gatekeeper(settings)
    client = Client()
    url = reverse("gatekeeper:dashboard")
    response = client.get(url + "?token=" + TOKEN)
    assert response.status_code == 303
    assert response["Location"] == url
    morsel = response.cookies[COOKIE_NAME]
    assert morsel["httponly"] and morsel["samesite"] == "Strict"
    assert TOKEN not in morsel.OutputString()
    # Django's test client keeps the cookie, as a browser does.
    assert client.get(url).status_code == 200
    assert client.get(reverse("gatekeeper:status")).status_code == 200
    assert Client().get(url).status_code in (302, 401)  # without it: not let in


@pytest.mark.django_db
def test_staff_with_a_token_link_is_redirected_without_it(
    settings: Any, staff_client: Client
) -> None:
    """A staff user following a ?token= link is let in only on the URL without it: the
    right token is exchanged for the cookie, a wrong one just removed."""
    gatekeeper(settings)
    url = reverse("gatekeeper:dashboard")
    right = staff_client.get(url + "?token=" + TOKEN + "&x=%FF")
    assert right.status_code == 303
    assert right["Location"] == url + "?x=%FF"
    assert right.cookies[COOKIE_NAME]["samesite"] == "Strict"
    wrong = staff_client.get(reverse("gatekeeper:status") + "?token=stale")
    assert wrong.status_code == 303
    assert wrong["Location"] == reverse("gatekeeper:status")
    assert COOKIE_NAME not in wrong.cookies
    assert staff_client.get(url).status_code == 200
