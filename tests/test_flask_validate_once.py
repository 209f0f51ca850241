"""The Flask extension validates its configuration once at start (issue 17 point 6): from
``GateKeeper(app)`` through the first requests, the settings (and their file) go through
the configuration model's checks one time, and the engine starts from that result with
the view limits laid under it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flask import Blueprint, Flask, Response
from gatekeeper_wsgi.contrib.flask import GateKeeper

from gatekeeper_wsgi import ConfigError
from gatekeeper_wsgi import config as config_module
from tests.conftest import FakeClock
from tests.test_flask import held_stream


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every whole-configuration validation (``_Checker.check``) from now on, in order.
    The real check runs; this only counts it."""
    seen: list[Any] = []
    real = config_module._Checker.check

    def counted(checker: Any, settings: Any) -> config_module.Config:
        seen.append(settings)
        return real(checker, settings)

    monkeypatch.setattr(config_module._Checker, "check", counted)
    return seen


def limited_app(settings: dict[str, Any]) -> tuple[Flask, GateKeeper]:
    """An app with a view limit, a per-caller view limit and a blueprint limit."""
    app = Flask("once")
    app.config["GATEKEEPER"] = settings
    gk = GateKeeper()
    admin = Blueprint("admin", __name__)
    gk.limit_blueprint(admin, concurrency=5)

    @admin.route("/users")
    def users() -> str:
        return "users"

    app.register_blueprint(admin, url_prefix="/admin")

    @app.route("/export")
    @gk.limit(concurrency=1)
    def export() -> Response:
        return held_stream()

    @app.route("/login", methods=["POST"])
    @gk.limit(rate="3/minute", key="ip")
    def login() -> str:
        return "welcome"

    gk.init_app(app)
    return app, gk


def test_settings_are_validated_once_from_init_app_to_serving(validations: list[Any]) -> None:
    """init_app checks the settings; starting the engine with the view and blueprint
    limits and serving requests checks nothing again - and those limits are enforced."""
    app, gk = limited_app({"project": "shop", "limits": {"shop": {"concurrency": 50}}})
    client = app.test_client()
    with client.get("/export") as first:
        with client.get("/export") as second:
            assert second.status_code == 503
        assert first.status_code == 200
    assert [client.post("/login").status_code for _ in range(4)] == [200, 200, 200, 429]
    assert client.get("/admin/users").status_code == 200
    limits = gk.gatekeeper.config.limits
    assert set(limits) == {"shop", "shop/export", "shop/login/*", "admin"}
    assert len(validations) == 1


def test_a_configuration_file_is_validated_once_too(tmp_path: Path, validations: list[Any]) -> None:
    """With a ``reload.file``, the settings and the file are checked together once at
    start; the file's limit for a path wins over the view's decorator for it."""
    limits_file = tmp_path / "gatekeeper.properties"
    limits_file.write_text("limits.shop/export.concurrency = 2\n")
    app, gk = limited_app({"project": "shop", "reload": {"file": str(limits_file)}})
    client = app.test_client()
    with client.get("/export"), client.get("/export") as second:
        assert second.status_code == 200
        with client.get("/export") as third:
            assert third.status_code == 503
    assert gk.gatekeeper.config.limits["shop/export"].concurrency == 2
    assert len(validations) == 1


def test_invalid_settings_still_fail_at_init_app(validations: list[Any]) -> None:
    """The one validation is the one at init_app: a bad setting fails there, naming it."""
    app = Flask("bad")
    app.config["GATEKEEPER"] = {"limits": {"shop": {"concurrency": -1}}}
    with pytest.raises(ConfigError, match=r"limits\.shop\.concurrency"):
        GateKeeper(app)
    assert len(validations) == 1


def test_a_file_changed_before_the_engine_started_is_read_at_the_first_check(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The engine starts from init_app's result without reading the file again, so a file
    replaced in between is taken at the engine's first reload check."""
    limits_file = tmp_path / "gatekeeper.properties"
    limits_file.write_text("limits.shop/export.concurrency = 2\n")
    app = Flask("changed")
    app.config["GATEKEEPER"] = {"project": "shop", "reload": {"file": str(limits_file)}}
    gk = GateKeeper(app, clock=clock)

    @app.route("/export")
    def export() -> str:
        return "ok"

    replacement = tmp_path / "next.properties"
    replacement.write_text("limits.shop/export.concurrency = 1\n")
    replacement.replace(limits_file)
    client = app.test_client()
    assert client.get("/export").status_code == 200
    assert gk.gatekeeper.config.limits["shop/export"].concurrency == 2
    clock.advance(gk.gatekeeper.config.reload.every_seconds + 1)
    assert client.get("/export").status_code == 200
    assert gk.gatekeeper.config.limits["shop/export"].concurrency == 1
