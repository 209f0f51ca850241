"""``path("gatekeeper/", include("gatekeeper_wsgi.contrib.django.urls"))``: the dashboard at
``gatekeeper/`` (``gatekeeper:dashboard``) and ``gatekeeper/status.json``
(``gatekeeper:status``), staff only by default (see :mod:`.views`)."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "gatekeeper"

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("status.json", views.status_json, name="status"),
]
