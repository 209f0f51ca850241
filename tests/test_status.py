"""The status endpoint (SPEC §7): access control, the JSON it serves, and a page that never
echoes request data."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi.status import StatusApp, limit_of, public_backend_url
from tests.servers import free_port

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 100, "delay": 2.0},
        "shop/checkout": {"concurrency": 3, "queue": {"size": 5, "wait": 1.0}},
        "shop/login/*": {"rate": "5/minute", "concurrency": 2},
        "*/*/batch": {"concurrency": 1},
    },
}


@pytest.fixture
def keeper() -> Iterator[GateKeeper]:
    """A memory-backed GateKeeper with project, service and wildcard limits."""
    gk = GateKeeper(SETTINGS)
    yield gk
    gk.close()


def get(app: Any, url: str, **headers: str) -> Any:
    # A ?token= link answers with a redirect setting the cookie: follow it, as a browser.
    return Client(app).get(url, headers=headers, follow_redirects=True)


@pytest.mark.parametrize("url", ["/", "/dashboard", "/status.json"])
def test_without_a_token_everyone_is_denied(keeper: GateKeeper, url: str) -> None:
    """With no token and no allow(), every request gets 403, whatever it presents."""
    app = StatusApp(keeper)
    assert get(app, url).status_code == 403
    assert get(app, url, Authorization="Bearer anything").status_code == 403
    assert get(app, url + "?token=anything").status_code == 403


def test_token_in_header_or_query_grants_access(keeper: GateKeeper) -> None:
    """The right bearer token (header, or a ?token= link exchanged for a cookie) opens the
    page and the JSON."""
    app = StatusApp(keeper, token="s3cret")
    assert get(app, "/status.json", Authorization="Bearer s3cret").status_code == 200
    assert get(app, "/status.json?token=s3cret").status_code == 200
    assert get(app, "/?token=s3cret").status_code == 200


def test_missing_token_is_challenged_and_a_wrong_one_forbidden(keeper: GateKeeper) -> None:
    """No credentials: 401 with a Bearer challenge; wrong token: 403; neither echoes it."""
    app = StatusApp(keeper, token="s3cret")
    missing = get(app, "/status.json")
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    wrong = get(app, "/status.json", Authorization="Bearer <b>guess</b>")
    assert wrong.status_code == 403
    assert b"guess" not in wrong.data
    assert wrong.json == {"error": "forbidden: wrong token"}


def test_token_comes_from_the_dashboard_setting(keeper: GateKeeper) -> None:
    """Without a token argument, the `dashboard.token` setting is the token."""
    gk = GateKeeper({**SETTINGS, "dashboard": {"token": "from-settings"}})
    app = StatusApp(gk)
    assert get(app, "/status.json?token=from-settings").status_code == 200
    assert get(app, "/status.json?token=s3cret").status_code == 403
    gk.close()


def test_allow_callable_admits_what_the_framework_authenticated(keeper: GateKeeper) -> None:
    """allow(environ) lets a plugin's own authentication in; a raising allow() denies."""
    app = StatusApp(keeper, allow=lambda environ: environ.get("REMOTE_USER") == "ops")
    assert Client(app).get("/status.json", environ_base={"REMOTE_USER": "ops"}).status_code == 200
    assert Client(app).get("/status.json", environ_base={"REMOTE_USER": "eve"}).status_code == 403

    def broken(environ: Any) -> bool:
        raise RuntimeError("auth backend down")

    assert get(StatusApp(keeper, allow=broken), "/status.json").status_code == 403


def test_json_shows_inflight_per_concrete_path_with_its_limit(keeper: GateKeeper) -> None:
    """status.json lists in-flight per concrete path with the limit (pattern) counting it."""
    held = [
        keeper.admit("shop", "checkout", "crm"),
        keeper.admit("shop", "checkout", "erp"),
        keeper.admit("shop", "login", "alice"),
    ]
    data = get(StatusApp(keeper, token="t"), "/status.json?token=t").json
    inflight = data["inflight"]
    assert inflight["shop/checkout"] == {
        "inflight": 2,
        "limit": "shop/checkout",
        "concurrency": 3,
        "rate": None,
    }
    assert inflight["shop/login/alice"]["limit"] == "shop/login/*"
    assert inflight["shop/login/alice"]["inflight"] == 1
    assert inflight["shop/login/alice"]["rate"] == "5/minute"
    limits = {limit["path"]: limit for limit in data["config"]["limits"]}
    assert limits["shop"]["inflight"] == 3
    assert limits["shop/login/*"]["keys"] == 1
    assert limits["shop/checkout"]["queue"] == {"size": 5, "wait": 1.0}
    assert data["stats"]["counters"]["admitted"] == 3
    assert "decide" in data["stats"]["stages"]
    assert data["config"]["project"] == "shop"
    assert "error" not in data
    for admission in held:
        admission.release(200)
    after = get(StatusApp(keeper, token="t"), "/status.json?token=t").json
    assert after["inflight"]["shop/checkout"]["inflight"] == 0
    assert "shop/login/alice" not in after["inflight"]


