"""System checks `gatekeeper.E001…`: one test per id, each with the setting that triggers it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.checks import run_checks
from gatekeeper_wsgi.contrib.django.checks import check_settings

from tests.django_project import configure

configure()

FIRST = "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware"
SESSIONS = "django.contrib.sessions.middleware.SessionMiddleware"


def ids() -> list[str]:
    """The ids the gatekeeper checks report for the current settings."""
    return [message.id for message in check_settings()]


def test_valid_settings_pass(settings: Any) -> None:
    """The test project's own settings raise nothing."""
    assert ids() == []


def test_checks_run_with_manage_py_check(settings: Any) -> None:
    """The app registers its checks: Django's check run reports them."""
    settings.GATEKEEPER = ["not", "a", "dict"]
    assert "gatekeeper.E001" in [message.id for message in run_checks()]


def test_e001_setting_is_not_a_dict(settings: Any) -> None:
    """E001: GATEKEEPER must be a dict."""
    settings.GATEKEEPER = "/etc/gatekeeper.toml"
    assert ids() == ["gatekeeper.E001"]


def test_e002_invalid_configuration_names_key_and_expectation(settings: Any) -> None:
    """E002: an invalid value is reported with the ConfigError message."""
    settings.GATEKEEPER = {"limits": {"shop": {"concurrency": -1}}}
    (message,) = check_settings()
    assert message.id == "gatekeeper.E002"
    assert "limits.shop.concurrency" in message.msg


@pytest.mark.parametrize("project", ["shop", 5], ids=["valid project", "invalid project"])
def test_e002_reports_every_invalid_setting(settings: Any, project: object) -> None:
    """Every invalid setting is reported at once, an invalid project among them: it does
    not hide the others (each is checked without it)."""
    settings.GATEKEEPER = {
        "project": project,
        "mode": "nope",
        "limits": {"shop": {"concurrency": -1}},
    }
    keys = sorted(message.msg.split(": ")[1] for message in check_settings())
    expected = ["limits.shop.concurrency", "mode"] + (["project"] if project == 5 else [])
    assert keys == sorted(expected)


def test_e002_invalid_operators_file_names_file_and_line(settings: Any, tmp_path: Path) -> None:
    """E002 also covers the file laid over the settings, with its name and line."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text("project = shop\nlimits.shop.concurrency = many\n")
    settings.GATEKEEPER = {"reload": {"file": str(path)}}
    (message,) = check_settings()
    assert message.id == "gatekeeper.E002"
    assert f"{path}:2" in message.msg


def test_e002_uncompilable_regexes_in_settings_and_file(settings: Any, tmp_path: Path) -> None:
    """E002 for regexes the engine refuses (a huge repeat count, 5 000 nested groups), in
    the settings and in the operators' file (with file and line): the check itself runs."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text("project = shop\nlimits.shop.timeout_header = X-A: x{4294967296}\n")
    nested = "(" * 5000 + ")" * 5000
    settings.GATEKEEPER = {
        "reload": {"file": str(path)},
        "limits": {"shop/api": {"concurrency": 1, "timeout_body": nested}},
    }
    messages = check_settings()
    assert [message.id for message in messages] == ["gatekeeper.E002"] * 2
    text = "\n".join(message.msg for message in messages)
    assert f"{path}:2: limits.shop.timeout_header: expected a valid regular expression" in text
    assert "limits.shop/api.timeout_body: expected a valid regular expression" in text
    assert "gatekeeper.E002" in [message.id for message in run_checks()]


def test_e003_middleware_not_first(settings: Any) -> None:
    """E003: GateKeeperMiddleware below another middleware."""
    settings.MIDDLEWARE = [SESSIONS, FIRST]
    assert ids() == ["gatekeeper.E003"]


def test_e004_unknown_backend(settings: Any) -> None:
    """E004: a backend URL of no known scheme."""
    settings.GATEKEEPER = {"backend": "memcached://localhost"}
    (message,) = check_settings()
    assert message.id == "gatekeeper.E004"
    assert "memcached://localhost" in message.msg


@pytest.mark.parametrize(
    "backend",
    [
        "redis://127.0.0.1:6379/0?bogus=1",
        "redis://127.0.0.1:notaport/0",
        "redis://127.0.0.1:6379/x",
        "shared:///{tmp}/table.shm?bogus=1",
        "shared:///{tmp}/open.shm",
    ],
)
def test_e004_backend_url_the_backend_refuses(settings: Any, tmp_path: Path, backend: str) -> None:
    """E004 also for a known scheme whose URL the backend would refuse at the first
    request (an unknown option, a bad port or database, a shared file others may write),
    as the Flask extension and `gatekeeper check` refuse it."""
    open_file = tmp_path / "open.shm"
    open_file.write_bytes(b"")
    open_file.chmod(0o666)
    settings.GATEKEEPER = {"backend": backend.format(tmp=str(tmp_path).lstrip("/"))}
    (message,) = check_settings()
    assert message.id == "gatekeeper.E004"
    assert "backend" in message.msg


def test_e005_resolver_cannot_be_imported(settings: Any) -> None:
    """E005: caller.resolver names nothing importable."""
    settings.GATEKEEPER = {"caller": {"resolver": "no_such_module.resolve_caller"}}
    (message,) = check_settings()
    assert message.id == "gatekeeper.E005"
    assert "caller.resolver" in message.msg


def test_w001_middleware_missing(settings: Any) -> None:
    """W001: the app is installed but the middleware is not: nothing is limited."""
    settings.MIDDLEWARE = [SESSIONS]
    assert ids() == ["gatekeeper.W001"]


def test_w002_routes_are_ignored_under_django(settings: Any) -> None:
    """W002: `routes` names bare-WSGI services; Django uses URL names."""
    settings.GATEKEEPER = {"routes": {"/orders/<int:id>": "order"}}
    assert ids() == ["gatekeeper.W002"]


def test_middleware_by_its_module_path_counts_as_first(settings: Any) -> None:
    """The middleware may be named by its module path too."""
    settings.MIDDLEWARE = ["gatekeeper_wsgi.contrib.django.middleware.GateKeeperMiddleware"]
    assert ids() == []


def test_w003_a_backend_password_django_reports_would_list(settings: Any) -> None:
    """W003: the backend URL holds a password and Django's error reports would list it;
    gatekeeper's reporter filter (or a subclass) silences it."""
    settings.GATEKEEPER = {"backend": "redis://:s3cret@127.0.0.1:9/0"}
    assert ids() == ["gatekeeper.W003"]
    (message,) = check_settings()
    assert "s3cret" not in str(message)
    settings.DEFAULT_EXCEPTION_REPORTER_FILTER = (
        "gatekeeper_wsgi.contrib.django.debug.SafeExceptionReporterFilter"
    )
    assert ids() == []
    settings.GATEKEEPER = {"backend": "redis://127.0.0.1:9/0"}  # no password: no warning
    del settings.DEFAULT_EXCEPTION_REPORTER_FILTER
    assert ids() == []
