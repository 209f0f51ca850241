"""The Flask extension through the Flask test client: naming (blueprint -> project, endpoint
-> service), per-view and blueprint limits, exemption, reload, streaming, the status
blueprint, the CLI group and application factories."""

from __future__ import annotations

import gc
import json
import logging
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Blueprint, Flask, Response, request, stream_with_context
from flask.views import MethodView
from gatekeeper_wsgi.contrib.flask import UNRESOLVED_SERVICE, GateKeeper
from werkzeug.test import EnvironBuilder

from gatekeeper_wsgi import ConfigError, backends, rejectlog
from tests.conftest import FakeClock, busy


def make_app(settings: dict[str, Any] | None = None, **flask_options: Any) -> Flask:
    """A bare Flask app with GATEKEEPER settings."""
    app = Flask("gk_test", **flask_options)
    app.config["GATEKEEPER"] = settings or {}
    return app


def identity(app: Flask, path: str, **builder: Any) -> tuple[str, str] | None:
    """What the extension names a request to ``path``."""
    state = app.extensions["gatekeeper"]
    environ = EnvironBuilder(path=path, **builder).get_environ()
    result: tuple[str, str] | None = state.identify(environ)
    return result


def held_stream() -> Response:
    """A streamed response that stays in flight until the client closes it."""

    def generate() -> Iterator[str]:
        yield "first\n"
        yield "second\n"

    return Response(stream_with_context(generate()))


def code_of(response: Any) -> str:
    """The ServiceFault code of a rejection."""
    return str(response.get_json()["code"])


# --- naming -------------------------------------------------------------------------------


def test_endpoint_names_project_and_service() -> None:
    """Blueprint -> project, endpoint without blueprint -> service, else the project setting."""
    app = make_app({"project": "shop"})
    shop = Blueprint("orders", __name__)
    v1 = Blueprint("v1", __name__)

    @app.route("/")
    def index() -> str:
        return "index"

    @shop.route("/checkout")
    def checkout() -> str:
        return "checkout"

    @v1.route("/items")
    def items() -> str:
        return "items"

    shop.register_blueprint(v1, url_prefix="/v1")
    app.register_blueprint(shop, url_prefix="/orders")
    GateKeeper(app)
    assert identity(app, "/") == ("shop", "index")
    assert identity(app, "/orders/checkout") == ("orders", "checkout")
    assert identity(app, "/orders/v1/items") == ("orders", "v1.items")
    assert identity(app, "/static/app.css") == ("shop", "static")


def test_unmatched_urls_are_one_unresolved_service() -> None:
    """404, 405 and strict-slash redirects count as service 'unresolved' of the project."""
    app = make_app({"project": "shop", "limits": {"shop/unresolved": {"concurrency": 0}}})

    @app.route("/only-get")
    def only_get() -> str:
        return "ok"

    @app.route("/dir/")
    def directory() -> str:
        return "dir"

    GateKeeper(app)
    assert identity(app, "/nope") == ("shop", UNRESOLVED_SERVICE)
    assert identity(app, "/only-get", method="POST") == ("shop", UNRESOLVED_SERVICE)
    assert identity(app, "/dir") == ("shop", UNRESOLVED_SERVICE)
    with app.test_client() as client:
        with client.get("/nope") as response:
            assert response.status_code == 503
            assert code_of(response) == "GK-CONCURRENCY-LIMIT"
        with client.get("/only-get") as response:
            assert response.status_code == 200


def test_config_limits_address_blueprints_and_endpoints() -> None:
    """Config paths '<blueprint>' and '<project>/<endpoint>' limit what Flask routes there."""
    app = make_app(
        {"project": "site", "limits": {"admin": {"concurrency": 0}, "site/about": {"rate": "1/h"}}}
    )
    admin = Blueprint("admin", __name__)

    @admin.route("/panel")
    def panel() -> str:
        return "panel"

    @app.route("/about")
    def about() -> str:
        return "about"

    app.register_blueprint(admin, url_prefix="/admin")
    GateKeeper(app)
    with app.test_client() as client:
        with client.get("/admin/panel") as response:
            assert response.status_code == 503
            assert response.get_json()["limit"] == {"path": "admin", "value": 0}
        with client.get("/about") as response:
            assert response.status_code == 200
        with client.get("/about") as response:
            assert response.status_code == 429


