"""The Django app: registers the system checks."""

from __future__ import annotations

from django.apps import AppConfig
from django.core import checks

__all__ = ["GateKeeperConfig"]


class GateKeeperConfig(AppConfig):
    """``INSTALLED_APPS += ["gatekeeper_wsgi.contrib.django"]``: system checks
    ``gatekeeper.E001…`` and the ``manage.py gatekeeper`` command."""

    name = "gatekeeper_wsgi.contrib.django"
    label = "gatekeeper"
    verbose_name = "GateKeeper"

    def ready(self) -> None:
        from .checks import check_settings

        checks.register(check_settings, "gatekeeper")
