"""Settings: ``settings.GATEKEEPER``, read lazily, and one process-wide GateKeeper.

Nothing is read at import time. The GateKeeper is built on first use and kept for the
life of the process; it is rebuilt only when ``settings.GATEKEEPER`` is *replaced*
(``override_settings``, pytest-django's ``settings`` fixture), which the
``setting_changed`` signal and an identity check both notice. Mutating the dict in place
is not noticed - assign a new one. The operators' file (``reload.file``) hot-reloads
inside the engine as everywhere else.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

from gatekeeper_wsgi.config import Config, load_config
from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.errors import ConfigError

__all__ = ["SETTING", "effective_config", "gatekeeper_settings", "get_gatekeeper", "reset"]

SETTING = "GATEKEEPER"

_lock = threading.Lock()
#: (the settings object it was built from, the GateKeeper)
_current: tuple[object, GateKeeper] | None = None


def gatekeeper_settings() -> Mapping[str, Any]:
    """``settings.GATEKEEPER`` (``{}`` when unset); ConfigError when it is not a dict."""
    value = getattr(settings, SETTING, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(SETTING, f"expected a dict, got {type(value).__name__}")
    return value


def get_gatekeeper() -> GateKeeper:
    """The process-wide GateKeeper of the current ``settings.GATEKEEPER``."""
    source = getattr(settings, SETTING, None)
    current = _current
    if current is not None and current[0] is source:
        return current[1]
    return _rebuild(source)


def _rebuild(source: object) -> GateKeeper:
    global _current
    with _lock:
        current = _current
        if current is not None and current[0] is source:
            return current[1]
        # The previous GateKeeper is not closed here: requests admitted by it release
        # through their own Admission, possibly after this swap. Its backend is closed
        # once the last of them is gone and the engine collected (GateKeeper's finalizer).
        keeper = GateKeeper(gatekeeper_settings())
        _current = (source, keeper)
        return keeper


def reset() -> None:
    """Forget the current GateKeeper; the next request builds one from the settings."""
    global _current
    with _lock:
        _current = None


def effective_config() -> Config:
    """The validated configuration, settings plus the operators' file, as the engine
    builds it - without opening the configured backend. Raises ConfigError."""
    return load_config(gatekeeper_settings())


def _setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == SETTING:
        reset()


setting_changed.connect(_setting_changed, dispatch_uid="gatekeeper_wsgi.contrib.django.conf")