def test_subdomain_matching_follows_server_name() -> None:
    """With SERVER_NAME and subdomain matching, the host picks the endpoint as in Flask."""
    app = make_app({"limits": {"default/api_index": {"concurrency": 0}}}, subdomain_matching=True)
    app.config["SERVER_NAME"] = "example.com"

    @app.route("/", subdomain="api")
    def api_index() -> str:
        return "api"

    @app.route("/")
    def index() -> str:
        return "www"

    GateKeeper(app)
    with app.test_client() as client:
        with client.get("/", base_url="http://api.example.com") as response:
            assert response.status_code == 503
        with client.get("/", base_url="http://example.com") as response:
            assert response.data == b"www"


# --- decorators ---------------------------------------------------------------------------


def test_view_limit_holds_until_the_stream_is_closed() -> None:
    """@limit(concurrency=1): a second request is refused while the first streams."""
    app = make_app({"project": "shop"})
    gk = GateKeeper(app)

    @app.route("/export")
    @gk.limit(concurrency=1)
    def export() -> Response:
        return held_stream()

    with app.test_client() as client:
        first = client.get("/export")
        assert gk.gatekeeper.inflight()["shop/export"] == 1
        with client.get("/export") as second:
            assert second.status_code == 503
            assert second.get_json()["limit"] == {"path": "shop/export", "value": 1}
        assert first.get_data() == b"first\nsecond\n"
        first.close()
        assert gk.gatekeeper.inflight()["shop/export"] == 0
        with client.get("/export") as third:
            assert third.status_code == 200


def test_key_limits_each_caller_separately(clock: FakeClock) -> None:
    """@limit(key='ip') is the caller-level path '<project>/<service>/*', one window per IP."""
    app = make_app({"project": "shop"})
    gk = GateKeeper(app, clock=clock)

    @app.route("/login", methods=["POST"])
    @gk.limit(rate="1/minute", key="ip")
    def login() -> str:
        return "welcome"

    def post(ip: str) -> int:
        with app.test_client().post("/login", environ_base={"REMOTE_ADDR": ip}) as response:
            return response.status_code

    assert "shop/login/*" in gk.gatekeeper.config.limits
    assert [post("10.0.0.1"), post("10.0.0.2"), post("10.0.0.1")] == [200, 200, 429]
    clock.advance(60)
    assert post("10.0.0.1") == 200


def test_caller_limit_applies_to_that_caller_only() -> None:
    """@limit(caller='crm') limits requests of caller crm and nobody else."""
    app = make_app({"project": "shop"})
    gk = GateKeeper(app)

    @app.route("/orders")
    @gk.limit(caller="crm", concurrency=0)
    def orders() -> str:
        return "orders"

    with app.test_client() as client:
        with client.get("/orders", headers={"X-Caller-Id": "crm"}) as response:
            assert response.status_code == 503
            assert response.get_json()["limit"]["path"] == "shop/orders/crm"
        with client.get("/orders", headers={"X-Caller-Id": "web"}) as response:
            assert response.status_code == 200


def test_stacked_service_and_caller_limits() -> None:
    """A service-level and a caller-level @limit on one view both apply."""
    app = make_app({"project": "shop"})
    gk = GateKeeper(app)

    @app.route("/search")
    @gk.limit(concurrency=5)
    @gk.limit(key="header:X-Tenant", concurrency=0)
    def search() -> str:
        return "results"

    limits = gk.gatekeeper.config.limits
    assert limits["shop/search"].concurrency == 5
    assert limits["shop/search/*"].key == "header:X-Tenant"
    with app.test_client().get("/search") as response:
        assert response.get_json()["limit"]["path"] == "shop/search/*"


def test_exempt_view_is_never_limited() -> None:
    """@exempt views pass even a closed project; the others are refused."""
    app = make_app({"project": "shop", "limits": {"shop": {"concurrency": 0}}})
    gk = GateKeeper(app)

    @app.route("/health")
    @gk.exempt
    def health() -> str:
        return "ok"

    @app.route("/cart")
    def cart() -> str:
        return "cart"

    with app.test_client() as client:
        with client.get("/health") as response:
            assert response.status_code == 200
        with client.get("/cart") as response:
            assert response.status_code == 503
    assert gk.gatekeeper.stats()["counters"]["admitted"] == 0


