"""Django's error reports (the mails to ``ADMINS``, the ``DEBUG`` page) without the
passwords of URLs in settings.

Django's ``SafeExceptionReporterFilter`` hides a setting by its name (``…PASS…``,
``…KEY…``, ``…SECRET…``); ``GATEKEEPER["backend"]`` is not such a name, and a Redis URL's
password (``redis://:pw@cache:6379/0``) would be listed in every error mail. This filter
also masks the credentials of every URL in any setting's text, as gatekeeper's own logs
and pages do::

    # settings.py
    DEFAULT_EXCEPTION_REPORTER_FILTER = (
        "gatekeeper_wsgi.contrib.django.debug.SafeExceptionReporterFilter"
    )

``manage.py check`` warns (``gatekeeper.W003``) while the backend URL holds a password
and Django's own filter is in force.
"""

from __future__ import annotations

from typing import Any

from django.views import debug

from gatekeeper_wsgi.redact import mask_text

__all__ = ["SafeExceptionReporterFilter"]


class SafeExceptionReporterFilter(debug.SafeExceptionReporterFilter):
    """Django's filter, and URL credentials (and ``password=…`` values) masked in the
    text of every setting, however deep in dicts and lists."""

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        # Django's own recursion into dicts and lists calls this method for each item.
        cleansed = super().cleanse_setting(key, value)
        return mask_text(cleansed) if isinstance(cleansed, str) else cleansed
