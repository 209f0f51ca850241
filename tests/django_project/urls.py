"""URLs of the test project: named, namespaced, unnamed and exempt views."""

from __future__ import annotations

from typing import Any, ClassVar

from django.urls import include, path

from tests.django_project import views

shop_patterns = (
    [
        path("checkout/", views.inflight_now, name="checkout"),
        path("unnamed/", views.unnamed),
    ],
    "shop",
)

urlpatterns = [
    path("work/", views.inflight_now, name="work"),
    path("unnamed/", views.unnamed),
    path("shop/", include(shop_patterns)),
    path("status/<int:code>/", views.status, name="status"),
    path("body/", views.body, name="body"),
    path("boom/", views.boom, name="boom"),
    path("stream/", views.stream, name="stream"),
    path("astream/", views.astream, name="astream"),
    path("file/", views.file, name="file"),
    path("chunks/", views.chunks, name="chunks"),
    path("whoami/", views.whoami, name="whoami"),
    path("async/", views.async_view, name="async"),
    path("hold/", views.hold, name="hold"),
    path("ahold/", views.ahold, name="ahold"),
    path("observe/", views.observe, name="observe"),
    path("open/", views.open_gate, name="open"),
    path("observed/", views.observed, name="observed"),
    path("health/", views.health, name="health"),
    path("gk/", include("gatekeeper_wsgi.contrib.django.urls")),
]


class ApiURLs:
    """The URLs of another host, chosen by a middleware below GateKeeper
    (``request.urlconf``, as django-hosts and django-tenants do): see
    ``middleware.ApiHostMiddleware``."""

    urlpatterns: ClassVar[list[Any]] = [path("v1/orders/", views.inflight_now, name="orders")]
