"""Counter backends, chosen from a URL through a plain registry.

``memory`` (this process), ``shared:///path/file`` (the processes of one host) and
``redis://host:port/db`` (many hosts). Modules are imported on first use, so the core
needs neither redis-py nor mmap support unless configured.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gatekeeper_wsgi.backends.base import Backend
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.redact import mask_text, mask_url
from gatekeeper_wsgi.values import BACKENDS, scheme_of

if TYPE_CHECKING:
    from gatekeeper_wsgi.config import Config

__all__ = ["BACKENDS", "backend_from_url", "backend_scheme", "check_backend_url"]


def backend_scheme(url: str) -> str:
    """The registry scheme of a backend URL; ConfigError for an unknown one."""
    try:
        return scheme_of(url)
    except ValueError as exc:
        raise ConfigError("backend", str(exc)) from None


def _backend_class(url: str) -> tuple[str, type[Backend]]:
    scheme = backend_scheme(url)
    module_name, class_name = BACKENDS[scheme].split(":")
    try:
        module = import_module(module_name)
    except ImportError as exc:
        hint = " (pip install 'gatekeeper-wsgi[redis]')" if "redis" in module_name else ""
        raise ConfigError(
            "backend", f"backend {mask_url(url)!r} cannot be loaded: {mask_text(str(exc))}{hint}"
        ) from exc
    cls: type[Backend] = getattr(module, class_name)
    return scheme, cls


def _check_syntax(url: str) -> None:
    """ConfigError for a URL ``urlsplit`` refuses (before a backend's own parsing sees it)."""
    try:
        urlsplit(url)
    except ValueError as exc:
        raise ConfigError("backend", f"malformed backend URL {mask_url(url)!r}: {exc}") from None


def check_backend_url(url: str) -> None:
    """ConfigError for a backend URL that start-up would refuse (unknown scheme, bad or
    unknown options), parsed by the backend's own code; nothing is created or connected."""
    scheme, cls = _backend_class(url)
    if scheme != "memory":
        _check_syntax(url)
        cls.check_url(url)


def backend_from_url(url: str, config: Config | None = None) -> Backend:
    """Instantiate the backend a URL names; an unknown scheme raises ConfigError.

    Built by ``cls.from_url(url, config)`` (:meth:`Backend.from_url`); the config lets
    them size themselves (``max_keys``, rate limits) before the first request.
    """
    scheme, cls = _backend_class(url)
    if scheme != "memory":
        _check_syntax(url)
    return cls.from_url(url, config)
