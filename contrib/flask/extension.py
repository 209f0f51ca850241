"""The Flask extension: names each request by its endpoint and feeds per-view limits to the
core engine. Admission and release stay in the core middleware wrapped around
``app.wsgi_app`` (one path for WSGI, Django and Flask).

Naming (SPEC §1), decided here once:

* The URL is matched as Flask matches it (``app.create_url_adapter``: ``SERVER_NAME``,
  subdomain and host matching, ``TRUSTED_HOSTS``).
* Endpoint ``checkout`` (no blueprint): project = the ``project`` setting, service =
  ``checkout``.
* Endpoint ``shop.checkout``: project = blueprint ``shop``, service = ``checkout``.
* Nested blueprints (``api.v1.users``): project = the *top-level* blueprint ``api``, service
  = the rest of the endpoint, ``v1.users``. A limit on ``api`` so caps everything served
  under it, as Flask applies a parent's hooks to its children; service names stay unique.
* No route matched (404, 405, a strict-slashes redirect, an untrusted host): project = the
  ``project`` setting, service = ``unresolved`` (:data:`UNRESOLVED_SERVICE`, the core's
  :data:`~gatekeeper_wsgi.naming.UNRESOLVED`), so scans of random URLs share one
  service-level counter instead of creating one per path.
* Blueprint and endpoint names follow the core's one naming policy, as Django's URL
  names do (:func:`gatekeeper_wsgi.naming.name_segment`): runs of characters outside
  ``[A-Za-z0-9._:@-]`` become ``_``, cut at 128 characters, so every name is a safe limit
  path segment that a limit in the settings can name.

Behind a proxy, apply werkzeug's ``ProxyFix`` *after* ``init_app``
(``app.wsgi_app = ProxyFix(app.wsgi_app)``), so it runs first and ``key="ip"`` sees the
client's address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from flask import Blueprint, Flask, current_app, has_app_context
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from gatekeeper_wsgi.backends import check_backend_url
from gatekeeper_wsgi.config import Config, Mode, check_limit, load_config
from gatekeeper_wsgi.engine import ConfigSource
from gatekeeper_wsgi.engine import GateKeeper as Engine
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.middleware import GateKeeperMiddleware
from gatekeeper_wsgi.naming import UNRESOLVED, name_segment
from gatekeeper_wsgi.requestvalues import remember
from gatekeeper_wsgi.values import CALLER_RE

from .cli import EXTENSION_KEY, gatekeeper_cli

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment
    from flask.sansio.blueprints import BlueprintSetupState

    from gatekeeper_wsgi.status import StatusApp

__all__ = ["EXTENSION_KEY", "UNRESOLVED_SERVICE", "AppState", "GateKeeper"]

logger = logging.getLogger("gatekeeper")

#: Service of requests that match no route (404, 405, redirects, untrusted hosts): the
#: core's one constant, under the name this module always exported.
UNRESOLVED_SERVICE = UNRESOLVED

ViewFunc = TypeVar("ViewFunc", bound=Callable[..., Any])
QueueArg = Mapping[str, float] | tuple[int, float] | str


@dataclass(frozen=True)
class _ViewLimit:
    """One ``@gk.limit``: on the service level (``caller`` None) or on the caller level."""

    caller: str | None
    fields: Mapping[str, Any]


def _limit_fields(**given: Any) -> dict[str, Any]:
    fields = {name: value for name, value in given.items() if value is not None}
    queue = fields.get("queue")
    if isinstance(queue, tuple) and len(queue) == 2:  # another tuple: refused as `queue`
        size, wait = queue
        fields["queue"] = {"size": size, "wait": wait}
    return fields


def _validated(fields: dict[str, Any], path: str, where: str) -> dict[str, Any]:
    """Check the fields now, at decoration time, with the same rules as the settings."""
    try:
        check_limit(path, fields)
    except ConfigError as exc:
        name = exc.key.removeprefix(f"limits.{path}").lstrip(".")
        raise ConfigError(f"{where}: {name}" if name else where, exc.problem) from None
    return fields


def _chain(view: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """The view, the functions it wraps (``functools.wraps`` sets ``__wrapped__``) and, for
    a class-based view, its class (``View.as_view`` sets ``view_class``): ``@gk.limit``
    and ``@gk.exempt`` may decorate a ``View`` class as Django's decorators may."""
    seen = 0
    current: Any = view
    while current is not None and seen < 100:
        yield current
        view_class = getattr(current, "view_class", None)
        if view_class is not None:
            yield view_class
        current = getattr(current, "__wrapped__", None)
        seen += 1


