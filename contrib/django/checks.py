"""System checks for ``settings.GATEKEEPER`` and the middleware's place (``manage.py check``).

=================== ==========================================================================
``gatekeeper.E001`` ``GATEKEEPER`` is not a dict
``gatekeeper.E002`` a setting is invalid (the ConfigError message: key, value, expected;
                    file and line for the operators' file); one message per invalid
                    setting
``gatekeeper.E003`` ``GateKeeperMiddleware`` is in ``MIDDLEWARE`` but not first
``gatekeeper.E004`` ``backend`` names no known backend, or its URL is one the backend
                    refuses (an unknown option, a bad port, an unsafe ``shared://`` file)
``gatekeeper.E005`` ``caller.resolver`` or ``fault.renderer`` cannot be imported
``gatekeeper.W001`` ``GateKeeperMiddleware`` is not in ``MIDDLEWARE``: nothing is limited
``gatekeeper.W002`` ``routes`` is set; it names services for bare WSGI only, Django uses
                    URL names
``gatekeeper.W003`` ``backend`` holds a password, which Django's error reports (mails to
                    ``ADMINS``) would list: set ``DEFAULT_EXCEPTION_REPORTER_FILTER`` to
                    ``gatekeeper_wsgi.contrib.django.debug.SafeExceptionReporterFilter``
=================== ==========================================================================

Every invalid setting is reported, not only the first: the configuration stops at its
first error, so each top-level setting and each limit is then also checked on its own.
Hints point into ``docs/configuration.md`` of the gatekeeper-wsgi source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.apps import AppConfig
from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.utils.module_loading import import_string

from gatekeeper_wsgi.backends import BACKENDS, check_backend_url
from gatekeeper_wsgi.config import SECTIONS, load_config
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.redact import mask_url

from .conf import SETTING, effective_config

__all__ = ["check_settings"]

MIDDLEWARE_PATHS = frozenset(
    {
        "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware",
        "gatekeeper_wsgi.contrib.django.middleware.GateKeeperMiddleware",
    }
)
_DOCS = "docs/configuration.md"
_REPORTER_FILTER = "gatekeeper_wsgi.contrib.django.debug.SafeExceptionReporterFilter"
_SETTINGS_HINT = f"See {_DOCS} (the configuration reference) in the gatekeeper-wsgi source."
# Settings documented in a section of their own.
_SECTIONS = frozenset({*SECTIONS, "limits"})


def _hint_for(key: str) -> str:
    """Where the docs describe ``key`` (``limits.shop.concurrency`` -> the Limits section)."""
    top = key.split(".", 1)[0]
    anchor = top.replace("_", "-") if top in _SECTIONS else "top-level-keys"
    return f"See {_DOCS}#{anchor} (the configuration reference) in the gatekeeper-wsgi source."


def check_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """All gatekeeper checks: settings first, then the middleware's position."""
    return [*_check_gatekeeper_setting(), *_check_middleware()]


def _config_error(exc: ConfigError) -> Error:
    """The check message of an invalid configuration, by the key at fault."""
    if exc.key == "backend":
        known = ", ".join(sorted(BACKENDS))
        return Error(
            f"settings.{SETTING}: {exc}",
            hint=f"Use one of: {known} (e.g. 'memory', 'shared:///run/gk.shm', "
            "'redis://localhost:6379/0').",
            id="gatekeeper.E004",
        )
    if exc.key in ("caller.resolver", "fault.renderer"):
        return Error(
            f"settings.{SETTING}: {exc}",
            hint="Give the dotted path of an importable callable.",
            id="gatekeeper.E005",
        )
    return Error(f"settings.{SETTING}: {exc}", hint=_hint_for(exc.key), id="gatekeeper.E002")