def test_limit_blueprint_caps_all_its_views() -> None:
    """limit_blueprint: one project-level counter shared by every view of the blueprint."""
    gk = GateKeeper()
    reports = Blueprint("reports", __name__)
    gk.limit_blueprint(reports, concurrency=1)

    @reports.route("/daily")
    def daily() -> Response:
        return held_stream()

    @reports.route("/weekly")
    def weekly() -> str:
        return "weekly"

    app = make_app()
    app.register_blueprint(reports, url_prefix="/reports")
    gk.init_app(app)
    with app.test_client() as client:
        with client.get("/reports/daily"), client.get("/reports/weekly") as refused:
            assert refused.status_code == 503
            assert refused.get_json()["limit"] == {"path": "reports", "value": 1}
        with client.get("/reports/weekly") as response:
            assert response.status_code == 200


def test_limit_on_a_nested_blueprint_is_refused_at_registration() -> None:
    """A nested blueprint is not a project: limit_blueprint on it fails when registered."""
    gk = GateKeeper()
    parent = Blueprint("api", __name__)
    child = Blueprint("v1", __name__)
    gk.limit_blueprint(child, concurrency=1)

    @child.route("/x")
    def x() -> str:
        return "x"

    parent.register_blueprint(child, url_prefix="/v1")
    app = make_app()
    with pytest.raises(ConfigError, match=r"limit_blueprint\('api\.v1'\).*limit 'api'"):
        app.register_blueprint(parent)


def test_settings_win_over_a_decorator_for_the_same_path() -> None:
    """A limit in the settings replaces the decorator's limit on the same path."""
    app = make_app({"project": "shop", "limits": {"shop/pay": {"concurrency": 7}}})
    gk = GateKeeper(app)

    @app.route("/pay")
    @gk.limit(concurrency=0)
    def pay() -> str:
        return "paid"

    with app.test_client().get("/pay") as response:
        assert response.status_code == 200
    assert gk.gatekeeper.config.limits["shop/pay"].concurrency == 7


def test_invalid_decorator_values_fail_at_decoration() -> None:
    """A bad @limit value raises ConfigError naming the view and the field."""
    gk = GateKeeper()

    def view() -> str:
        return "x"

    with pytest.raises(ConfigError, match=r"@limit on 'test_.*view': rate: expected a rate"):
        gk.limit(rate="many")(view)
    with pytest.raises(ConfigError, match=r"concurrency.*expected an integer >= 0"):
        gk.limit(concurrency=-1)(view)
    with pytest.raises(ConfigError, match="caller"):
        gk.limit(caller="bad caller", concurrency=1)(view)
    # a caller that is no caller name: named as `caller` (not as an internal path), and
    # an empty one is not taken as "every caller"
    for bad in ("a/b", ""):
        with pytest.raises(ConfigError, match=r"@limit on 'test_.*view': caller: expected"):
            gk.limit(caller=bad, concurrency=1)(view)
    # a queue tuple of the wrong length is refused as `queue`, not with a ValueError
    for queue in ((1,), (1, 2, 3)):
        with pytest.raises(ConfigError, match=r"@limit on 'test_.*view': queue"):
            gk.limit(concurrency=1, queue=queue)(view)  # type: ignore[arg-type]


def test_limit_and_exempt_on_one_view_conflict() -> None:
    """A view cannot be both limited and exempt, in either order."""
    gk = GateKeeper()

    def one() -> str:
        return "1"

    def two() -> str:
        return "2"

    gk.limit(concurrency=1)(one)
    with pytest.raises(ConfigError, match="also has @limit"):
        gk.exempt(one)
    gk.exempt(two)
    with pytest.raises(ConfigError, match="also @exempt"):
        gk.limit(concurrency=1)(two)


def test_views_added_after_init_app_get_their_limits() -> None:
    """Blueprints registered after init_app are collected before the first request."""
    gk = GateKeeper()
    late = Blueprint("late", __name__)

    @late.route("/x")
    @gk.limit(concurrency=0)
    def x() -> str:
        return "x"

    app = make_app()
    gk.init_app(app)
    app.register_blueprint(late, url_prefix="/late")
    with app.test_client().get("/late/x") as response:
        assert response.status_code == 503
        assert response.get_json()["limit"]["path"] == "late/x"


