"""The Django middleware through Django's test client (which closes responses as a WSGI
server does): naming by URL namespace and name, release on close for every kind of
response, faulty responses, rejections, the signal, and no double counting."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from django.conf.urls.i18n import i18n_patterns
from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpResponse
from django.test import Client, RequestFactory
from django.urls import path
from django.utils import translation
from django.utils.functional import lazy
from gatekeeper_wsgi.contrib.django import get_gatekeeper, request_rejected
from gatekeeper_wsgi.contrib.django.middleware import (
    UNRESOLVED,
    GateKeeperMiddleware,
    service_segment,
)
from werkzeug.test import Client as WerkzeugClient

from gatekeeper_wsgi import GateKeeperMiddleware as WSGIGateKeeperMiddleware
from gatekeeper_wsgi import rejectlog
from tests.conftest import busy, replace_file
from tests.django_project import configure, views
from tests.servers import DEADLINE, wait_until

configure()


def configure_gatekeeper(settings: Any, limits: dict[str, Any], **extra: Any) -> None:
    """Give this test its own GATEKEEPER (the project is "site" unless said otherwise)."""
    settings.GATEKEEPER = {"project": "site", **extra, "limits": limits}


def counted_during(response: Any) -> dict[str, int]:
    """What the view saw counted in flight while it ran (the test views report it)."""
    return busy(json.loads(response.content)["inflight"])


@pytest.fixture
def client() -> Client:
    """Django's test client that answers exceptions with 500 like a server would."""
    return Client(raise_request_exception=False)


@pytest.fixture
def hold() -> Iterator[views.Hold]:
    """A fresh server-side gate for views that wait; opened at the end in any case."""
    current = views.reset_hold()
    yield current
    current.gate.set()


# -- naming ----------------------------------------------------------------------------


def test_named_url_counts_under_the_project_setting_and_its_url_name(
    settings: Any, client: Client
) -> None:
    """Without a namespace the project is the setting and the service is the URL name."""
    configure_gatekeeper(settings, {"site": {"concurrency": 5}, "site/work": {"concurrency": 2}})
    response = client.get("/work/")
    assert response.status_code == 200
    assert counted_during(response) == {"site": 1, "site/work": 1}
    assert busy(get_gatekeeper()) == {}


def test_url_namespace_is_the_project(settings: Any, client: Client) -> None:
    """A namespaced URL counts under its namespace as project."""
    configure_gatekeeper(
        settings, {"shop": {"concurrency": 5}, "shop/checkout": {"concurrency": 1}}
    )
    response = client.get("/shop/checkout/")
    assert counted_during(response) == {"shop": 1, "shop/checkout": 1}


@pytest.mark.parametrize(
    ("path", "counted"),
    [
        ("/unnamed/", "site/tests.django_project.views.unnamed"),
        ("/shop/unnamed/", "shop/tests.django_project.views.unnamed"),
    ],
)
def test_unnamed_url_counts_under_the_views_dotted_path(
    settings: Any, client: Client, path: str, counted: str
) -> None:
    """A pattern without a name is counted under its view's dotted path."""
    configure_gatekeeper(settings, {"*/*": {"concurrency": 5}})
    assert counted_during(client.get(path)) == {counted: 1}


def test_unresolvable_path_counts_as_service_unresolved(settings: Any, client: Client) -> None:
    """A path no URL pattern matches is limited as service `unresolved` of the project."""
    configure_gatekeeper(settings, {f"site/{UNRESOLVED}": {"concurrency": 0}})
    response = client.get("/no/such/page/")
    assert response.status_code == 503
    fault = response.json()
    assert fault["code"] == "GK-CONCURRENCY-LIMIT"
    assert fault["limit"] == {"path": "site/unresolved", "value": 0}
    assert client.get("/work/").status_code == 200


class OtherURLs:
    """A second URLconf naming /work/ differently."""

    urlpatterns: ClassVar[list[Any]] = [path("work/", views.inflight_now, name="elsewhere")]


def test_names_follow_a_changed_root_urlconf(settings: Any, client: Client) -> None:
    """Resolved names are memoized per path; a new ROOT_URLCONF is resolved afresh."""
    configure_gatekeeper(settings, {"*/*": {"concurrency": 5}})
    assert counted_during(client.get("/work/")) == {"site/work": 1}
    assert counted_during(client.get("/work/")) == {"site/work": 1}
    settings.ROOT_URLCONF = OtherURLs
    assert counted_during(client.get("/work/")) == {"site/elsewhere": 1}


