"""Dashboard access by token (SPEC §7): a bearer header for scrapers, a ``?token=`` link
exchanged by a redirect for an HttpOnly, SameSite=Strict cookie, so the token never stays
in a URL; one check shared by the core app, Flask's blueprint and Django's views."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.access import COOKIE_NAME
from gatekeeper_wsgi.status import StatusApp
from tests.conftest import replace_file

TOKEN = "s3cret-token"
SETTINGS: dict[str, Any] = {"project": "shop", "limits": {"shop": {"concurrency": 5}}}


@pytest.fixture
def gatekeeper() -> Iterator[GateKeeper]:
    """A memory-backed GateKeeper."""
    gk = GateKeeper(SETTINGS)
    yield gk
    gk.close()


@pytest.fixture
def app(gatekeeper: GateKeeper) -> StatusApp:
    """A StatusApp with a token over a memory-backed GateKeeper."""
    return StatusApp(gatekeeper, token=TOKEN)


def cookie_attributes(set_cookie: str) -> dict[str, str]:
    parts = [part.strip() for part in set_cookie.split(";")]
    attributes = {}
    for part in parts[1:]:
        name, _, value = part.partition("=")
        attributes[name.lower()] = value
    return attributes


@pytest.mark.parametrize(
    ("token", "linked"),
    [
        ("q3+Zk/8vUa1m+Xw2PfR9sT0bYcLd", "q3+Zk/8vUa1m+Xw2PfR9sT0bYcLd"),
        ("q3+Zk/8vUa1m+Xw2PfR9sT0bYcLd", "q3%2BZk%2F8vUa1m%2BXw2PfR9sT0bYcLd"),
        ("two words", "two+words"),
        ("two words", "two%20words"),
    ],
    ids=["base64 pasted", "base64 encoded", "space as +", "space as %20"],
)
def test_a_token_link_is_read_as_pasted_and_as_encoded(
    gatekeeper: GateKeeper, token: str, linked: str
) -> None:
    """A base64 token (``openssl rand -base64``) pasted into a link keeps its ``+``, which
    a browser sends as it is; the link is exchanged whether ``+`` is read as itself or, as
    forms write a space, as a space."""
    app = StatusApp(gatekeeper, token=token)
    response = Client(app).get("/dashboard?token=" + linked)
    assert response.status_code == 303
    assert response.headers["Location"] == "/dashboard"
    assert "Set-Cookie" in response.headers
    wrong = Client(app).get("/dashboard?token=" + linked.replace("q3", "q4").replace("two", "to"))
    assert wrong.status_code == 403


def test_token_link_is_exchanged_for_a_strict_httponly_cookie(app: StatusApp) -> None:
    """A right ?token= gets a 303 to the same URL without it and a cookie that is HttpOnly,
    SameSite=Strict, scoped to the mount point and not the token itself."""
    client = Client(app)
    response = client.get(
        "/dashboard?token=" + TOKEN + "&theme=dark",
        environ_overrides={"SCRIPT_NAME": "/ops/gk"},
    )
    assert response.status_code == 303
    assert response.headers["Location"] == "/ops/gk/dashboard?theme=dark"
    set_cookie = response.headers["Set-Cookie"]
    assert set_cookie.startswith(COOKIE_NAME + "=")
    assert TOKEN not in set_cookie and TOKEN not in response.get_data(as_text=True)
    attributes = cookie_attributes(set_cookie)
    assert attributes["path"] == "/ops/gk"
    assert "httponly" in attributes
    assert attributes["samesite"] == "Strict"
    assert "secure" not in attributes
    cookie = set_cookie.split(";")[0]
    browser = Client(app, use_cookies=False)
    page = browser.get("/dashboard", headers={"Cookie": cookie})
    assert page.status_code == 200
    data = browser.get("/status.json", headers={"Cookie": "other=1; " + cookie})
    assert data.status_code == 200 and data.json["config"]["project"] == "shop"


def test_cookie_is_secure_over_https(app: StatusApp) -> None:
    """Over HTTPS the exchanged cookie carries Secure."""
    response = Client(app).get("/?token=" + TOKEN, base_url="https://ops.example/")
    assert response.status_code == 303
    assert "secure" in cookie_attributes(response.headers["Set-Cookie"])


def test_a_browser_ends_on_a_url_without_the_token(app: StatusApp) -> None:
    """Following the redirect, a browser lands on the page with no token in its URL and
    stays signed in for the JSON it polls."""
    client = Client(app)
    response = client.get("/?token=" + TOKEN, follow_redirects=True)
    assert response.status_code == 200
    assert [r.headers["Location"] for r in response.history] == ["/"]
    assert TOKEN not in response.request.url
    assert client.get("/status.json").status_code == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Cookie": f"{COOKIE_NAME}=forged"}, 401),
        ({"Cookie": f"{COOKIE_NAME}={TOKEN}"}, 401),  # the token is not the cookie value
        ({"Authorization": "Bearer wrong"}, 403),
        ({"Cookie": "x=" + "a" * 1_000_000}, 401),
        ({"Authorization": "Bearer " + "t" * 1_000_000}, 401),
    ],
)
def test_requests_without_the_token_are_refused(
    app: StatusApp, headers: dict[str, str], status: int
) -> None:
    """No credential, a forged cookie, the raw token as cookie, a 1 MB cookie or header:
    refused, never a 500, and no cookie is handed out."""
    response = Client(app).get("/status.json", headers=headers)
    assert response.status_code == status
    assert "Set-Cookie" not in response.headers
    if status == 401:
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("token", ["", "  "])
def test_an_empty_token_is_refused_at_construction(gatekeeper: GateKeeper, token: str) -> None:
    """StatusApp(token="") (an unset environment variable's default) would let a
    `?token=` link in: it is an error, not an open dashboard."""
    with pytest.raises(ValueError, match="must not be empty"):
        StatusApp(gatekeeper, token=token)


def test_a_wrong_token_link_is_forbidden_without_a_cookie(app: StatusApp) -> None:
    """A wrong ?token= gets 403: no redirect, no cookie."""
    response = Client(app).get("/?token=guess")
    assert response.status_code == 403
    assert "Set-Cookie" not in response.headers and "Location" not in response.headers


def vouch_for_ops(environ: dict[str, Any]) -> bool:
    """An allow() as a plugin passes it: the framework authenticated the user 'ops'."""
    return environ.get("REMOTE_USER") == "ops"


# Requests the status app lets in without a ?token=: a bearer header, the exchanged
# cookie, the hosting framework's own authentication.
LET_IN_BY = [
    pytest.param({"headers": {"Authorization": f"Bearer {TOKEN}"}}, id="bearer"),
    pytest.param({"environ_base": {"REMOTE_USER": "ops"}}, id="allow"),
    pytest.param({"cookie": True}, id="cookie"),
]


def let_in_client(app: StatusApp, how: dict[str, Any]) -> tuple[Client, dict[str, Any]]:
    """A client and request options that are let in by ``how``, without a token link."""
    client = Client(app, use_cookies=False)
    if how.get("cookie"):
        cookie = Client(app).get("/?token=" + TOKEN).headers["Set-Cookie"].split(";")[0]
        return client, {"headers": {"Cookie": cookie}}
    return client, how


@pytest.mark.parametrize("how", LET_IN_BY)
def test_a_right_token_link_is_exchanged_even_when_let_in_otherwise(
    gatekeeper: GateKeeper, how: dict[str, Any]
) -> None:
    """A request let in by a bearer header, the cookie or allow() that also carries the
    right ?token= is redirected to the URL without it, with the cookie: the token never
    stays in the address bar."""
    app = StatusApp(gatekeeper, token=TOKEN, allow=vouch_for_ops)
    client, options = let_in_client(app, how)
    assert client.get("/status.json", **options).status_code == 200
    response = client.get("/dashboard?token=" + TOKEN + "&theme=dark", **options)
    assert response.status_code == 303
    assert response.headers["Location"] == "/dashboard?theme=dark"
    assert response.headers["Set-Cookie"].startswith(COOKIE_NAME + "=")
    assert TOKEN not in response.get_data(as_text=True)


@pytest.mark.parametrize("how", LET_IN_BY)
def test_a_wrong_token_link_leaves_the_url_of_a_request_let_in_otherwise(
    gatekeeper: GateKeeper, how: dict[str, Any]
) -> None:
    """A request let in by other means with a wrong (say, an old) ?token= is redirected
    to the URL without it, and gets no cookie for it."""
    app = StatusApp(gatekeeper, token=TOKEN, allow=vouch_for_ops)
    client, options = let_in_client(app, how)
    response = client.get("/status.json?token=old-token&x=1", **options)
    assert response.status_code == 303
    assert response.headers["Location"] == "/status.json?x=1"
    assert "Set-Cookie" not in response.headers
    assert client.get("/status.json?x=1", **options).status_code == 200


def test_a_token_link_to_an_app_without_a_token_is_removed_for_allowed_requests(
    gatekeeper: GateKeeper,
) -> None:
    """No token configured: allow() still lets its users in, a ?token= is taken out of
    their URL (no cookie), and everyone else is refused as before."""
    app = StatusApp(gatekeeper, allow=vouch_for_ops)
    allowed = Client(app).get("/?token=anything", environ_base={"REMOTE_USER": "ops"})
    assert allowed.status_code == 303
    assert allowed.headers["Location"] == "/"
    assert "Set-Cookie" not in allowed.headers
    assert Client(app).get("/?token=anything").status_code == 403


@pytest.mark.parametrize(
    ("query", "rest"),
    [
        ("x=%FF&token=" + TOKEN, "x=%FF"),
        ("token=" + TOKEN + "&x=%FF&y=%zz&z=a+b%20c", "x=%FF&y=%zz&z=a+b%20c"),
        ("a=%E2%82%AC;token=" + TOKEN + ";b", "a=%E2%82%AC;b"),
        ("tok%65n=" + TOKEN + "&q=1", "q=1"),
        ("token=old&mytoken=x&access_token=y&token=" + TOKEN, "mytoken=x&access_token=y"),
        ("next=/x?token=1&flag&c==d&token=" + TOKEN, "next=/x?token=1&flag&c==d"),
        ("token=" + TOKEN, ""),
    ],
    ids=[
        "invalid-utf8",
        "odd-escapes",
        "semicolons",
        "encoded-name",
        "similar-names",
        "odd",
        "only",
    ],
)
def test_the_redirect_keeps_every_other_byte_of_the_query(
    app: StatusApp, query: str, rest: str
) -> None:
    """Only the parameters named token (however their name is encoded) are removed; the
    rest of the query string is passed on byte for byte, not decoded and re-encoded."""
    response = Client(app).get("/dashboard", query_string=query)
    assert response.status_code == 303
    assert response.headers["Location"] == "/dashboard" + ("?" + rest if rest else "")
    assert "Set-Cookie" in response.headers


def test_the_redirect_never_carries_raw_control_characters(app: StatusApp) -> None:
    """Bytes no URL may hold raw (CR, LF, space, '#', non-ASCII), passed on by a lax
    server, are percent-encoded in the Location: a header line is never broken."""
    response = Client(app).get(
        "/", environ_overrides={"QUERY_STRING": "a=\r\nX-Injected: 1 #\xff&token=" + TOKEN}
    )
    assert response.status_code == 303
    assert response.headers["Location"] == "/?a=%0D%0AX-Injected:%201%20%23%FF"


def test_the_cookie_of_a_replaced_token_no_longer_opens(app: StatusApp) -> None:
    """After the token changes, a cookie obtained with the old one is refused."""
    client = Client(app)
    cookie = client.get("/?token=" + TOKEN).headers["Set-Cookie"].split(";")[0]
    rotated = StatusApp(app.gatekeeper, token="new-token")
    response = Client(rotated, use_cookies=False).get("/status.json", headers={"Cookie": cookie})
    assert response.status_code == 401


def test_the_redirect_never_points_at_another_host(app: StatusApp) -> None:
    """A mount point of '//evil.example' cannot turn the exchange into an open redirect."""
    response = Client(app).get(
        "/?token=" + TOKEN, environ_overrides={"SCRIPT_NAME": "//evil.example"}
    )
    assert response.status_code == 303
    location = response.headers["Location"]
    assert location.startswith("/") and not location.startswith("//")


def test_malformed_cookies_of_other_apps_do_not_hide_ours(app: StatusApp) -> None:
    """Other cookies of the site, however malformed, do not hide the dashboard cookie."""
    client = Client(app)
    cookie = client.get("/?token=" + TOKEN).headers["Set-Cookie"].split(";")[0]
    messy = 'prefs="{\\"a\\": 1; broken; ' + cookie + "; tail=1"
    response = Client(app, use_cookies=False).get("/status.json", headers={"Cookie": messy})
    assert response.status_code == 200


def test_flask_blueprint_uses_the_same_exchange() -> None:
    """Flask's status blueprint exchanges a token link for the cookie, then serves."""
    from flask import Flask
    from gatekeeper_wsgi.contrib.flask import GateKeeper as FlaskGateKeeper

    flask_app = Flask(__name__)
    flask_app.config["GATEKEEPER"] = {**SETTINGS, "dashboard": {"token": TOKEN}}
    extension = FlaskGateKeeper(flask_app)
    flask_app.register_blueprint(extension.status_blueprint())
    with flask_app.test_client() as client:
        with client.get("/gatekeeper/?token=" + TOKEN) as response:
            assert response.status_code == 303
            assert response.headers["Location"] == "/gatekeeper/"
            assert cookie_attributes(response.headers["Set-Cookie"])["samesite"] == "Strict"
        with client.get("/gatekeeper/status.json") as response:
            assert response.status_code == 200
    with flask_app.test_client() as stranger, stranger.get("/gatekeeper/status.json") as response:
        assert response.status_code == 401


def test_flask_mount_without_its_slash_is_never_limited() -> None:
    """`/gatekeeper` (no slash) gets Flask's redirect to the dashboard even while the
    project's limit is full: the redirect to an exempt view is exempt too."""
    from flask import Flask
    from gatekeeper_wsgi.contrib.flask import GateKeeper as FlaskGateKeeper

    flask_app = Flask(__name__)
    flask_app.config["GATEKEEPER"] = {
        "project": "shop",
        "dashboard": {"token": TOKEN},
        "limits": {"shop": {"concurrency": 0}},
    }
    extension = FlaskGateKeeper(flask_app)
    flask_app.register_blueprint(extension.status_blueprint())

    @flask_app.route("/orders/")
    def orders() -> str:
        return "ok"

    client = flask_app.test_client()
    response = client.get("/gatekeeper?token=" + TOKEN)
    assert response.status_code == 308
    assert response.headers["Location"].endswith("/gatekeeper/?token=" + TOKEN)
    bearer = client.get("/gatekeeper", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bearer.status_code == 308
    assert client.get("/orders").status_code == 503  # other redirects stay limited


def test_a_query_too_long_to_look_for_a_token_in_is_refused(app: StatusApp) -> None:
    """A query string too long to be parsed for a token is never served (it may carry
    one, which would stay in the URL), whatever lets the request in."""
    client = Client(app)
    query = "x=" + "a" * 9_000 + "&token=" + TOKEN
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    response = client.get("/?" + query, headers=bearer)
    assert response.status_code == 414
    assert TOKEN.encode() not in response.data
    assert client.get("/?x=" + "a" * 100, headers=bearer).status_code == 200


def test_a_token_rotated_in_the_file_holds_without_other_traffic(tmp_path: Any) -> None:
    """A status read checks the configuration file when a check is due, as a request
    does: the replaced token stops opening the page though no other request came."""
    path = tmp_path / "gatekeeper.toml"

    def token(value: str) -> None:
        replace_file(
            path,
            '[gatekeeper]\nproject = "shop"\n[gatekeeper.reload]\nevery_seconds = 1\n'
            f'[gatekeeper.dashboard]\ntoken = "{value}"\n',
        )

    token("old-token")
    now = [1000.0]
    gk = GateKeeper(str(path), clock=lambda: now[0])
    try:
        client = Client(StatusApp(gk))
        assert (
            client.get("/status.json", headers={"Authorization": "Bearer old-token"}).status_code
            == 200
        )
        token("new-token")
        now[0] += 2  # reload.every_seconds passed
        assert (
            client.get("/status.json", headers={"Authorization": "Bearer old-token"}).status_code
            == 403
        )
        assert (
            client.get("/status.json", headers={"Authorization": "Bearer new-token"}).status_code
            == 200
        )
    finally:
        gk.close()


def test_flask_auth_hook_with_a_token_link_still_exchanges_it() -> None:
    """A request Flask's auth hook vouches for that carries ?token= is redirected without
    it: with the cookie for the right token, without for a wrong one."""
    from flask import Flask, request
    from gatekeeper_wsgi.contrib.flask import GateKeeper as FlaskGateKeeper

    flask_app = Flask(__name__)
    flask_app.config["GATEKEEPER"] = {**SETTINGS, "dashboard": {"token": TOKEN}}
    extension = FlaskGateKeeper(flask_app)
    hook = extension.status_blueprint(auth=lambda: request.headers.get("X-Ops") == "yes")
    flask_app.register_blueprint(hook)
    ops = {"X-Ops": "yes"}
    client = flask_app.test_client()
    with client.get("/gatekeeper/?token=" + TOKEN + "&x=%FF", headers=ops) as response:
        assert response.status_code == 303
        assert response.headers["Location"] == "/gatekeeper/?x=%FF"
        assert response.headers["Set-Cookie"].startswith(COOKIE_NAME + "=")
    with client.get("/gatekeeper/status.json?token=wrong", headers=ops) as response:
        assert response.status_code == 303
        assert response.headers["Location"] == "/gatekeeper/status.json"
        assert "Set-Cookie" not in response.headers
    with client.get("/gatekeeper/status.json", headers=ops) as response:
        assert response.status_code == 200