def _config_errors(value: Mapping[str, Any]) -> list[ConfigError]:
    """Every invalid setting of ``value``: the configuration as the engine builds it stops
    at its first error, so each top-level setting and each limit is also tried alone
    (with the project, when that is valid), and each distinct error kept."""
    try:
        effective_config()
    except ConfigError as exc:
        found = [exc]
    else:
        return []
    base = {"project": value["project"]} if "project" in value else {}
    pieces: list[dict[str, Any]] = []
    if base:
        try:
            load_config(base)
        except ConfigError:
            # Tried with each piece, an invalid project would be every piece's error and
            # hide the rest: the pieces go without it, and it is reported on its own.
            pieces.append(base)
            base = {}
    for key, item in value.items():
        if key == "limits" and isinstance(item, Mapping):
            pieces.extend({**base, "limits": {path: limit}} for path, limit in item.items())
        elif key != "project":
            pieces.append({**base, key: item})
    seen = {str(found[0])}
    for piece in pieces:
        try:
            load_config(piece)
        except ConfigError as exc:
            if str(exc) not in seen:
                seen.add(str(exc))
                found.append(exc)
    return found


def _check_gatekeeper_setting() -> list[CheckMessage]:
    value = getattr(settings, SETTING, None)
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        return [
            Error(
                f"settings.{SETTING} must be a dict, got {type(value).__name__}.",
                hint=_SETTINGS_HINT,
                id="gatekeeper.E001",
            )
        ]
    errors = _config_errors(value)
    if errors:
        return [_config_error(exc) for exc in errors]
    config = effective_config()
    try:  # the URL's options, parsed by the backend's own code; nothing is opened
        check_backend_url(config.backend)
    except ConfigError as exc:
        return [_config_error(exc)]
    messages: list[CheckMessage] = []
    if mask_url(config.backend) != config.backend and not _reports_mask_urls():
        messages.append(
            Warning(
                f"settings.{SETTING}['backend'] holds a password, which Django's error "
                "reports (the mails to ADMINS, the DEBUG page) list in full.",
                hint="Set DEFAULT_EXCEPTION_REPORTER_FILTER = "
                f"'{_REPORTER_FILTER}', which masks it.",
                id="gatekeeper.W003",
            )
        )
    if config.routes:
        messages.append(
            Warning(
                f"settings.{SETTING}['routes'] is ignored by the Django middleware.",
                hint="Django names services by URL name; 'routes' is for bare WSGI apps.",
                id="gatekeeper.W002",
            )
        )
    return messages


def _reports_mask_urls() -> bool:
    """Whether Django's error reports go through a filter that masks URL credentials."""
    from .debug import SafeExceptionReporterFilter

    try:
        cls = import_string(settings.DEFAULT_EXCEPTION_REPORTER_FILTER)
    except ImportError:
        return False  # Django's own check reports it
    return isinstance(cls, type) and issubclass(cls, SafeExceptionReporterFilter)


def _is_gatekeeper_middleware(path: object) -> bool:
    if path in MIDDLEWARE_PATHS:
        return True
    if not isinstance(path, str):
        return False
    from .middleware import GateKeeperMiddleware

    try:
        cls = import_string(path)
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, GateKeeperMiddleware)


def _check_middleware() -> list[CheckMessage]:
    middleware = list(getattr(settings, "MIDDLEWARE", None) or ())
    positions = [i for i, path in enumerate(middleware) if _is_gatekeeper_middleware(path)]
    if not positions:
        return [
            Warning(
                "GateKeeperMiddleware is not in settings.MIDDLEWARE: no request is limited.",
                hint="Add 'gatekeeper_wsgi.contrib.django.GateKeeperMiddleware' first.",
                id="gatekeeper.W001",
            )
        ]
    if positions[0] != 0:
        return [
            Error(
                "GateKeeperMiddleware must be the first entry of settings.MIDDLEWARE "
                f"(it is at position {positions[0]}).",
                hint="Middleware above it runs before the limit check and outside the "
                "release on close; move it to the top.",
                id="gatekeeper.E003",
            )
        ]
    return []