class I18nURLs:
    """/en/work/ and /de/work/: one URL name under a language prefix (i18n_patterns)."""

    urlpatterns: ClassVar[list[Any]] = i18n_patterns(
        path("work/", views.inflight_now, name="work"), prefix_default_language=True
    )


def test_a_urlconf_a_middleware_below_chooses_names_the_request(
    settings: Any, client: Client
) -> None:
    """A urlconf chosen per request by a middleware below this one (django-hosts,
    django-tenants set ``request.urlconf``): the path this middleware could not resolve
    is named by Django's own match before the view runs, counted (once) under its URL
    name, and refused by that name's limit."""
    configure_gatekeeper(settings, {"site/orders": {"concurrency": 1}})
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE[:1],
        "tests.django_project.middleware.ApiHostMiddleware",
        *settings.MIDDLEWARE[1:],
    ]
    keeper = get_gatekeeper()
    response = client.get("/v1/orders/", headers={"X-Api-Host": "1"})
    assert response.status_code == 200
    assert live(response) == {"site/orders": 1}
    assert keeper.stats()["counters"]["admitted"] == 1
    assert busy(keeper.inflight()) == {}
    configure_gatekeeper(settings, {"site/orders": {"concurrency": 0}})
    refused = client.get("/v1/orders/", headers={"X-Api-Host": "1"})
    assert refused.status_code == 503
    assert refused.json()["limit"]["path"] == "site/orders"
    assert busy(get_gatekeeper().inflight()) == {}


def with_locale_middleware(settings: Any, urls: Any) -> None:
    """English and German, LocaleMiddleware below this one, ``urls`` as the URLconf."""
    settings.USE_I18N = True
    settings.LANGUAGE_CODE = "en"
    settings.LANGUAGES = [("en", "English"), ("de", "German")]
    settings.ROOT_URLCONF = urls
    settings.MIDDLEWARE = [
        *settings.MIDDLEWARE[:1],
        "django.middleware.locale.LocaleMiddleware",
        *settings.MIDDLEWARE[1:],
    ]


def _about_route() -> str:
    return "ueber/" if translation.get_language() == "de" else "about/"


class TranslatedURLs:
    """/about/, /ueber/ in German: a translated route outside i18n_patterns, resolved in
    the language LocaleMiddleware picks (Accept-Language, the cookie)."""

    urlpatterns: ClassVar[list[Any]] = [
        path(lazy(_about_route, str)(), views.inflight_now, name="about")
    ]


def test_a_translated_route_counts_under_its_url_name_in_the_visitors_language(
    settings: Any, client: Client
) -> None:
    """LocaleMiddleware, below this one, activates the visitor's language before Django
    resolves: /ueber/ for a German browser is the view named about, and counts there."""
    configure_gatekeeper(settings, {"*/*": {"concurrency": 5}})
    with_locale_middleware(settings, TranslatedURLs)
    try:
        german = client.get("/ueber/", headers={"Accept-Language": "de"})
        assert live(german) == {"site/about": 1}
        english = client.get("/about/", headers={"Accept-Language": "en"})
        assert live(english) == {"site/about": 1}
    finally:
        translation.activate(settings.LANGUAGE_CODE)
    assert busy(get_gatekeeper().inflight()) == {}


@pytest.mark.parametrize("left_over", ["de", "en"])
def test_a_language_prefixed_path_keeps_its_url_name(
    settings: Any, client: Client, left_over: str
) -> None:
    """Under i18n_patterns each language's path counts under its URL name, whatever
    language the thread's last request left active (LocaleMiddleware runs after this
    middleware): never as `unresolved`, which would escape the service's limit."""
    configure_gatekeeper(settings, {"*/*": {"concurrency": 5}})
    with_locale_middleware(settings, I18nURLs)
    for path_ in ("/en/work/", "/de/work/", "/en/work/"):
        translation.activate(left_over)
        try:
            assert counted_during(client.get(path_)) == {"site/work": 1}, path_
        finally:
            translation.deactivate()


def test_names_outside_the_segment_alphabet_are_made_safe() -> None:
    """Characters a limit path cannot hold become `_`; the result is at most 128 long."""
    assert service_segment("views.<locals>.f") == "views._locals_.f"
    assert service_segment("order detail") == "order_detail"
    assert len(service_segment("x" * 300)) == 128


def test_exempt_view_is_never_limited(settings: Any, client: Client) -> None:
    """A `@gatekeeper_exempt` view answers even when its project is blocked."""
    configure_gatekeeper(settings, {"site": {"concurrency": 0}})
    assert client.get("/work/").status_code == 503
    response = client.get("/health/")
    assert response.status_code == 200
    assert get_gatekeeper().stats()["counters"]["admitted"] == 0


