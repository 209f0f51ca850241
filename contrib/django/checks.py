"""System checks for ``settings.GATEKEEPER`` and the middleware's place (``manage.py check``).

=================== ==========================================================================
``gatekeeper.E001`` ``GATEKEEPER`` is not a dict
``gatekeeper.E002`` the configuration is invalid (the ConfigError message: key, value,
                    expected; file and line for the operators' file)
``gatekeeper.E003`` ``GateKeeperMiddleware`` is in ``MIDDLEWARE`` but not first
``gatekeeper.E004`` ``backend`` names no known backend
``gatekeeper.E005`` ``caller.resolver`` or ``fault.renderer`` cannot be imported
``gatekeeper.W001`` ``GateKeeperMiddleware`` is not in ``MIDDLEWARE``: nothing is limited
``gatekeeper.W002`` ``routes`` is set; it names services for bare WSGI only, Django uses
                    URL names
=================== ==========================================================================
"""

# mypy: disable-error-code="import-untyped"

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.utils.module_loading import import_string

from gatekeeper_wsgi.backends import BACKENDS
from gatekeeper_wsgi.errors import ConfigError

from .conf import SETTING, effective_config

__all__ = ["check_settings"]

MIDDLEWARE_PATHS = frozenset(
    {
        "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware",
        "gatekeeper_wsgi.contrib.django.middleware.GateKeeperMiddleware",
    }
)
_SETTINGS_HINT = "See the configuration reference (settings dict, SPEC §3)."


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
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
    return Error(f"settings.{SETTING}: {exc}", hint=_SETTINGS_HINT, id="gatekeeper.E002")


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
    try:
        config = effective_config()
    except ConfigError as exc:
        return [_config_error(exc)]
    messages: list[CheckMessage] = []
    if config.routes:
        messages.append(
            Warning(
                f"settings.{SETTING}['routes'] is ignored by the Django middleware.",
                hint="Django names services by URL name; 'routes' is for bare WSGI apps.",
                id="gatekeeper.W002",
            )
        )
    return messages


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
