"""URLs of the example Django site: the URL names are the gatekeeper service names."""

from __future__ import annotations

from django.urls import include, path

from example_site.django_site import views

urlpatterns = [
    path("", views.home, name="home"),
    path("slow", views.slow, name="slow"),
    path("flaky", views.flaky, name="flaky"),
    path("login", views.login, name="login"),
    path("partner", views.partner, name="partner"),
    path("search", views.search, name="search"),
    path("gatekeeper/", include("gatekeeper_wsgi.contrib.django.urls")),
]