def test_caller_header_counts_at_the_caller_level(settings: Any, client: Client) -> None:
    """The caller header picks the caller-level limit; a missing caller is the default."""
    configure_gatekeeper(settings, {"site/work/*": {"concurrency": 1}})
    response = client.get("/work/", headers={"X-Caller-Id": "crm"})
    assert counted_during(response) == {"site/work/crm": 1}
    assert counted_during(client.get("/work/")) == {"site/work/anonymous": 1}


def test_required_caller_missing_is_rejected_with_400(settings: Any, client: Client) -> None:
    """With `caller.required`, a request without a valid caller gets GK-CALLER-MISSING."""
    configure_gatekeeper(settings, {}, caller={"required": True})
    response = client.get("/work/", headers={"X-Caller-Id": "not valid!"})
    assert response.status_code == 400
    assert response.json()["code"] == "GK-CALLER-MISSING"
    assert client.get("/work/", headers={"X-Caller-Id": "crm"}).status_code == 200


def test_a_refused_head_request_gets_the_headers_and_no_content(settings: Any) -> None:
    """RFC 9110: a HEAD answer has no content, even a fault's, as the WSGI middleware
    answers it; it keeps the fault's status and headers. Through Django's own WSGI
    handler: its test client drops a HEAD's content itself, not every server does."""
    configure_gatekeeper(settings, {"site": {"concurrency": 0}})
    seen: list[tuple[str, list[tuple[str, str]]]] = []
    for method in ("HEAD", "GET"):
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": "/work/",
            "SERVER_NAME": "testserver",
            "SERVER_PORT": "80",
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(),
        }
        result = WSGIHandler()(
            environ, lambda status, given, exc_info=None: seen.append((status, given))
        )
        body = b"".join(result)
        result.close()  # type: ignore[attr-defined]
        status, headers = seen[-1]
        assert status.startswith("503")
        assert dict(headers)["Retry-After"] == "1"
        assert (body == b"") == (method == "HEAD")
    assert busy(get_gatekeeper()) == {}


def run_middleware(request: Any) -> dict[str, int]:
    """Run one request through the Django middleware around a view; what it counted."""
    seen: dict[str, int] = {}

    def view(request: Any) -> HttpResponse:
        seen.update(busy(get_gatekeeper()))
        return HttpResponse("ok")

    GateKeeperMiddleware(view)(request).close()
    return seen


def test_user_key_reads_the_authenticated_request_user(settings: Any) -> None:
    """`key: "user"` counts by `request.user`'s username when the user is already set."""
    configure_gatekeeper(settings, {"site/whoami/*": {"concurrency": 1, "key": "user"}})

    class User:
        is_authenticated = True

        def get_username(self) -> str:
            return "alice"

    request = RequestFactory().get("/whoami/", REMOTE_USER="from-server")
    request.user = User()
    assert run_middleware(request) == {"site/whoami/alice": 1}
    assert busy(get_gatekeeper()) == {}


def live(response: Any) -> dict[str, int]:
    """The limit paths with requests in flight that /whoami/ saw."""
    return {path: n for path, n in response.json()["inflight"].items() if n}


@pytest.mark.django_db
def test_user_key_counts_each_logged_in_user_with_the_middleware_first(
    settings: Any, django_user_model: Any
) -> None:
    """Placed first, before AuthenticationMiddleware (as the test project's MIDDLEWARE
    is), `key: "user"` still counts each logged-in user apart: it reads the session's user
    as Django will, and leaves the session as it was."""
    configure_gatekeeper(
        settings, {"site/whoami/*": {"concurrency": 5, "rate": "1/hour", "key": "user"}}
    )
    alice, bob, anonymous = Client(), Client(), Client()
    alice.force_login(django_user_model.objects.create_user("alice"))
    bob.force_login(django_user_model.objects.create_user("bob"))
    assert live(alice.get("/whoami/")) == {"site/whoami/alice": 1}
    assert live(bob.get("/whoami/")) == {"site/whoami/bob": 1}
    assert alice.get("/whoami/").status_code == 429
    assert live(anonymous.get("/whoami/")) == {"site/whoami/-": 1}
    assert anonymous.get("/whoami/").status_code == 429
    assert bob.session.get("_auth_user_id") is not None  # still logged in