def test_functools_wrapped_view_keeps_its_limit() -> None:
    """A decorator with functools.wraps between @app.route and @limit keeps the limit."""
    import functools

    gk = GateKeeper()
    app = make_app({"project": "p"})

    def logged(view: Any) -> Any:
        @functools.wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return view(*args, **kwargs)

        return wrapper

    @app.route("/w")
    @logged
    @gk.limit(concurrency=0)
    def w() -> str:
        return "w"

    gk.init_app(app)
    with app.test_client().get("/w") as response:
        assert response.status_code == 503


def test_limit_and_exempt_on_a_view_class() -> None:
    """@gk.limit and @gk.exempt on a class-based view (a MethodView) apply to the view
    as_view() makes of it, as on a function."""
    gk = GateKeeper()
    app = make_app({"project": "p", "limits": {"p": {"concurrency": 1}}})

    @gk.limit(concurrency=0)
    class Closed(MethodView):
        def get(self) -> str:
            return "closed"

    @gk.exempt
    class Health(MethodView):
        def get(self) -> str:
            return "ok"

    app.add_url_rule("/closed", view_func=Closed.as_view("closed"))
    app.add_url_rule("/health", view_func=Health.as_view("health"))
    gk.init_app(app)
    client = app.test_client()
    refused = client.get("/closed")
    assert refused.status_code == 503
    assert refused.get_json()["limit"] == {"path": "p/closed", "value": 0}
    held = client.get("/health")  # exempt: not even the project's one slot is taken
    assert (held.status_code, client.get("/health").status_code) == (200, 200)
    assert busy(gk.gatekeeper) == {}


# --- faulty responses ---------------------------------------------------------------------


def test_error_inside_a_stream_holds_the_slot_for_the_delay(clock: FakeClock) -> None:
    """A stream_with_context generator that raises is faulty: its slot returns after
    delay, counted from the raise - also when nothing closes the response (Flask's test
    client without `with`, the response still held)."""
    app = make_app({"project": "shop"})
    gk = GateKeeper(app, clock=clock)

    @app.route("/feed")
    @gk.limit(concurrency=1, delay=5.0)
    def feed() -> Response:
        def generate() -> Iterator[str]:
            yield f"page {request.args['page']}\n"
            raise RuntimeError("backend died")

        return Response(stream_with_context(generate()))

    client = app.test_client()
    response = client.get("/feed?page=1")
    with pytest.raises(RuntimeError, match="backend died"):
        response.get_data()
    with client.get("/feed?page=2") as refused:
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "5"
    clock.advance(5.0)
    assert gk.gatekeeper.inflight().get("shop/feed", 0) == 0
    admitted = client.get("/feed?page=3")
    with pytest.raises(RuntimeError):
        admitted.get_data()
    assert response.status_code == 200  # the first response: still held, never closed


def test_500_from_a_view_is_faulty_and_delayed(clock: FakeClock) -> None:
    """A view raising (Flask answers 500) holds its slot for the delay, then frees it."""
    app = make_app({"project": "shop"})
    gk = GateKeeper(app, clock=clock)

    @app.route("/pay")
    @gk.limit(concurrency=1, delay=2.0)
    def pay() -> str:
        raise ValueError("card service down")

    with app.test_client() as client:
        with client.get("/pay") as response:
            assert response.status_code == 500
        assert gk.gatekeeper.inflight()["shop/pay"] == 1
        with client.get("/pay") as response:
            assert response.status_code == 503
        clock.advance(2.0)
        assert gk.gatekeeper.inflight()["shop/pay"] == 0


# --- configuration and factories ----------------------------------------------------------


def test_factory_apps_get_their_own_engine_and_settings() -> None:
    """One extension, two apps: each has its own engine, configured from its app.config."""
    gk = GateKeeper()

    def create(project: str) -> Flask:
        app = make_app({"project": project})

        @app.route("/x")
        @gk.limit(concurrency=3)
        def x() -> str:
            return "x"

        gk.init_app(app)
        return app

    first, second = create("one"), create("two")
    assert gk.gatekeeper_for(first) is not gk.gatekeeper_for(second)
    assert set(gk.gatekeeper_for(first).config.limits) == {"one/x"}
    assert set(gk.gatekeeper_for(second).config.limits) == {"two/x"}
    with second.app_context():
        assert gk.gatekeeper is gk.gatekeeper_for(second)
    with pytest.raises(RuntimeError, match="2 apps initialised"):
        _ = gk.gatekeeper