class GateKeeper:
    """Flask extension: limits per app, blueprint and view, by the core engine.

    ::

        gk = GateKeeper()                      # or GateKeeper(app)

        @bp.route("/login", methods=["POST"])
        @gk.limit(rate="5/minute", key="ip", count=[401])   # limit "<bp>/login/*"
        def login(): ...

        @app.route("/health")
        @gk.exempt
        def health(): ...

        def create_app():
            app = Flask(__name__)
            app.config["GATEKEEPER"] = {"project": "shop", "limits": {"shop": {"concurrency": 50}}}
            app.register_blueprint(bp)
            gk.init_app(app)
            return app

    ``config`` (a settings dict or a ``.toml``/``.properties`` path) applies to every app
    this extension is initialised on; without it each app's ``app.config["GATEKEEPER"]``
    is used, else the defaults. Each app gets its own engine (``gk.gatekeeper_for(app)``).
    ``clock`` (monotonic seconds) is passed to the engines; tests inject one.

    Decorator limits are limits defined in code: the settings and the configuration file
    win over them path by path, and they survive reloads of the file.
    """

    def __init__(
        self,
        app: Flask | None = None,
        config: ConfigSource | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._config = config
        #: monotonic seconds for the engines; None: the engine's default
        self.clock = clock
        # Held weakly: a module-level extension outlives the apps of an app factory, whose
        # views (closures over their app) would otherwise keep every app and its engine.
        self._view_limits: weakref.WeakKeyDictionary[Callable[..., Any], list[_ViewLimit]] = (
            weakref.WeakKeyDictionary()
        )
        self._exempt: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()
        self._blueprint_limits: weakref.WeakKeyDictionary[Blueprint, dict[str, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._apps: list[weakref.ref[Flask]] = []
        self._lock = threading.Lock()
        #: bumped by every decorator call, so apps re-collect limits marked after init_app
        self.generation = 0
        if app is not None:
            self.init_app(app)

    # --- registration ---------------------------------------------------------------------

    def init_app(self, app: Flask) -> None:
        """Wrap ``app.wsgi_app`` with the core middleware; its engine starts on first use.

        The settings are validated now (:class:`ConfigError` naming the key). Raises
        :class:`RuntimeError` if a gatekeeper is already registered on ``app`` (wrapping
        twice would be a mistake; call ``init_app`` once per app).
        """
        if EXTENSION_KEY in app.extensions:
            raise RuntimeError(
                f"gatekeeper is already initialised on Flask app {app.name!r}; "
                "call GateKeeper(app) or gk.init_app(app) once per app"
            )
        # Only a missing setting means the defaults: anything else (0, "", False) is
        # validated as given, as Django's check and the engine do.
        setting = app.config.get("GATEKEEPER")
        source: ConfigSource = (
            self._config if self._config is not None else {} if setting is None else setting
        )
        # Validated now, once, to fail at start-up rather than on the first request:
        # settings, file, resolver, renderer, routes, and the backend's URL by the backend's
        # own code (its module imports: redis-py installed). The engine starts from this.
        config = load_config(source)
        check_backend_url(config.backend)
        inner: WSGIApplication = app.wsgi_app
        state = AppState(self, app, source, config, inner)
        app.wsgi_app = state  # type: ignore[method-assign]
        app.extensions[EXTENSION_KEY] = state
        app.cli.add_command(gatekeeper_cli)
        with self._lock:
            self._apps = [ref for ref in self._apps if ref() is not None]
            self._apps.append(weakref.ref(app))

    # --- the engine -----------------------------------------------------------------------

    @property
    def gatekeeper(self) -> Engine:
        """The engine of the current app (inside an app context), else of the one app
        this extension was initialised on."""
        return self._engine(None)

    def gatekeeper_for(self, app: Flask) -> Engine:
        """The engine of ``app``."""
        return self._engine(app)

    def _engine(self, app: Flask | None) -> Engine:
        state = self.state(app)
        # Views registered or marked since init_app: their limits, before anyone looks.
        state.refresh(if_changed=True)
        return state.gatekeeper

    def state(self, app: Flask | None = None) -> AppState:
        """The per-app state registered by :meth:`init_app` (``app.extensions["gatekeeper"]``)."""
        if app is None:
            if has_app_context():
                app = current_app._get_current_object()  # type: ignore[attr-defined]
            else:
                apps = [a for a in (ref() for ref in self._apps) if a is not None]
                if len(apps) != 1:
                    raise RuntimeError(
                        "gatekeeper: no app context and "
                        + ("no app initialised" if not apps else f"{len(apps)} apps initialised")
                        + "; use gk.gatekeeper_for(app) or an app context"
                    )
                app = apps[0]
        assert app is not None
        state = app.extensions.get(EXTENSION_KEY)
        if not isinstance(state, AppState) or state.extension is not self:
            raise RuntimeError(f"this GateKeeper is not initialised on Flask app {app.name!r}")
        return state

    # --- decorators -----------------------------------------------------------------------

    def limit(
        self,
        *,
        concurrency: int | None = None,
        rate: str | None = None,
        delay: float | None = None,
        queue: QueueArg | None = None,
        key: str | None = None,
        caller: str | None = None,
        count: list[int] | str | None = None,
        max_keys: int | None = None,
        mode: Mode | None = None,
        timeout_status: list[int] | None = None,
        timeout_header: str | None = None,
        timeout_body: str | None = None,
    ) -> Callable[[ViewFunc], ViewFunc]:
        """A limit on the decorated view; place it below ``@app.route`` (or on a ``View``
        class: every view ``as_view()`` makes of it has the limit).

        Without ``key`` and ``caller`` it limits the view's service, path
        ``<project>/<service>``. With ``key`` (``"caller"``, ``"ip"``, ``"user"``,
        ``"header:<Name>"``) it limits each key separately, path
        ``<project>/<service>/*``; ``caller="crm"`` limits one caller (one key value),
        path ``<project>/<service>/crm``. One service-level and any number of distinct
        caller-level limits can be stacked on a view. Invalid values raise
        :class:`ConfigError` at decoration time.
        """
        caller_level = key is not None or caller is not None
        segment = (caller or "*") if caller_level else None
        fields = _limit_fields(
            concurrency=concurrency,
            rate=rate,
            delay=delay,
            queue=queue,
            key=key,
            count=count,
            max_keys=max_keys,
            mode=mode,
            timeout_status=timeout_status,
            timeout_header=timeout_header,
            timeout_body=timeout_body,
        )
        probe = "view/service" if segment is None else f"view/service/{segment}"

        def decorate(view: ViewFunc) -> ViewFunc:
            where = f"@limit on {getattr(view, '__qualname__', view)!r}"
            if caller is not None and not (isinstance(caller, str) and CALLER_RE.fullmatch(caller)):
                raise ConfigError(
                    f"{where}: caller",
                    f"expected a caller name (1 to 128 of [A-Za-z0-9._:@-]), got {caller!r:.60}",
                )
            _validated(fields, probe, where)
            with self._lock:
                if view in self._exempt:
                    raise ConfigError(where, "the view is also @exempt")
                marks = self._view_limits.setdefault(view, [])
                if any(mark.caller == segment for mark in marks):
                    level = "service" if segment is None else f"caller {segment!r}"
                    raise ConfigError(where, f"a second limit on the {level} level of one view")
                marks.append(_ViewLimit(segment, fields))
                self.generation += 1
            return view

        return decorate

    def exempt(self, view: ViewFunc) -> ViewFunc:
        """Never limit the decorated view (health checks, status pages); below ``@app.route``,
        or on a ``View`` class."""
        with self._lock:
            if view in self._view_limits:
                raise ConfigError(f"@exempt on {view.__qualname__!r}", "the view also has @limit")
            self._exempt.add(view)
            self.generation += 1
        return view

    def limit_blueprint(
        self,
        blueprint: Blueprint,
        *,
        concurrency: int | None = None,
        rate: str | None = None,
        delay: float | None = None,
        queue: QueueArg | None = None,
        mode: Mode | None = None,
        timeout_status: list[int] | None = None,
        timeout_header: str | None = None,
        timeout_body: str | None = None,
    ) -> None:
        """A limit on the whole blueprint: its project level, path ``<blueprint name>``.

        Only top-level blueprints are projects (see the module docs): a limit on a
        nested blueprint raises :class:`ConfigError` when it is registered. Per-caller
        limits across a blueprint's views are the config path ``<blueprint>/*/*``.
        """
        where = f"limit_blueprint({blueprint.name!r})"
        fields = _validated(
            _limit_fields(
                concurrency=concurrency,
                rate=rate,
                delay=delay,
                queue=queue,
                mode=mode,
                timeout_status=timeout_status,
                timeout_header=timeout_header,
                timeout_body=timeout_body,
            ),
            "blueprint",
            where,
        )
        with self._lock:
            self._blueprint_limits[blueprint] = fields
            self.generation += 1

        def refuse_nested(setup: BlueprintSetupState) -> None:
            if setup.name_prefix:
                raise _nested_error(f"{setup.name_prefix}.{setup.name}")

        # Already registered: then it is checked when the app collects its limits.
        with contextlib.suppress(AssertionError):
            blueprint.record(refuse_nested)

    def status_blueprint(
        self,
        *,
        url_prefix: str = "/gatekeeper",
        auth: Callable[[], bool] | None = None,
        name: str = "gatekeeper",
    ) -> Blueprint:
        """A blueprint serving the status JSON (``<url_prefix>/status.json``) and the HTML
        dashboard (``<url_prefix>/``), never limited themselves.

        Access: whom ``auth()`` (called inside the request context) vouches for, and
        whoever sends the ``dashboard.token`` setting as ``Authorization: Bearer <token>``
        (or opens ``?token=<token>`` once, exchanged for a cookie); with neither an auth
        hook nor a token, every request is denied. No credentials -> 401, wrong -> 403.
        """
        from .status import status_blueprint

        return status_blueprint(self, url_prefix=url_prefix, auth=auth, name=name)

    # --- collecting the limits of one app --------------------------------------------------

    def collect(
        self, app: Flask, project: str
    ) -> tuple[dict[str, Mapping[str, Any]], dict[str, tuple[str, str] | None]]:
        """The code limits of ``app`` (path -> fields) and the identity of each endpoint
        (None = exempt)."""
        limits: dict[str, Mapping[str, Any]] = {}
        names: dict[str, tuple[str, str] | None] = {}
        with self._lock:
            view_limits = dict(self._view_limits)
            exempt = set(self._exempt)
            blueprint_limits = dict(self._blueprint_limits)
        for endpoint, view in list(app.view_functions.items()):
            chain = list(_chain(view))
            if any(func in exempt for func in chain):
                names[endpoint] = None
                continue
            identity = names[endpoint] = endpoint_identity(app, endpoint, project)
            marks = next((view_limits[func] for func in chain if func in view_limits), [])
            for mark in marks:
                path = "/".join(identity)
                if mark.caller is not None:
                    path = f"{path}/{mark.caller}"
                limits[path] = mark.fields
        for blueprint, fields in blueprint_limits.items():
            for registered_name, registered in list(app.blueprints.items()):
                if registered is blueprint:
                    if "." in registered_name:
                        raise _nested_error(registered_name)
                    limits[name_segment(registered_name)] = fields
        return limits, names


def _nested_error(name: str) -> ConfigError:
    top = name.split(".", 1)[0]
    return ConfigError(
        f"limit_blueprint({name!r})",
        f"a nested blueprint is part of the project of its top-level blueprint {top!r}; "
        f"limit {top!r} or the nested blueprint's views instead",
    )


def endpoint_identity(app: Flask, endpoint: str, project: str) -> tuple[str, str]:
    """(project, service) of an endpoint: the top-level blueprint and the rest of the
    endpoint, or the project setting and the endpoint."""
    top, dot, rest = endpoint.partition(".")
    if dot and top in app.blueprints:
        return name_segment(top), name_segment(rest)
    return project, name_segment(endpoint)


def _with_limits(source: ConfigSource, limits: Mapping[str, Mapping[str, Any]]) -> ConfigSource:
    """``source`` with code limits under its own (settings and file win per path)."""
    if not limits:
        return source
    if not isinstance(source, Mapping):
        return {"reload": {"file": os.fspath(source)}, "limits": dict(limits)}
    own = source.get("limits")
    return {**source, "limits": {**limits, **own} if isinstance(own, Mapping) else dict(limits)}


class AppState:
    """What :meth:`GateKeeper.init_app` keeps per app in ``app.extensions["gatekeeper"]``:
    the app's engine (started on first use) and the identify function of its middleware.

    The engine starts at the first request (or the first look at ``gk.gatekeeper``), when
    Flask's setup is normally finished: the backend is then sized for the view limits too,
    which matters for the shared backend (its table is sized when it is created). Views
    limited later are still added, within the table's spare room.
    """

    def __init__(
        self,
        extension: GateKeeper,
        app: Flask,
        source: ConfigSource,
        config: Config,
        inner: WSGIApplication,
    ) -> None:
        self.extension = extension
        self.app = app
        #: the settings dict or file path the engine is built from
        self.source = source
        #: ``source`` as validated by ``init_app`` (without the code limits)
        self.config = config
        #: the code limits last handed to the engine (decorators, limit_blueprint)
        self.code_limits: dict[str, Mapping[str, Any]] = {}
        #: the StatusApp behind the status blueprint, built on first use
        self.status_app: StatusApp | None = None
        self._inner = inner
        self._engine: Engine | None = None
        self._middleware: GateKeeperMiddleware | None = None
        self._names: dict[str, tuple[str, str] | None] = {}
        self._seen: tuple[int, str, int] | None = None
        self._lock = threading.Lock()
        # Matching a URL costs more than admission; the endpoint of a request line is
        # remembered (bounded), for as long as the views stay the same.
        self._endpoints: dict[tuple[Any, ...], str | None] = {}
        self._endpoints_for: tuple[int, str, int] | None = None

    @property
    def gatekeeper(self) -> Engine:
        """The app's engine, started now if it was not yet."""
        return self.middleware().gatekeeper

    def middleware(self) -> GateKeeperMiddleware:
        """The core middleware around the app, with its engine; started on first use."""
        middleware = self._middleware
        if middleware is None:
            with self._lock:
                middleware = self._middleware
                if middleware is None:
                    middleware = self._middleware = self._start()
        return middleware

    def _start(self) -> GateKeeperMiddleware:
        limits, names = self.extension.collect(self.app, self.config.project)
        # The configuration init_app validated, with the view limits: the engine's backend
        # is sized for both (the shared table is sized when it is created).
        config = self.config.with_code_limits(limits)
        clock = self.extension.clock
        engine = (
            Engine(self.source, code_limits=limits, validated=config)
            if clock is None
            else Engine(self.source, clock=clock, code_limits=limits, validated=config)
        )
        self._engine = engine
        self.code_limits = limits
        self._names = names
        self._seen = self._stamp()
        return GateKeeperMiddleware(self._inner, engine, identify=self.identify)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """``app.wsgi_app``: the core middleware, which admits, runs the app and releases."""
        middleware = self._middleware or self.middleware()
        return middleware(environ, start_response)

    def _stamp(self) -> tuple[int, str, int]:
        assert self._engine is not None
        return (
            len(self.app.view_functions),
            self._engine.config.project,
            self.extension.generation,
        )

    def refresh(self, *, if_changed: bool = False, in_request: bool = False) -> None:
        """Collect the app's view and blueprint limits and hand changes to the engine
        (``if_changed``: only when views, decorators or the project changed since)."""
        engine = self.middleware().gatekeeper
        with self._lock:
            stamp = self._stamp()
            if (if_changed or in_request) and stamp == self._seen:
                return
            limits, names = self.extension.collect(self.app, stamp[1])
            if limits != self.code_limits:
                try:
                    engine.add_limits(limits)
                except ConfigError as exc:
                    if not in_request:
                        raise
                    # The configuration file broke since start-up: the engine keeps its
                    # configuration; the view limits are applied on a later request.
                    logger.error("gatekeeper: could not apply the Flask view limits: %s", exc)
                    return
                self.code_limits = limits
            self._names = names
            self._seen = stamp

    def identify(self, environ: WSGIEnvironment) -> tuple[str, str] | None:
        """(project, service) of a request, or None for an exempt view."""
        engine = self._engine or self.gatekeeper
        if self._seen != self._stamp():
            self.refresh(in_request=True)  # views registered or marked since the start
        project = engine.config.project
        if self._endpoints_for != self._seen:
            self._endpoints = {}
            self._endpoints_for = self._seen
        get = environ.get
        key = (
            get("HTTP_HOST"),
            get("SERVER_NAME"),
            get("SERVER_PORT"),
            get("wsgi.url_scheme"),
            get("SCRIPT_NAME"),
            get("PATH_INFO"),
            get("REQUEST_METHOD"),
        )
        endpoints = self._endpoints
        try:
            endpoint = endpoints[key]
        except KeyError:
            endpoint = self._match(environ)
            # A Host header or path longer than MEMO_KEY_CHARS is matched afresh each time.
            size = sum(len(part) for part in key if isinstance(part, str))
            remember(endpoints, key, endpoint, size)
        if endpoint is None:
            return project, UNRESOLVED_SERVICE
        names = self._names
        if endpoint in names:
            return names[endpoint]
        return endpoint_identity(self.app, endpoint, project)

    def _match(self, environ: WSGIEnvironment) -> str | None:
        """The endpoint Flask will route this request to, or None when it will not."""
        app = self.app
        try:
            adapter = app.create_url_adapter(app.request_class(environ, shallow=True))
            if adapter is None:
                return None
            try:
                return str(adapter.match()[0])
            except RequestRedirect:
                # Flask answers a redirect (a missing trailing slash): unresolved, unless
                # it leads to an exempt view (the dashboard's mount without its slash).
                path = str(environ.get("PATH_INFO") or "")
                target = str(adapter.match(path + "/")[0])
                return target if self._names.get(target, ()) is None else None
        except HTTPException:  # NotFound, MethodNotAllowed, RequestRedirect, SecurityError
            return None
        except Exception:  # a hostile request must never turn into a 500 here
            logger.debug("gatekeeper: URL matching failed", exc_info=True)
            return None

    def effective_settings(self) -> ConfigSource:
        """The configured settings with the code limits under them (what ``check`` and
        ``status`` show), collected now without starting the engine."""
        if self._engine is not None:
            self.refresh(if_changed=True)
            return _with_limits(self.source, self.code_limits)
        limits, _ = self.extension.collect(self.app, self.config.project)
        return _with_limits(self.source, limits)