@pytest.mark.django_db
def test_user_key_finds_the_user_of_a_subclass_of_the_authentication_middleware(
    settings: Any, django_user_model: Any
) -> None:
    """A site's own middleware made from AuthenticationMiddleware sets request.user the
    same way: each logged-in user still counts apart (not all as one anonymous key)."""
    settings.MIDDLEWARE = [
        "tests.django_project.middleware.SiteAuthenticationMiddleware"
        if path.endswith(".AuthenticationMiddleware")
        else path
        for path in settings.MIDDLEWARE
    ]
    configure_gatekeeper(settings, {"site/whoami/*": {"concurrency": 5, "key": "user"}})
    alice, bob = Client(), Client()
    alice.force_login(django_user_model.objects.create_user("alice"))
    bob.force_login(django_user_model.objects.create_user("bob"))
    assert live(alice.get("/whoami/")) == {"site/whoami/alice": 1}
    assert live(bob.get("/whoami/")) == {"site/whoami/bob": 1}


@pytest.mark.django_db
def test_user_key_does_not_flush_a_session_it_cannot_verify(
    settings: Any, django_user_model: Any
) -> None:
    """A session whose password hash no longer verifies counts as anonymous, and is left
    for Django's own middleware to flush (only a copy of it is read)."""
    configure_gatekeeper(settings, {"site/whoami/*": {"concurrency": 5, "key": "user"}})
    user = django_user_model.objects.create_user("carol", password="before")
    client = Client()
    client.force_login(user)
    key = client.session.session_key
    user.set_password("after")
    user.save()
    from django.contrib.sessions.models import Session

    assert live(client.get("/whoami/")) == {"site/whoami/-": 1}
    # Not flushed by the read (the view never asks for request.user, so Django does not).
    assert Session.objects.filter(session_key=key).exists()


def test_user_key_falls_back_to_remote_user(settings: Any) -> None:
    """Without `request.user` (GateKeeper runs first), `key: "user"` reads REMOTE_USER."""
    configure_gatekeeper(settings, {"site/whoami/*": {"concurrency": 1, "key": "user"}})
    request = RequestFactory().get("/whoami/", REMOTE_USER="bob")
    assert run_middleware(request) == {"site/whoami/bob": 1}


# -- release on close ------------------------------------------------------------------


def test_a_streamed_response_the_test_client_leaves_unread_holds_its_slot(
    settings: Any, client: Client
) -> None:
    """As docs/concepts.md says: Django's test client closes a streamed response only
    once its content is read; dropped unread, it holds the slot until the cycle collector
    takes it (the test response refers to itself), then releases it exactly once."""
    import gc

    configure_gatekeeper(settings, {"site/stream": {"concurrency": 1}})
    keeper = get_gatekeeper()
    first = client.get("/stream/")
    assert first.status_code == 200
    assert client.get("/stream/").status_code == 503
    assert b"".join(first.streaming_content).startswith(b"first 1")  # read: closed
    assert busy(keeper.inflight()) == {}
    client.get("/stream/")  # dropped unread
    gc.collect()
    assert busy(keeper.inflight()) == {}
    read = client.get("/stream/")
    assert b"".join(read.streaming_content).startswith(b"first 1")
    assert busy(keeper.inflight()) == {}


async def _pieces() -> Any:
    yield b"a"
    yield "b"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_streamed_response_dropped_without_close_releases_at_once(
    settings: Any, kind: str
) -> None:
    """The middleware's watched stream makes no reference cycle with the response, so a
    streamed response dropped unread and unclosed (a RequestFactory test of the
    middleware, as Django's docs teach) releases as its last reference goes - with the
    cycle collector off - as the same response without the middleware is freed.

    On Python 3.10 a finished frame keeps its callers' frames: asgiref's Local, read for
    the urlconf (unset outside Django's handler), leaves a traceback cycle holding the
    middleware's frame, so there the response goes with the cycle collector's next pass,
    and releases then."""
    import gc
    import weakref

    from django.http import StreamingHttpResponse

    configure_gatekeeper(settings, {"site/stream": {"concurrency": 1}})
    keeper = get_gatekeeper()

    def view(request: Any) -> StreamingHttpResponse:
        return StreamingHttpResponse(iter([b"a", "b"]) if kind == "sync" else _pieces())

    middleware = GateKeeperMiddleware(view)
    enabled = gc.isenabled()
    gc.disable()
    try:
        response = middleware(RequestFactory().get("/stream/"))
        assert busy(keeper.inflight()) == {"site/stream": 1}
        gone = weakref.ref(response)
        del response
        if sys.version_info < (3, 11):
            gc.collect()
        assert gone() is None
        assert busy(keeper.inflight()) == {}
        again = middleware(RequestFactory().get("/stream/"))
        assert again.status_code == 200
        if kind == "sync":
            assert b"".join(again.streaming_content) == b"ab"
        again.close()
        assert busy(keeper.inflight()) == {}
    finally:
        if enabled:
            gc.enable()


