"""The Django middleware: the core engine's admission and release around Django's handler."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from django.conf import settings
from django.core.handlers.wsgi import LimitedStream
from django.core.signals import setting_changed
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django.urls import Resolver404, ResolverMatch, get_urlconf, resolve
from django.utils import translation

from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.identify import Identifier
from gatekeeper_wsgi.kernel import (
    ADMISSION_KEY,
    REQUEST_ID_KEY,
    Gate,
    ResponseWatch,
    declared_length,
)
from gatekeeper_wsgi.naming import UNRESOLVED
from gatekeeper_wsgi.naming import name_segment as service_segment
from gatekeeper_wsgi.redact import failure_without_message
from gatekeeper_wsgi.rejectlog import ReplayedBody
from gatekeeper_wsgi.requestvalues import remember, wsgi_string

from .conf import get_gatekeeper
from .signals import request_rejected

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

__all__ = ["UNRESOLVED", "GateKeeperMiddleware", "service_segment"]

logger = logging.getLogger("gatekeeper")


#: Resolving a path costs more than everything else the middleware does, so its outcome
#: is memoized: (urlconf, path) -> (the namespace's project or None, service), or None for
#: an exempt view. Cleared when ROOT_URLCONF (or a language setting) changes, as Django
#: clears its URL caches.
_NAMES: dict[tuple[object, str], tuple[str | None, str] | None] = {}
_UNKNOWN = ("", "")


def _forget_names(*, setting: str, **kwargs: Any) -> None:
    if setting in ("ROOT_URLCONF", "USE_I18N", "LANGUAGE_CODE", "LANGUAGES"):
        _NAMES.clear()


setting_changed.connect(_forget_names, dispatch_uid="gatekeeper_wsgi.forget_names")


def _view_path(func: Callable[..., object]) -> str:
    """The dotted path of a view: module and qualified name of the function or class."""
    view = getattr(func, "view_class", func)
    if not hasattr(view, "__qualname__"):  # a callable instance, a functools.partial
        view = type(view)
    return f"{view.__module__}.{view.__qualname__}"


def _is_exempt(func: Callable[..., object]) -> bool:
    return bool(
        getattr(func, "gatekeeper_exempt", False)
        or getattr(getattr(func, "view_class", None), "gatekeeper_exempt", False)
    )


def _resolve_names(path: str, urlconf: str | None) -> tuple[str | None, str] | None:
    """(the namespace's project or None, service) of a path, or None for an exempt view.

    Under ``i18n_patterns`` a path resolves only in its own language (its prefix, or
    LANGUAGE_CODE without one), which LocaleMiddleware, running after this one, has not
    activated yet: the thread's language is whatever its last request left. So the path
    is resolved in the language it names, the same for every thread (the outcome is
    memoized by path)."""
    language = None
    if settings.USE_I18N:
        language = translation.get_language_from_path(path) or settings.LANGUAGE_CODE

    def resolved(candidate: str) -> ResolverMatch:
        with translation.override(language) if language else contextlib.nullcontext():
            return resolve(candidate, urlconf)

    try:
        match = resolved(path)
    except Resolver404:
        if (
            settings.APPEND_SLASH
            and not path.endswith("/")
            and _installed(tuple(settings.MIDDLEWARE), _COMMON)
        ):
            # CommonMiddleware will redirect it to the path with a slash: a redirect to
            # an exempt view (the dashboard's mount without its slash) is exempt too.
            with contextlib.suppress(Resolver404):
                if _is_exempt(resolved(path + "/").func):
                    return None
        return None, UNRESOLVED
    if _is_exempt(match.func):
        return None
    project = service_segment(match.namespace) if match.namespace else None
    return project, service_segment(match.url_name or _view_path(match.func))


class _Unresolved(NamedTuple):
    """A request admitted as ``unresolved`` (its path resolved to nothing before the
    middleware below this one ran), for :meth:`GateKeeperMiddleware.process_view`."""

    watch: ResponseWatch
    gate: Gate
    identifier: Identifier
    user: str | None


# Where __call__ leaves an _Unresolved for process_view: the request's own attributes.
_UNRESOLVED_KEY = "_gatekeeper_unresolved"


class _Encoding(SimpleNamespace):
    """What ``HttpResponseBase.make_bytes`` reads of a response: its charset."""

    charset: str


async def _amap(make: Callable[[Any], bytes], iterator: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    async for part in iterator:
        yield make(part)


def _content(response: StreamingHttpResponse) -> Iterator[bytes] | AsyncIterator[bytes]:
    """The pieces Django's ``streaming_content`` hands out (each made bytes), without a
    reference back to the response: that property maps the response's own ``make_bytes``,
    a bound method, so the watched stream set back in its place would make a cycle
    (response -> stream -> response), and a response dropped without ``close()`` would
    keep its slots until the cycle collector ran, not come back at once (SPEC 4.2). A
    class of its own ``make_bytes`` keeps Django's way (and the cycle)."""
    if type(response).make_bytes is not HttpResponseBase.make_bytes:
        return response.streaming_content
    encoding = cast("HttpResponseBase", _Encoding(charset=response.charset))
    make = partial(HttpResponseBase.make_bytes, encoding)
    iterator = response._iterator  # type: ignore[attr-defined]  # Django's, as the property reads it
    if response.is_async:
        return _amap(make, iterator)
    return map(make, iterator)


class _ReleasedWhenRead(list):  # type: ignore[type-arg]
    """A non-streamed body (``HttpResponse._container``) that releases once read whole.

    The server iterates the response (Django's ``__iter__`` iterates this list) or the
    ASGI handler reads ``content`` (``b"".join`` iterates a list subclass too), after
    this middleware, the outermost, has returned: so the slots come back when the body is
    handed out, before the server's ``close()`` - as the core middleware does - and a
    client's next request never meets its own previous one.
    """

    __slots__ = ("read", "watch")
    watch: ResponseWatch
    #: whether the body has been handed out (and so scanned for a body marker, by the
    #: watch's stream) at least in part
    read: bool

    def __iter__(self) -> Iterator[bytes]:
        self.read = True
        chunks = list.__iter__(self)
        length = sum(map(len, list.__iter__(self)))
        return self.watch.stream(chunks, length)

    def close(self) -> None:
        """The response's closer: releases (if the body's end did not already). A body
        nobody read before (Django's test client closes, then reads ``content``) is
        searched for the marker whole first; one that was read was searched as it went."""
        watch = self.watch
        if not self.read and watch.scans_body:
            watch.chunk(b"".join(list.__iter__(self)))
        watch.finish()


def _username(request: HttpRequest) -> str | None:
    user = getattr(request, "user", None)
    if user is None:
        user = _session_user(request)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    return str(user.get_username())


@functools.lru_cache(maxsize=16)
def _installed(middleware: tuple[str, ...], kind: str) -> bool:
    """Whether ``middleware`` (``settings.MIDDLEWARE``) holds the Django middleware class
    at dotted path ``kind``, or a class of a site's own made from it."""
    from django.utils.module_loading import import_string

    wanted = import_string(kind)
    for path in middleware:
        try:
            found = import_string(path)
        except ImportError:  # Django says so when it loads them; nothing to add here
            continue
        if isinstance(found, type) and issubclass(found, wanted):
            return True
    return False


#: sets request.user from the session (what a per-user limit reads)
_AUTHENTICATION = "django.contrib.auth.middleware.AuthenticationMiddleware"
#: redirects a path without its slash (APPEND_SLASH)
_COMMON = "django.middleware.common.CommonMiddleware"


class _SessionCopy(dict[str, Any]):
    """A copy of a session for ``get_user``: what it would change (a session whose
    password hash no longer verifies is flushed) changes only the copy - the request's
    own session is the business of Django's middleware, later."""

    def flush(self) -> None:
        self.clear()

    def cycle_key(self) -> None:
        pass


def _session_user(request: HttpRequest) -> Any:
    """The user Django's AuthenticationMiddleware will find for this request, found as it
    will (session cookie, session store, the session's backend and password hash), or
    None. Placed first, as it should be, this middleware runs before that one has set
    ``request.user``; a site without it has no session users (None)."""
    from importlib import import_module

    from django.conf import settings
    from django.contrib.auth import get_user

    if not _installed(tuple(settings.MIDDLEWARE), _AUTHENTICATION):
        return None
    session_key = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        return None  # anonymous: no session to read
    try:
        store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        # get_user reads nothing of a request but its session.
        probe = SimpleNamespace(session=_SessionCopy(store.items()))
        return get_user(cast("HttpRequest", probe))
    except Exception:  # a store down or a session it cannot read: as if anonymous
        logger.debug("gatekeeper: could not read the session's user", exc_info=True)
        return None


def _under_asgi(meta: Mapping[str, Any]) -> bool:
    """Whether Django serves the request under ASGI: its ASGIRequest has no ``wsgi.input``
    in its META (its WSGI requests, test client's included, always have one)."""
    return "wsgi.input" not in meta


def _give_back_body(request: HttpRequest, replay: ReplayedBody) -> None:
    """Let the request read again what the log read of its body: Django's
    request reads its ``_stream`` (under WSGI a ``LimitedStream`` of ``wsgi.input`` to
    its Content-Length, under ASGI the body received)."""
    if not replay.read_any or "_stream" not in request.__dict__:
        return  # nothing read (or a request object of another making): left as it is
    # What the stubs type as BinaryIO: any object with read() and readline() does.
    rewound: Any = replay.rewound()
    if not _under_asgi(request.META):
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        rewound = LimitedStream(rewound, max(0, length))
    request._stream = rewound


# A byte Django percent-encoded because it was not UTF-8 (repercent_broken_unicode: only
# bytes 0x80-0xFF, in capitals).
_REPERCENTED = re.compile(r"%[89A-F][0-9A-F]")


def _wsgi_path(text: str) -> str:
    """A ``PATH_INFO`` / ``SCRIPT_NAME`` Django has decoded, back in PEP 3333's form (the
    request's bytes as latin-1), which the rejected log reads from any WSGI environ:
    Django decodes the path's bytes as UTF-8 and percent-encodes those that are not, and
    the path logged (and replayed) would otherwise name another resource. A literal
    ``%FF`` in the decoded path (``%25FF`` on the request line) cannot be told apart
    from a byte Django encoded, and is taken as the byte."""
    wsgi = wsgi_string(text)
    if "%" in wsgi:  # the byte, as latin-1 holds it
        wsgi = _REPERCENTED.sub(lambda found: chr(int(found[0][1:], 16)), wsgi)
    return wsgi


class _DjangoGate(Gate):
    """The core's Gate, told apart from what Django itself puts into ``request.META``."""

    def server_is_multiprocess(self, environ: WSGIEnvironment) -> bool:
        # Django's ASGIRequest and its test client (a FakePayload as wsgi.input) set
        # wsgi.multiprocess=True whatever serves them: only a WSGI server's own environ
        # says so. A forked ASGI worker is still detected by the memory backend's fork hook.
        if not environ.get("wsgi.multiprocess") or _under_asgi(environ):
            return False
        from django.test.client import FakePayload

        return not isinstance(environ["wsgi.input"], FakePayload)


class GateKeeperMiddleware:
    """Django middleware that admits or rejects each request by ``settings.GATEKEEPER``.

    Put it first, so it decides before any other middleware or the view does work::

        MIDDLEWARE = [
            "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware",
            "django.middleware.security.SecurityMiddleware",
            ...
        ]
        GATEKEEPER = {
            "project": "shop",
            "limits": {
                "shop": {"concurrency": 100},
                "shop/checkout": {"concurrency": 10, "queue": {"size": 20, "wait": 1.5}},
            },
        }

    **Naming.** The request path (``request.path_info``, resolved against
    ``request.urlconf`` when set, else ``ROOT_URLCONF``) gives the levels: project = the
    URL namespace (``"shop"``, nested ``"shop:admin"``), else the ``project`` setting;
    service = the URL name; a pattern without a name uses the view's dotted path
    (``myapp.views.checkout``, ``myapp.views.CheckoutView``); names are made safe by the
    core's one naming policy (:mod:`gatekeeper_wsgi.naming`; ``service_segment`` is its
    :func:`~gatekeeper_wsgi.naming.name_segment`). A path that resolves to nothing counts
    as service ``unresolved`` (:data:`~gatekeeper_wsgi.naming.UNRESOLVED`) of the
    ``project`` setting, so 404 floods are limited too - unless Django, once the
    middleware below has run, resolves it after all (a ``request.urlconf`` set by
    django-hosts or django-tenants, a translated route in the language LocaleMiddleware
    activated): :meth:`process_view` then counts it under Django's own match instead,
    before the view runs (admitted as ``unresolved`` until then: a full ``unresolved``
    limit refuses it, as it cannot yet be told apart from a 404). Views marked
    ``@gatekeeper_exempt`` are never limited. The ``routes`` setting is for bare WSGI and
    ignored here.

    **Caller.** From the configured header, or ``caller.resolver(request.META)``. Limits
    with ``key: "user"`` read ``request.user`` (its username when authenticated), else
    ``REMOTE_USER``. Running first, this middleware comes before Django's
    ``AuthenticationMiddleware`` has set ``request.user``: it then finds the user the way
    that one will (the session cookie, the session store, ``auth.get_user``) on a copy of
    the session, so a per-user limit counts each logged-in user apart wherever it sits.
    That is a session read per request of a project with a per-user limit (Django's own
    read of it comes later).

    **Release.** Through the core's release path (:class:`ResponseWatch`): the slots
    come back when the response's body is read to its end or the server closes it,
    whichever is first (a closer on ``response._resource_closers``), whatever the
    response: streamed
    (``StreamingHttpResponse`` content is wrapped, so timeout markers are scanned as it
    streams and an error mid-stream counts as faulty), ``FileResponse`` (streamed through the
    watch too, not handed to the server's ``wsgi.file_wrapper``, whose sendfile end nothing
    would see; released once its ``Content-Length`` is handed out),
    500 responses Django made from exceptions in views or other middleware (faulty, so
    ``delay`` applies), and responses short-circuited by middleware below. A response
    dropped without ``close()`` releases when it is garbage collected.

    **Rejection.** A ServiceFault rendered like the WSGI middleware's, logged on
    ``gatekeeper.rejected``, and the ``request_rejected`` signal sent (see
    :mod:`gatekeeper_wsgi.contrib.django.signals`). When the WSGI
    ``GateKeeperMiddleware`` also wraps the Django app, the request was counted there
    (``request.META["gatekeeper.admission"]``) and is not counted again.

    **ASGI.** This is a synchronous middleware; under ``ASGIHandler`` Django adapts it
    (runs it in the request's thread-sensitive worker thread). It works the same, but a
    request waiting in a ``queue`` holds that thread while it waits. If the client
    disconnects while the view runs, Django cancels the request: the slots come back
    (not as faulty) once the view has stopped - an async view at its cancellation, a
    sync view when it returns, since its thread cannot be interrupted.
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        # Built now, so a broken configuration fails at start-up, not on a request.
        self._gate = _DjangoGate(get_gatekeeper())

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        meta = request.META
        if ADMISSION_KEY in meta:  # already counted by the WSGI middleware around Django
            return self.get_response(request)
        started = time.perf_counter()
        gate = self._gate
        keeper = get_gatekeeper()
        if gate.keeper is not keeper:  # settings.GATEKEEPER was replaced
            gate = self._gate = _DjangoGate(keeper)
        identifier = gate.identifier()
        names = self._names(request, identifier.config.project)
        if names is None:
            return self.get_response(request)
        project, service = names
        user = _username(request) if identifier.needs_user else None
        try:
            admission = gate.admit(identifier, meta, project, service, user, started)
        except Rejected as rejected:
            return self._reject(request, rejected, gate)
        watch = ResponseWatch(admission)
        if service == UNRESOLVED:
            # Named again once Django resolved it (process_view): see _Unresolved.
            request.__dict__[_UNRESOLVED_KEY] = _Unresolved(watch, gate, identifier, user)
        try:
            response = self.get_response(request)
            head = request.method == "HEAD"
            self._watch(response, watch, head)
            if head and _under_asgi(meta):
                # Under ASGI the server writes the headers, a HEAD's whole answer, as
                # Django sends them - before Django reads the body (a sync stream in a
                # thread, the event loop free to take the client's next request, which
                # its own HEAD would refuse: SPEC 4.2). Released now; under WSGI the
                # first piece of the body is taken before the headers go out.
                watch.finish()
        except asyncio.CancelledError:  # under ASGI: the client went away, not a fault
            watch.finish()
            raise
        except BaseException:
            watch.error()
            watch.finish()
            raise
        return response

    def process_view(
        self,
        request: HttpRequest,
        view: Callable[..., Any],
        view_args: Any,
        view_kwargs: Any,
    ) -> HttpResponseBase | None:
        """A request admitted as ``unresolved`` that Django did resolve: named again by
        Django's own match and admitted under those names in its place (released first,
        so its own hold cannot refuse it). Middleware below this one may choose the
        urlconf (``request.urlconf``: django-hosts, django-tenants) or the language of
        translated URL patterns (LocaleMiddleware); this one, running first, resolved the
        path before they ran."""
        pending: _Unresolved | None = request.__dict__.pop(_UNRESOLVED_KEY, None)
        match = request.resolver_match
        if pending is None or match is None:
            return None
        watch, gate, identifier, user = pending
        unresolved = watch.admission
        if _is_exempt(view):
            unresolved.release(None, False)
            return None
        project = service_segment(match.namespace) if match.namespace else None
        service = service_segment(match.url_name or _view_path(match.func))
        unresolved.release(None, False)
        gate.keeper.monitor.admitted -= 1  # one request: counted by the admission below
        try:
            watch.admission = gate.admit(
                identifier,
                request.META,
                project or identifier.config.project,
                service,
                user,
                time.perf_counter(),
            )
        except Rejected as rejected:
            return self._reject(request, rejected, gate)
        return None

    @staticmethod
    def _names(request: HttpRequest, default_project: str) -> tuple[str, str] | None:
        """(project, service) of the request, or None for an exempt view."""
        urlconf = getattr(request, "urlconf", None)
        path = request.path_info
        key = (get_urlconf() if urlconf is None else urlconf, path)
        names = _NAMES.get(key, _UNKNOWN)
        if names is _UNKNOWN:
            names = remember(_NAMES, key, _resolve_names(path, urlconf), len(path))
        if names is None:
            return None
        project, service = names
        return project or default_project, service

    @staticmethod
    def _watch(response: HttpResponseBase, watch: ResponseWatch, head: bool) -> None:
        """Feed the response to the watch and release on its close (a HEAD's stream as
        it starts: see :class:`gatekeeper_wsgi.middleware.GateKeeperMiddleware`)."""
        watch.headers(response.status_code, response.items())
        if isinstance(response, StreamingHttpResponse):
            # A FileResponse too: setting its streaming content drops its file_to_stream,
            # so Django's WSGI handler does not hand the file to the server's
            # wsgi.file_wrapper (sendfile), whose end nothing would see before the server's
            # close() (SPEC 4.2; see GateKeeperMiddleware). Released once the declared
            # Content-Length is handed out, or when exhausted; an error mid-stream releases
            # at once: Django's ASGI handler skips close() when a stream raises.
            content = _content(response)
            declared = response.headers.get("Content-Length")
            length = None if declared is None else declared_length(declared)
            if head:
                length = 0
            # Django's streaming_content is an async iterator exactly when is_async;
            # a cast, not isinstance(AsyncIterator), which costs ~0.4 µs per response.
            if response.is_async:
                response.streaming_content = watch.astream(
                    cast("AsyncIterator[bytes]", content), length, head=head
                )
            else:
                response.streaming_content = watch.stream(
                    cast("Iterator[bytes]", content), length, head=head
                )
        elif isinstance(response, HttpResponse):
            container = getattr(response, "_container", None)
            if type(container) is list:  # an HttpResponse's (not a custom class's)
                # Django's private body list and closers, which django-stubs leave out.
                response._container = body = _ReleasedWhenRead(container)  # type: ignore[attr-defined]
                body.watch = watch
                body.read = False
                # The body is scanned once: as it is read, or whole at the close when
                # nobody read it before (see _ReleasedWhenRead.close).
                response._resource_closers.append(body.close)  # type: ignore[attr-defined]
                return
            if watch.scans_body:
                watch.chunk(response.content)
        # The closer holds the watch, so a response dropped without close() finishes it
        # when collected (ResponseWatch's safety net).
        response._resource_closers.append(watch.finish)  # type: ignore[attr-defined]

    def _reject(self, request: HttpRequest, rejected: Rejected, gate: Gate) -> HttpResponse:
        meta = request.META
        log_environ = {**meta, "PATH_INFO": _wsgi_path(meta.get("PATH_INFO", ""))}
        log_environ["SCRIPT_NAME"] = _wsgi_path(meta.get("SCRIPT_NAME", ""))
        # What the log reads of the body is read through a stream that keeps it, and given
        # back to the request, so a request_rejected receiver still reads the whole body
        # (request.body, request.POST).
        if _under_asgi(meta):
            # The body Django received whole (so it ends where the stream does, chunked
            # or not).
            stream = getattr(request, "_stream", request)
            log_environ["wsgi.input_terminated"] = True
        else:
            stream = meta["wsgi.input"]
        replay = log_environ["wsgi.input"] = ReplayedBody(stream, record=True)
        status, headers, body = gate.fault(meta, rejected, log_environ)
        _give_back_body(request, replay)
        code, _, reason = status.partition(" ")
        # A HEAD response carries the GET's headers and no content (RFC 9110 9.3.2), as the
        # WSGI middleware sends it: not every server drops what a HEAD response holds.
        content = b"" if request.method == "HEAD" else body
        response = HttpResponse(content, status=int(code), reason=reason or None)
        for name, value in headers:
            response[name] = value
        # Reported once, on gatekeeper.rejected (INFO); without this mark django.request
        # would log every rejection again as an ERROR (a 503), which AdminEmailHandler
        # mails to ADMINS.
        response._has_been_logged = True  # type: ignore[attr-defined]  # Django's own mark
        for receiver, result in request_rejected.send_robust(
            sender=type(self), request=request, rejected=rejected, request_id=meta[REQUEST_ID_KEY]
        ):
            if isinstance(result, Exception):
                logger.error(
                    "gatekeeper: request_rejected receiver %r raised: %s",
                    receiver,
                    failure_without_message(result),
                )
        return response
