"""A middleware below GateKeeper that short-circuits or raises when a request asks it to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib.auth.middleware import AuthenticationMiddleware
from django.http import HttpResponse


class TestHooksMiddleware:
    """``X-Short-Circuit: 1`` answers 204 without the view; ``X-Middleware-Raise: 1`` raises."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        if request.headers.get("X-Short-Circuit"):
            return HttpResponse(status=204)
        if request.headers.get("X-Middleware-Raise"):
            raise RuntimeError("a middleware below GateKeeper failed")
        return self.get_response(request)


class ApiHostMiddleware:
    """``X-Api-Host: 1`` resolves the request against ``urls.ApiURLs``: a urlconf chosen
    per request below GateKeeper, as django-hosts and django-tenants choose one."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        if request.headers.get("X-Api-Host"):
            from tests.django_project.urls import ApiURLs

            request.urlconf = ApiURLs
        return self.get_response(request)


class SiteAuthenticationMiddleware(AuthenticationMiddleware):
    """A site's own authentication middleware, made from Django's (as many are)."""