def test_error_mid_stream_is_faulty_and_releases_after_the_delay(
    settings: Any, client: Client
) -> None:
    """A stream that raises counts as faulty: its slot is held for `delay`."""
    configure_gatekeeper(settings, {"site/stream": {"concurrency": 1, "delay": 3600}})
    response = client.get("/stream/?fail=1")
    with pytest.raises(RuntimeError, match="the stream failed"):
        b"".join(response.streaming_content)
    keeper = get_gatekeeper()
    assert keeper.stats()["counters"]["delayed_pending"] == 1
    assert busy(keeper.inflight()) == {"site/stream": 1}


def test_body_marker_in_a_stream_is_faulty(settings: Any, client: Client) -> None:
    """`timeout_body` is scanned in streamed content as it passes through."""
    configure_gatekeeper(
        settings, {"site/stream": {"concurrency": 1, "delay": 3600, "timeout_body": "TIMEOUT"}}
    )
    response = client.get("/stream/?marker=1")
    assert b"TIMEOUT" in b"".join(response.streaming_content)
    assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 1
    clean = client.get("/stream/")
    assert clean.status_code == 503  # the faulty response still holds the only slot


def test_body_marker_in_a_plain_response_is_faulty(settings: Any, client: Client) -> None:
    """`timeout_body` is found in an ordinary response's content."""
    configure_gatekeeper(
        settings, {"site/body": {"concurrency": 5, "delay": 3600, "timeout_body": "TIMEOUT"}}
    )
    assert client.get("/body/?text=all+good").status_code == 200
    assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 0
    assert client.get("/body/?text=backend+TIMEOUT").status_code == 200
    assert get_gatekeeper().stats()["counters"]["delayed_pending"] == 1


def served(path: str, method: str = "GET") -> bytes:
    """One request through Django's WSGI handler as a server makes it: iterate, then
    close (Django's test client closes first, then reads the content)."""
    path_info, _, query = path.partition("?")
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path_info,
        "QUERY_STRING": query,
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(),
    }
    result = WSGIHandler()(environ, lambda status, given, exc_info=None: None)
    body = b"".join(result)
    result.close()  # type: ignore[attr-defined]
    return body


@pytest.mark.parametrize(
    ("marker", "text", "faulty"),
    [
        ("^TIMEOUT$", "TIMEOUT", True),  # anchored: the body's start and end
        ("TIMEOUT", "OUT of stock, try again some other TIME", False),  # no marker at all
        ("TIMEOUT", "backend TIMEOUT", True),
    ],
)
@pytest.mark.parametrize("how", ["server", "test client"])
def test_a_plain_responses_body_is_searched_once_as_a_whole(
    settings: Any, client: Client, marker: str, text: str, faulty: bool, how: str
) -> None:
    """The body of an ordinary response is searched for the marker once, as one text,
    whether a server reads it before the close or the test client after: an anchored
    marker matches the whole body, and no marker is found across a seam of the body
    with itself."""
    configure_gatekeeper(
        settings, {"site/body": {"concurrency": 5, "delay": 3600, "timeout_body": marker}}
    )
    query = f"text={text.replace(' ', '+')}"
    if how == "server":
        assert served(f"/body/?{query}") == text.encode()
    else:
        assert client.get(f"/body/?{query}").content == text.encode()
    assert get_gatekeeper().stats()["counters"]["delayed_pending"] == int(faulty)


def test_a_streamed_head_body_ends_with_its_first_piece(settings: Any) -> None:
    """A HEAD's streamed body (the server drops it) ends with its first piece: the view's
    generator makes no more, so no work runs outside the limit its released slot no
    longer counts. A GET's is made whole."""
    configure_gatekeeper(settings, {"site/stream": {"concurrency": 1}})
    assert served("/stream/", "HEAD") == b"first "
    assert served("/stream/").startswith(b"first 1")
    assert busy(get_gatekeeper()) == {}


def test_file_response_is_released_on_close(settings: Any, client: Client) -> None:
    """A FileResponse holds its slot until its content is consumed and closed."""
    configure_gatekeeper(settings, {"site/file": {"concurrency": 1}})
    response = client.get("/file/")
    assert busy(get_gatekeeper()) == {"site/file": 1}
    assert b"".join(response.streaming_content) == b"file body " * 100
    assert busy(get_gatekeeper()) == {}


