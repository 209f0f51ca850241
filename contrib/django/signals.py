"""Signals of the Django integration."""

from __future__ import annotations

from django.dispatch import Signal

__all__ = ["request_rejected"]

#: Sent for every request the middleware rejects, after the fault is rendered and logged.
#: Keyword arguments: ``request`` (the HttpRequest), ``rejected`` (the
#: :class:`~gatekeeper_wsgi.errors.Rejected` with code, level, limit path and value) and
#: ``request_id``. A receiver that raises is logged, never turned into a 500::
#:
#:     @receiver(request_rejected)
#:     def count_rejection(sender, request, rejected, request_id, **kwargs):
#:         metrics.increment(f"rejected.{rejected.code}")
request_rejected = Signal()