def test_backend_failure_is_a_json_error_member_not_a_500() -> None:
    """A backend that cannot be reached gives 200 with an `error` member and the counters."""
    gk = GateKeeper({**SETTINGS, "backend": f"redis://127.0.0.1:{free_port()}/0"})
    try:
        response = get(StatusApp(gk, token="t"), "/status.json?token=t")
        assert response.status_code == 200
        data = response.json
        assert "error" in data
        assert data["stats"]["counters"]["admitted"] == 0
        assert all(entry["inflight"] == 0 for entry in data["inflight"].values())
    finally:
        gk.close()


def test_backend_password_is_not_shown() -> None:
    """The backend URL in the status has its password masked."""
    assert public_backend_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert public_backend_url("redis://:pw@host/0") == "redis://:***@host/0"
    assert public_backend_url("memory") == "memory"


def test_limit_of_picks_the_most_specific_counting_limit(keeper: GateKeeper) -> None:
    """Concrete paths map onto their configured pattern, exact segments first."""
    config = keeper.config
    assert limit_of(config, "shop/login/bob").path == "shop/login/*"  # type: ignore[union-attr]
    assert limit_of(config, "shop/report/batch").path == "*/*/batch"  # type: ignore[union-attr]
    assert limit_of(config, "other/x") is None


def test_page_escapes_the_mount_point_and_sets_a_strict_csp(keeper: GateKeeper) -> None:
    """The page quotes SCRIPT_NAME safely, inlines its assets and pins them by nonce."""
    app = StatusApp(keeper, token="t")
    response = Client(app).get(
        "/",
        headers={"Authorization": "Bearer t"},
        environ_overrides={"SCRIPT_NAME": '/gk"><script>alert(1)</script>'},
    )
    assert response.status_code == 200
    page = response.get_data(as_text=True)
    assert "<script>alert(1)" not in page
    assert 'data-json-url="/gk&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;/status.json"' in page
    csp = response.headers["Content-Security-Policy"]
    nonce = re.search(r"'nonce-([^']+)'", csp)
    assert nonce is not None
    assert f'<script nonce="{nonce.group(1)}">' in page
    assert "default-src 'none'" in csp
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # no CDN
    assert response.headers["Cache-Control"] == "no-store"


def test_a_mount_point_holding_a_placeholder_stays_text(keeper: GateKeeper) -> None:
    """A SCRIPT_NAME holding the page template's placeholders (a proxy header can set it)
    is shown as that text: the template is filled in one pass, not placeholder by
    placeholder, which pasted the page's script into the attribute."""
    app = StatusApp(keeper, token="t")
    response = Client(app).get(
        "/", headers={"Authorization": "Bearer t"}, environ_overrides={"SCRIPT_NAME": "/x{{js}}"}
    )
    page = response.get_data(as_text=True)
    assert 'data-json-url="/x{{js}}/status.json"' in page
    assert page.count('"use strict"') == 1


def test_mounted_under_a_prefix_next_to_the_app(keeper: GateKeeper) -> None:
    """Mounted with DispatcherMiddleware, the page points its fetches at the mount."""
    app = DispatcherMiddleware(
        GateKeeperMiddleware(lambda e, s: [], keeper),
        {"/ops/gatekeeper": StatusApp(keeper, token="t")},
    )
    page = get(app, "/ops/gatekeeper/?token=t").get_data(as_text=True)
    assert 'data-json-url="/ops/gatekeeper/status.json"' in page
    assert get(app, "/ops/gatekeeper/status.json?token=t").status_code == 200


def test_other_paths_and_methods_are_refused(keeper: GateKeeper) -> None:
    """Unknown paths get 404, methods other than GET/HEAD 405; HEAD has no body."""
    app = StatusApp(keeper, token="t")
    assert get(app, "/admin?token=t").status_code == 404
    post = Client(app).post("/status.json?token=t")
    assert post.status_code == 405
    assert post.headers["Allow"] == "GET, HEAD"
    head = Client(app).head("/status.json?token=t", follow_redirects=True)
    assert head.status_code == 200
    assert head.data == b""


def test_json_is_plain_ascii_json(keeper: GateKeeper) -> None:
    """The JSON body parses and is ASCII, whatever the keys in flight."""
    admission = keeper.admit("shop", "login", "a.b@c:d-e")
    body = get(StatusApp(keeper, token="t"), "/status.json?token=t").data
    assert body.isascii()
    assert "shop/login/a.b@c:d-e" in json.loads(body)["inflight"]
    admission.release(200)