def test_file_response_is_read_through_the_watch_not_the_servers_file_wrapper(
    settings: Any,
) -> None:
    """Under WSGI a FileResponse is not handed to the server's `wsgi.file_wrapper`
    (sendfile, whose end nothing sees before the server's close, which may come after the
    client has the whole file and sent its next request): Django iterates it through the
    watch, and its slot comes back once its Content-Length is handed out, before close."""
    configure_gatekeeper(settings, {"site/file": {"concurrency": 1}})
    handed: list[object] = []

    class FileWrapper:
        def __init__(self, filelike: Any, block_size: int = 8192) -> None:
            handed.append(filelike)
            self.filelike = filelike

        def __iter__(self) -> Iterator[bytes]:
            return iter(lambda: self.filelike.read(4096), b"")

        def close(self) -> None:
            self.filelike.close()

    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": "/file/",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BytesIO(),
        "wsgi.file_wrapper": FileWrapper,
    }
    headers: list[tuple[str, str]] = []
    result = WSGIHandler()(environ, lambda status, given, exc_info=None: headers.extend(given))
    assert handed == [] and not isinstance(result, FileWrapper)
    assert ("Content-Length", "1000") in headers
    assert busy(get_gatekeeper()) == {"site/file": 1}
    body = b""
    for chunk in result:
        body += chunk
        if len(body) == 1000:
            assert busy(get_gatekeeper()) == {}  # the last byte handed out, before close
    assert body == b"file body " * 100
    result.close()  # type: ignore[attr-defined]
    assert busy(get_gatekeeper()) == {}


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/boom/", {}),
        ("/work/", {"X-Middleware-Raise": "1"}),
        ("/status/500/", {}),
        ("/status/504/", {}),
        ("/status/200/?header=TIMEOUT", {}),
    ],
    ids=["view-raises", "middleware-raises", "status-500", "timeout-status", "timeout-header"],
)
def test_faulty_responses_hold_the_slot_for_the_delay(
    settings: Any, client: Client, path: str, headers: dict[str, str]
) -> None:
    """Exceptions (Django's 500s), 5xx and timeout markers are faulty: delayed release."""
    configure_gatekeeper(
        settings,
        {
            "site": {
                "concurrency": 10,
                "delay": 3600,
                "timeout_status": [504],
                "timeout_header": "X-Fault-Code: TIMEOUT",
            }
        },
    )
    response = client.get(path, headers=headers)
    assert response.status_code in (200, 500, 504)
    keeper = get_gatekeeper()
    assert keeper.stats()["counters"]["delayed_pending"] == 1
    assert busy(keeper.inflight()) == {"site": 1}


def test_response_short_circuited_below_is_released(settings: Any, client: Client) -> None:
    """A response made by a middleware below GateKeeper (the view never runs) releases."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 1}})
    for _ in range(3):
        assert client.get("/work/", headers={"X-Short-Circuit": "1"}).status_code == 204
    assert busy(get_gatekeeper()) == {}


# -- concurrency -----------------------------------------------------------------------


def test_concurrency_limit_is_exact_across_threads(settings: Any, hold: views.Hold) -> None:
    """With the slots held by running views, newcomers are rejected; then all counts are 0."""
    configure_gatekeeper(settings, {"site/hold": {"concurrency": 3}})
    statuses: list[int] = []
    lock = threading.Lock()

    def call() -> None:
        status = Client().get("/hold/").status_code
        with lock:
            statuses.append(status)

    holders = [threading.Thread(target=call) for _ in range(3)]
    for thread in holders:
        thread.start()
    wait_until(lambda: hold.active == 3, what="three views running")
    for _ in range(4):
        response = Client().get("/hold/")
        assert response.status_code == 503
        assert response.json()["limit"] == {"path": "site/hold", "value": 3}
    hold.gate.set()
    for thread in holders:
        thread.join(DEADLINE)
    assert statuses == [200, 200, 200]
    assert hold.max_active == 3
    assert busy(get_gatekeeper()) == {}


# -- rejections ------------------------------------------------------------------------


def test_rejection_is_a_service_fault_with_retry_after_and_request_id(
    settings: Any, client: Client
) -> None:
    """A rejected request gets the ServiceFault problem JSON, Retry-After and its id."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
    response = client.get("/work/", headers={"X-Request-Id": "req-42"})
    assert response.status_code == 503
    assert response["Content-Type"] == "application/problem+json"
    assert int(response["Retry-After"]) >= 1
    assert response["X-Request-Id"] == "req-42"
    fault = response.json()
    assert fault["type"] == "urn:gatekeeper-wsgi:fault:GK-CONCURRENCY-LIMIT"
    assert fault["level"] == "service"
    assert fault["requestId"] == "req-42"