def test_constructor_config_wins_over_app_config() -> None:
    """GateKeeper(config=...) is used instead of app.config['GATEKEEPER']."""
    app = make_app({"project": "from-app-config"})
    gk = GateKeeper(app, {"project": "from-constructor"})
    assert gk.gatekeeper.config.project == "from-constructor"
    assert GateKeeper(make_app()).gatekeeper.config.project == "default"


def test_unknown_backend_fails_at_init_app() -> None:
    """An unknown backend scheme is reported by init_app, not by the first request."""
    with pytest.raises(ConfigError, match="unknown backend 'mongo://x'"):
        GateKeeper(make_app({"backend": "mongo://x"}))


def test_a_backend_that_cannot_be_used_fails_at_init_app(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend URL its own code refuses (a bad shared:// option), or whose module cannot
    be imported (redis-py not installed), is reported by init_app, not by the first
    request (which would be a 500)."""
    with pytest.raises(ConfigError, match="size"):
        GateKeeper(make_app({"backend": f"shared://{tmp_path}/t.shm?size=lots"}))
    monkeypatch.setitem(backends.BACKENDS, "redis", "gatekeeper_wsgi.no_such_module:Missing")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        GateKeeper(make_app({"backend": "redis://127.0.0.1:6379/0"}))


def test_double_init_raises() -> None:
    """Registering a gatekeeper twice on one app is an error, not a double wrap."""
    app = make_app()
    gk = GateKeeper(app)
    with pytest.raises(RuntimeError, match="already initialised"):
        gk.init_app(app)
    with pytest.raises(RuntimeError, match="already initialised"):
        GateKeeper(app)


def test_invalid_settings_fail_at_init_app() -> None:
    """Invalid app.config['GATEKEEPER'] raises ConfigError naming the key at start-up."""
    app = make_app({"limits": {"shop": {"concurrency": "lots"}}})
    with pytest.raises(ConfigError, match=r"limits\.shop\.concurrency"):
        GateKeeper(app)


@pytest.mark.parametrize("setting", [0, False, ""])
def test_a_setting_that_is_no_configuration_fails_at_init_app(setting: object) -> None:
    """Only a missing GATEKEEPER means the defaults: 0, False or "" is a ConfigError, as
    Django's check (gatekeeper.E001) and the engine report it - not an app without limits."""
    app = make_app({})
    app.config["GATEKEEPER"] = setting
    with pytest.raises(ConfigError):
        GateKeeper(app)


def test_a_module_level_extension_does_not_keep_the_apps_of_a_factory() -> None:
    """Flask's application factory with one module-level extension: the views each app
    defines (closures over that app) are marked by @gk.limit / @gk.exempt, and an app
    dropped (one per test, say) is freed with its engine, not kept by the extension."""
    gk = GateKeeper()

    def create_app() -> Flask:
        app = make_app({"project": "site"})
        gk.init_app(app)

        @app.route("/hello")
        @gk.limit(concurrency=5)
        def hello() -> str:
            return app.name

        @app.route("/health")
        @gk.exempt
        def health() -> str:
            return app.name

        return app

    refs = []
    for _ in range(3):
        app = create_app()
        assert app.test_client().get("/hello").status_code == 200
        refs.append((weakref.ref(app), weakref.ref(gk.gatekeeper_for(app))))
    del app
    gc.collect()
    assert [(app_ref(), engine_ref()) for app_ref, engine_ref in refs] == [(None, None)] * 3
    fresh = create_app()
    assert gk.gatekeeper_for(fresh).config.limits["site/hello"].concurrency == 5


def test_file_reload_keeps_decorator_limits(tmp_path: Path) -> None:
    """Reloading the operators' file swaps its limits and keeps the decorator limits."""
    limits_file = tmp_path / "gatekeeper.properties"
    limits_file.write_text("limits.shop/report.concurrency = 4\n")
    app = make_app({"project": "shop", "reload": {"file": str(limits_file)}})
    gk = GateKeeper(app)

    @app.route("/pay")
    @gk.limit(concurrency=0)
    def pay() -> str:
        return "paid"

    @app.route("/report")
    def report() -> str:
        return "report"

    with app.test_client().get("/pay") as response:
        assert response.status_code == 503
    limits_file.write_text("limits.shop/report.concurrency = 0\n")
    assert gk.gatekeeper.reload() is True
    limits = gk.gatekeeper.config.limits
    assert limits["shop/report"].concurrency == 0
    assert limits["shop/pay"].concurrency == 0
    with app.test_client() as client:
        with client.get("/pay") as response:
            assert response.status_code == 503
        with client.get("/report") as response:
            assert response.status_code == 503


def test_import_error_names_the_flask_extra() -> None:
    """Without Flask installed, importing the plugin says which extra to install."""
    script = (
        "import sys; sys.modules['flask'] = None\n"
        "try:\n"
        "    import gatekeeper_wsgi.contrib.flask\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert "gatekeeper-wsgi[flask]" in result.stdout


# --- status blueprint and CLI -------------------------------------------------------------


def status_app(**status_options: Any) -> tuple[Flask, GateKeeper]:
    """An app whose project is closed, with the status blueprint at /gatekeeper."""
    app = make_app(
        {"project": "shop", "limits": {"*": {"concurrency": 0}}, "dashboard": {"token": "s3cret"}}
    )
    gk = GateKeeper(app)
    app.register_blueprint(gk.status_blueprint(**status_options))
    return app, gk


def test_status_json_needs_the_token() -> None:
    """status.json answers with the token (header, or a link exchanged for a cookie), 401
    without; never limited."""
    app, _ = status_app()
    with app.test_client() as client:
        bearer = {"Authorization": "Bearer s3cret"}
        with client.get("/gatekeeper/status.json", headers=bearer) as response:
            assert response.status_code == 200
            assert response.get_json()["config"]["project"] == "shop"
        with client.get("/gatekeeper/?token=s3cret", follow_redirects=True) as response:
            assert response.status_code == 200
            assert b"/gatekeeper/status.json" in response.data
    with app.test_client() as client:
        with client.get("/gatekeeper/status.json") as response:
            assert response.status_code == 401
        with client.get("/gatekeeper/status.json?token=wrong") as response:
            assert response.status_code == 403


def test_status_auth_callable_admits_besides_the_token() -> None:
    """With auth=callable, whom it vouches for sees the dashboard, and the dashboard
    token still works (a scraper), as Django admits staff or the token (SPEC §7); anyone
    else is refused."""
    app, _ = status_app(auth=lambda: request.headers.get("X-Role") == "ops", url_prefix="/ops")
    with app.test_client() as client:
        with client.get("/ops/status.json", headers={"X-Role": "ops"}) as response:
            assert response.status_code == 200
        with client.get("/ops/status.json", headers={"Authorization": "Bearer s3cret"}) as response:
            assert response.status_code == 200
        with client.get("/ops/status.json", headers={"X-Role": "guest"}) as response:
            assert response.status_code == 401
        with client.get("/ops/status.json", headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status_code == 403


def test_status_auth_callable_that_raises_leaves_the_token_to_decide() -> None:
    """An auth hook that raises admits nobody by itself; the token still works."""

    def broken() -> bool:
        raise RuntimeError("session store down")

    app, _ = status_app(auth=broken, url_prefix="/ops")
    with app.test_client() as client:
        with client.get("/ops/status.json") as response:
            assert response.status_code == 401
        with client.get("/ops/status.json", headers={"Authorization": "Bearer s3cret"}) as response:
            assert response.status_code == 200


def test_status_is_denied_without_token_or_auth() -> None:
    """No dashboard.token and no auth: everyone gets 403."""
    app = make_app()
    gk = GateKeeper(app)
    app.register_blueprint(gk.status_blueprint())
    with app.test_client().get("/gatekeeper/status.json?token=") as response:
        assert response.status_code == 403


def test_cli_group_is_registered() -> None:
    """init_app adds 'flask gatekeeper' with check, status and replay."""
    app = make_app()
    GateKeeper(app)
    result = app.test_cli_runner().invoke(args=["gatekeeper", "--help"])
    assert result.exit_code == 0
    for command in ("check", "status", "replay"):
        assert command in result.output


def test_cli_check_prints_settings_and_view_limits() -> None:
    """'flask gatekeeper check' shows the settings' limits and the decorator limits."""
    app = make_app({"project": "shop", "limits": {"shop": {"concurrency": 50}}})
    gk = GateKeeper(app)

    @app.route("/login", methods=["POST"])
    @gk.limit(rate="5/minute", key="ip")
    def login() -> str:
        return "welcome"

    result = app.test_cli_runner().invoke(args=["gatekeeper", "check"])
    assert result.exit_code == 0, result.output
    assert "shop/login/*" in result.output
    assert "5/minute" in result.output


def test_cli_check_file_reports_file_and_line(tmp_path: Path) -> None:
    """'flask gatekeeper check FILE' fails with file:line for an invalid file."""
    bad = tmp_path / "gatekeeper.properties"
    bad.write_text("project = shop\nlimits.shop.concurrency = -1\n")
    app = make_app()
    GateKeeper(app)
    result = app.test_cli_runner().invoke(args=["gatekeeper", "check", str(bad)])
    assert result.exit_code == 1
    assert f"{bad}:2: limits.shop.concurrency" in result.output


def test_cli_check_file_reports_uncompilable_regexes(tmp_path: Path) -> None:
    """'flask gatekeeper check FILE': a regex the engine refuses (a huge repeat count,
    5 000 nested groups) fails with file:line and key, not a traceback."""
    repeat = tmp_path / "gatekeeper.properties"
    repeat.write_text("project = shop\nlimits.shop.timeout_body = x{99999999999}\n")
    nested = tmp_path / "gatekeeper.toml"
    nested.write_text('[limits.shop]\ntimeout_body = "' + "(" * 5000 + ")" * 5000 + '"\n')
    app = make_app()
    GateKeeper(app)
    for bad, line in ((repeat, 2), (nested, 2)):
        result = app.test_cli_runner().invoke(args=["gatekeeper", "check", str(bad)])
        assert result.exit_code == 1
        expected = f"{bad}:{line}: limits.shop.timeout_body: expected a valid regular expression"
        assert expected in result.output
        assert "Traceback" not in result.output


def test_cli_status_reads_the_shared_backend(tmp_path: Path) -> None:
    """'flask gatekeeper status' reads the shared file, sized for views limited after init."""
    app = make_app({"project": "shop", "backend": f"shared://{tmp_path}/gk.shm"})
    gk = GateKeeper(app)

    @app.route("/export")
    @gk.limit(concurrency=2)
    def export() -> Response:
        return held_stream()

    runner = app.test_cli_runner()
    with app.test_client().get("/export"):
        result = runner.invoke(args=["gatekeeper", "status", "--json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        assert document["inflight"]["shop/export"] == 1
        assert document["limits"]["shop/export"]["concurrency"] == 2
    gk.gatekeeper.close()


def test_cli_replay_dry_run_lists_a_rejected_request(tmp_path: Path) -> None:
    """'flask gatekeeper replay LOG --dry-run' reads what the rejected-request log wrote."""
    app = make_app({"project": "shop", "limits": {"shop/pay": {"concurrency": 0}}})
    GateKeeper(app)

    @app.route("/pay", methods=["POST"])
    def pay() -> str:
        return "paid"

    log_file = tmp_path / "rejected.log"
    handler = logging.FileHandler(log_file)
    rejected_logger = logging.getLogger("gatekeeper.rejected")
    rejected_logger.addHandler(handler)
    rejected_logger.setLevel(logging.INFO)
    try:
        with app.test_client().post("/pay?cart=7", data="{}") as response:
            assert response.status_code == 503
        assert rejectlog.flush()
    finally:
        rejected_logger.removeHandler(handler)
        handler.close()
    result = app.test_cli_runner().invoke(
        args=["gatekeeper", "replay", str(log_file), "--to", "http://127.0.0.1:9", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "POST /pay?cart=7 -> dry run" in result.output


def test_a_token_link_under_a_non_ascii_mount_point_lands_there() -> None:
    """The status blueprint mounted at a non-ASCII prefix: a token link is sent on to that
    prefix, percent-encoded as UTF-8 (the path the browser asked for), and the cookie is
    scoped to it."""
    app, _ = status_app(url_prefix="/\u00f6ps")
    with app.test_client() as client, client.get("/%C3%B6ps/?token=s3cret") as response:
        assert response.status_code == 303
        assert response.headers["Location"] == "/%C3%B6ps/"
        assert "Path=/%C3%B6ps;" in response.headers["Set-Cookie"]
