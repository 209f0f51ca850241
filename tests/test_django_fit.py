"""Django's own habits met: a rejection is not logged again by ``django.request`` (so no
admin mail per rejected request) but once on ``gatekeeper.rejected`` at INFO; no false
"several processes" warning under ASGI or Django's test client, which set
``wsgi.multiprocess`` themselves; system checks report every invalid setting, each with
its id and a hint into ``docs/``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.core import mail
from django.core.handlers.wsgi import WSGIHandler
from django.test import AsyncClient, Client
from django.utils.log import AdminEmailHandler, RequireDebugFalse
from django.views.debug import get_default_exception_reporter_filter
from gatekeeper_wsgi.contrib.django.checks import check_settings
from werkzeug.test import EnvironBuilder

from gatekeeper_wsgi import rejectlog
from gatekeeper_wsgi.backends import memory
from tests.django_project import configure

configure()


@pytest.fixture
def admins(settings: Any) -> Iterator[list[Any]]:
    """ADMINS set, DEBUG off, the locmem mail backend, and the admin mail handler of
    Django's default logging (the test project turns LOGGING_CONFIG off) on the
    ``django`` logger: every ERROR of ``django.request`` is mailed. Yields the outbox."""
    settings.ADMINS = [("Ops", "ops@example.com")]
    settings.DEBUG = False
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    mail.outbox = []
    handler = AdminEmailHandler()
    handler.setLevel(logging.ERROR)
    handler.addFilter(RequireDebugFalse())
    django_logger = logging.getLogger("django")
    django_logger.addHandler(handler)
    try:
        yield mail.outbox
    finally:
        django_logger.removeHandler(handler)


def test_twenty_rejections_send_no_admin_mail_and_log_once_each(
    settings: Any, admins: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """20 rejections: zero admin mails, no django.request record, and 20 INFO lines on
    gatekeeper.rejected; a 503 the view itself answers is still mailed (the control)."""
    settings.GATEKEEPER = {"project": "site", "limits": {"site/work": {"concurrency": 0}}}
    caplog.set_level(logging.INFO, logger="gatekeeper.rejected")
    client = Client(raise_request_exception=False)
    for index in range(20):
        response = client.get("/work/", headers={"X-Request-Id": f"mail-{index}"})
        assert response.status_code == 503
    assert admins == []
    assert [r for r in caplog.records if r.name == "django.request"] == []
    assert rejectlog.flush()
    lines = [
        (record.levelno, json.loads(record.getMessage())["requestId"])
        for record in caplog.records
        if record.name == "gatekeeper.rejected"
    ]
    assert sorted(lines) == sorted((logging.INFO, f"mail-{index}") for index in range(20))

    assert client.get("/status/503/").status_code == 503
    assert len(admins) == 1


def per_process_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "several serving" in r.getMessage()]


@pytest.fixture
def fresh_warning(settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A new engine on the memory backend, and the once-per-process warning not yet given."""
    settings.GATEKEEPER = {"project": "site", "limits": {"site/work": {"concurrency": 5}}}
    memory._WARNED.clear()
    caplog.set_level(logging.WARNING, logger="gatekeeper")


@pytest.mark.usefixtures("fresh_warning")
def test_no_multiprocess_warning_under_the_test_client(caplog: pytest.LogCaptureFixture) -> None:
    """Django's test client says wsgi.multiprocess=True in every environ: no warning."""
    assert Client().get("/work/").status_code == 200
    assert per_process_warnings(caplog) == []


@pytest.mark.usefixtures("fresh_warning")
def test_no_multiprocess_warning_under_asgi(caplog: pytest.LogCaptureFixture) -> None:
    """Django's ASGIRequest says wsgi.multiprocess=True whatever serves it (one uvicorn or
    daphne process): no warning."""

    async def get() -> int:
        return (await AsyncClient().get("/work/")).status_code

    assert asyncio.run(get()) == 200
    assert per_process_warnings(caplog) == []


@pytest.mark.usefixtures("fresh_warning")
def test_a_multiprocess_wsgi_server_is_still_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """A real WSGI server's environ saying wsgi.multiprocess still gets the one warning."""
    environ = EnvironBuilder(path="/work/", environ_overrides={"wsgi.multiprocess": True})
    statuses: list[str] = []
    response = WSGIHandler()(environ.get_environ(), lambda s, h, e=None: statuses.append(s))
    b"".join(response)
    response.close()  # type: ignore[attr-defined]
    assert statuses == ["200 OK"]
    (message,) = per_process_warnings(caplog)
    assert "shared://" in message


def test_checks_report_every_invalid_setting_with_a_docs_hint(settings: Any) -> None:
    """Five invalid settings at once: five messages, each with its id, each hint pointing
    into docs/configuration.md, none to the SPEC (a file users do not have)."""
    settings.GATEKEEPER = {
        "project": "site",
        "backend": "nosuch://x",
        "mode": "loud",
        "caller": {"resolver": "no.such.module.resolve"},
        "limits": {"site/a": {"concurrency": -1}, "site/b": {"rate": "lots"}},
    }
    messages = check_settings()
    by_key = {
        key: message.id
        for message in messages
        for key in ("backend", "mode", "caller.resolver", "limits.site/a", "limits.site/b")
        if key in message.msg
    }
    assert by_key == {
        "backend": "gatekeeper.E004",
        "mode": "gatekeeper.E002",
        "caller.resolver": "gatekeeper.E005",
        "limits.site/a": "gatekeeper.E002",
        "limits.site/b": "gatekeeper.E002",
    }
    assert len(messages) == 5
    for message in messages:
        assert "SPEC" not in (message.hint or "")
    assert all("docs/configuration.md" in m.hint for m in messages if m.id == "gatekeeper.E002")
    limit_hints = [m.hint for m in messages if "limits." in m.msg]
    assert all("docs/configuration.md#limits" in hint for hint in limit_hints)


def test_an_error_mail_masks_the_backend_password(settings: Any, admins: list[Any]) -> None:
    """With gatekeeper's reporter filter, the settings an error mail lists show the
    backend URL's password masked (Django's own filter hides settings by name only, and
    ``backend`` is no such name)."""
    settings.GATEKEEPER = {
        "project": "site",
        "backend": "redis://:S3cretRedisPw@127.0.0.1:9/0",  # nothing listens: fails open
        "limits": {"site/boom": {"concurrency": 5}},
    }
    settings.DEFAULT_EXCEPTION_REPORTER_FILTER = (
        "gatekeeper_wsgi.contrib.django.debug.SafeExceptionReporterFilter"
    )
    # Django reads it once per process (an lru_cache no setting_changed clears): a site
    # sets it in settings.py, before any error; this test, after others' mails.
    get_default_exception_reporter_filter.cache_clear()
    settings.CACHE_URL = "redis://user:CachePw@cache:6379/1"  # any setting's URL
    assert Client(raise_request_exception=False).get("/boom/").status_code == 500
    (message,) = admins
    text = message.body + "".join(str(part[0]) for part in message.alternatives)
    assert "127.0.0.1:9/0" in text  # the settings are listed
    assert "S3cretRedisPw" not in text and "CachePw" not in text
    get_default_exception_reporter_filter.cache_clear()  # Django's own again, for others