def test_rejection_is_xml_when_the_client_asks_for_xml(settings: Any, client: Client) -> None:
    """`Accept: application/xml` gets the ServiceFault XML."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
    response = client.get("/work/", headers={"Accept": "application/xml"})
    assert response.status_code == 503
    assert response["Content-Type"].startswith("application/xml")
    assert b"<code>GK-CONCURRENCY-LIMIT</code>" in response.content


def test_rate_limit_rejection_is_429_with_ratelimit_fields(settings: Any, client: Client) -> None:
    """A rate limit answers 429 with the IETF RateLimit fields."""
    configure_gatekeeper(settings, {"site/work": {"rate": "2/minute"}})
    assert [client.get("/work/").status_code for _ in range(3)] == [200, 200, 429]
    response = client.get("/work/")
    assert "RateLimit-Policy" in response
    assert response.json()["code"] == "GK-RATE-LIMIT"


def test_rejection_sends_the_request_rejected_signal(settings: Any, client: Client) -> None:
    """Receivers get the request, the Rejected and the request id."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
    received: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        received.append(kwargs)

    request_rejected.connect(receiver)
    try:
        client.get("/work/", headers={"X-Request-Id": "sig-1"})
        client.get("/health/")
    finally:
        request_rejected.disconnect(receiver)
    assert len(received) == 1
    assert received[0]["rejected"].code == "GK-CONCURRENCY-LIMIT"
    assert received[0]["request_id"] == "sig-1"
    assert received[0]["request"].path == "/work/"


@pytest.mark.parametrize("log_level", [logging.INFO, logging.WARNING])
@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("application/x-www-form-urlencoded", b"username=alice&note=" + b"x" * 5000),
        ("text/plain", b"<order>" + b"y" * 300 + b"</order>"),
    ],
)
def test_a_receiver_reads_the_whole_body_the_log_read(
    settings: Any,
    client: Client,
    caplog: pytest.LogCaptureFixture,
    log_level: int,
    content_type: str,
    body: bytes,
) -> None:
    """What the rejected-request log read of the body is given back to the request: a
    request_rejected receiver still reads request.body (and a form's request.POST) whole,
    with the log on or off."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
    caplog.set_level(log_level, logger="gatekeeper.rejected")
    seen: list[tuple[bytes, str | None]] = []

    def receiver(sender: Any, request: Any, **kwargs: Any) -> None:
        seen.append((request.body, request.POST.get("username")))

    request_rejected.connect(receiver)
    try:
        response = client.post("/work/", data=body, content_type=content_type)
    finally:
        request_rejected.disconnect(receiver)
    assert response.status_code == 503
    form = content_type.endswith("urlencoded")
    assert seen == [(body, "alice" if form else None)]


def test_failing_signal_receiver_does_not_break_the_fault(
    settings: Any, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver that raises is logged; the client still gets the ServiceFault."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})

    def broken(sender: Any, request: Any, **kwargs: Any) -> None:
        raise ValueError(f"receiver bug: {request.headers['Authorization']}")

    request_rejected.connect(broken)
    try:
        response = client.get("/work/", headers={"Authorization": "Bearer s3cret"})
    finally:
        request_rejected.disconnect(broken)
    assert response.status_code == 503
    (error,) = [r for r in caplog.records if "request_rejected receiver" in r.getMessage()]
    # its type and where it was raised, not its message (it may quote the request);
    # Django's send_robust logs the receiver's error itself, on django.dispatch
    assert "ValueError" in error.getMessage() and error.exc_info is None
    ours = [r for r in caplog.records if r.name.startswith("gatekeeper")]
    assert ours and not any("s3cret" in r.getMessage() for r in ours)


def test_rejection_is_logged_with_its_body(
    settings: Any, client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The rejected-request log gets one JSON line with method, path, body, no secrets."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
    caplog.set_level(logging.INFO, logger="gatekeeper.rejected")
    client.post(
        "/work/?x=1",
        data=b'{"item": 1}',
        content_type="application/json",
        headers={"Authorization": "Bearer s3cret", "X-Request-Id": "log-7"},
    )

    assert rejectlog.flush()  # the line is written by the log's own thread
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gatekeeper.rejected"]
    (line,) = [line for line in lines if line["requestId"] == "log-7"]
    assert line["method"] == "POST"
    assert line["path"] == "/work/"
    assert line["query"] == "x=1"
    assert line["body"] == '{"item": 1}'
    assert line["headers"]["Authorization"] == "[redacted]"


@pytest.mark.parametrize(
    ("path", "logged"),
    [
        ("/caf%C3%A9/", "/caf%C3%A9/"),  # UTF-8: Django decodes it to text
        ("/%FF%FE/", "/%FF%FE/"),  # not UTF-8: Django percent-encodes the bytes
        ("/a%20b/", "/a%20b/"),
    ],
)
def test_a_rejected_path_is_logged_as_sent_on_the_request_line(
    settings: Any, client: Client, caplog: pytest.LogCaptureFixture, path: str, logged: str
) -> None:
    """The log's path is the request line's, as the WSGI middleware logs it (and replay
    sends it), not Django's decoded text encoded again."""
    configure_gatekeeper(settings, {"site/*": {"concurrency": 0}})
    caplog.set_level(logging.INFO, logger="gatekeeper.rejected")
    assert client.get(path, headers={"X-Request-Id": "path-1"}).status_code == 503

    assert rejectlog.flush()
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gatekeeper.rejected"]
    (line,) = [line for line in lines if line["requestId"] == "path-1"]
    assert line["path"] == logged


