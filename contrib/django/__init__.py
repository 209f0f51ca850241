"""Django integration: the core engine's limits around Django's request handling.

::

    # settings.py
    INSTALLED_APPS = [..., "gatekeeper_wsgi.contrib.django"]
    MIDDLEWARE = ["gatekeeper_wsgi.contrib.django.GateKeeperMiddleware", ...]   # first
    GATEKEEPER = {"project": "shop", "limits": {"shop/checkout": {"concurrency": 10}}}

    # urls.py: the status JSON and the dashboard, staff only
    path("gatekeeper/", include("gatekeeper_wsgi.contrib.django.urls")),

Importing this package needs Django but no configured settings: the middleware and the
settings helpers are loaded on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    import django  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gatekeeper_wsgi.contrib.django needs Django: pip install 'gatekeeper-wsgi[django]'"
    ) from exc

from .decorators import gatekeeper_exempt

if TYPE_CHECKING:
    from .conf import get_gatekeeper
    from .middleware import GateKeeperMiddleware
    from .signals import request_rejected

__all__ = ["GateKeeperMiddleware", "gatekeeper_exempt", "get_gatekeeper", "request_rejected"]

_LAZY = {
    "GateKeeperMiddleware": ".middleware",
    "get_gatekeeper": ".conf",
    "request_rejected": ".signals",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module_name, __name__), name)