# -- settings and the WSGI middleware --------------------------------------------------


def test_override_settings_rebuilds_the_gatekeeper(settings: Any, client: Client) -> None:
    """Replacing settings.GATEKEEPER takes effect on the next request."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 0}})
    assert client.get("/work/").status_code == 503
    configure_gatekeeper(settings, {"site/work": {"concurrency": 1}})
    assert client.get("/work/").status_code == 200


def test_one_gatekeeper_per_process_while_settings_stay(settings: Any, client: Client) -> None:
    """Requests share one GateKeeper: its counters see all of them."""
    configure_gatekeeper(settings, {"site/work": {"concurrency": 1}})
    keeper = get_gatekeeper()
    for _ in range(3):
        client.get("/work/")
    assert get_gatekeeper() is keeper
    assert keeper.stats()["counters"]["admitted"] == 3


def test_wsgi_middleware_around_django_is_not_counted_twice(settings: Any) -> None:
    """Behind the WSGI middleware, the Django middleware does not count a request again."""
    configure_gatekeeper(settings, {"site": {"concurrency": 1}})
    app = WSGIGateKeeperMiddleware(WSGIHandler(), get_gatekeeper())
    response = WerkzeugClient(app).get("/work/", buffered=True)
    assert response.status_code == 200
    assert busy(json.loads(response.get_data())["inflight"]) == {"site": 1}
    assert get_gatekeeper().stats()["counters"]["admitted"] == 1
    assert busy(get_gatekeeper()) == {}


def test_operators_file_hot_reloads_under_django(
    settings: Any, client: Client, tmp_path: Path
) -> None:
    """Limits in `reload.file` take effect on the requests after the file changes; the
    first request the new file refuses is answered by its fault format too."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text("fault.format = json\nlimits.site/work.concurrency = 5\n")
    settings.GATEKEEPER = {"project": "site", "reload": {"file": str(path), "every_requests": 1}}
    assert client.get("/work/").status_code == 200
    replace_file(path, "fault.format = xml\nlimits.site/work.concurrency = 0\n# now blocked\n")
    response = client.get("/work/")
    assert response.status_code == 503
    assert response["Content-Type"].startswith("application/xml")


def test_reloaded_unimportable_resolver_keeps_serving(
    settings: Any, client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hot-reloaded unimportable resolver fails the reload (logged once, counted);
    requests go on under the previous configuration."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text("limits.site/work.concurrency = 5\n")
    settings.GATEKEEPER = {"project": "site", "reload": {"file": str(path), "every_requests": 1}}
    assert client.get("/work/").status_code == 200
    replace_file(
        path, "caller.resolver = no_such_module.caller\nlimits.site/work.concurrency = 5\n"
    )
    statuses = [client.get("/work/").status_code for _ in range(3)]
    assert statuses == [200, 200, 200]
    failed = [r for r in caplog.records if "reload of" in r.getMessage()]
    assert len(failed) == 1
    assert "caller.resolver" in failed[0].getMessage()
    assert get_gatekeeper().stats()["counters"]["reload_failed"] == 1
