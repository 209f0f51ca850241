"""docs/migration.md, Flask-Limiter rows: each translation admits and refuses exactly the
requests Flask-Limiter itself admits and refuses, on the same app and the same clients.

Flask-Limiter runs with its exact ``moving-window`` strategy, and every sequence fits well
inside its window (no sleeps), so both libraries see the same instants.
"""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask, request
from flask_limiter import Limiter
from flask_limiter.util import get_remote_address
from gatekeeper_wsgi.contrib.flask import GateKeeper

CLIENTS = ("10.0.0.1", "10.0.0.2")


def statuses(app: Flask, calls: list[tuple[str, str, dict[str, str] | None]]) -> list[int]:
    """Status of each (client address, path, form) call, responses closed as a server would."""
    client = app.test_client()
    result = []
    for address, path, form in calls:
        method = client.post if form is not None else client.get
        with method(path, data=form, environ_base={"REMOTE_ADDR": address}) as response:
            result.append(response.status_code)
    return result


def interleaved(path: str, times: int) -> list[tuple[str, str, dict[str, str] | None]]:
    """``times`` GETs of ``path`` per client, the clients taking turns."""
    return [(address, path, None) for _ in range(times) for address in CLIENTS]


def per_client(calls: list[tuple[str, str, Any]], codes: list[int]) -> dict[str, list[bool]]:
    """Admitted (True) or refused (False), in order, per client address."""
    admitted: dict[str, list[bool]] = {address: [] for address in CLIENTS}
    for (address, _, _), code in zip(calls, codes, strict=True):
        admitted[address].append(code not in (403, 429, 503))
    return admitted


def limiter_app(default_limits: list[str] | None = None) -> tuple[Flask, Limiter]:
    app = Flask("with_flask_limiter")
    limiter = Limiter(
        get_remote_address,
        app=app,
        default_limits=default_limits or [],
        storage_uri="memory://",
        strategy="moving-window",
    )
    return app, limiter


def test_per_view_limit_needs_key_ip() -> None:
    """`@limiter.limit("5 per minute")` is `@gk.limit(rate="5/minute", key="ip")`: per client."""
    peer, limiter = limiter_app()

    @peer.route("/search")
    @limiter.limit("5 per minute")
    def search() -> str:
        return "found"

    ours = Flask("with_gatekeeper")
    gk = GateKeeper(ours)

    @ours.route("/search")
    @gk.limit(rate="5/minute", key="ip")
    def search_gk() -> str:
        return "found"

    calls = interleaved("/search", 8)
    expected = {address: [True] * 5 + [False] * 3 for address in CLIENTS}
    assert per_client(calls, statuses(peer, calls)) == expected
    assert per_client(calls, statuses(ours, calls)) == expected


def test_per_view_limit_without_key_is_one_counter_for_everyone() -> None:
    """Without `key`, `@gk.limit(rate=…)` counts all clients together, unlike Flask-Limiter."""
    ours = Flask("with_gatekeeper")
    gk = GateKeeper(ours)

    @ours.route("/search")
    @gk.limit(rate="5/minute")
    def search() -> str:
        return "found"

    calls = interleaved("/search", 4)
    assert per_client(calls, statuses(ours, calls)) == {
        CLIENTS[0]: [True, True, True, False],
        CLIENTS[1]: [True, True, False, False],
    }


def test_default_limits_are_per_view_and_client_and_exempt_is_exempt() -> None:
    """`default_limits=["200 per day"]` is `"*/*/*": {"rate": "200/day", "key": "ip"}`:
    one counter per view and client; `@limiter.exempt` is `@gk.exempt`."""
    peer, limiter = limiter_app(["200 per day"])
    ours = Flask("with_gatekeeper")
    ours.config["GATEKEEPER"] = {"limits": {"*/*/*": {"rate": "200/day", "key": "ip"}}}
    gk = GateKeeper(ours)
    for app, exempt in ((peer, limiter.exempt), (ours, gk.exempt)):

        def a() -> str:
            return "a"

        def b() -> str:
            return "b"

        def health() -> str:
            return "ok"

        app.add_url_rule("/a", "a", a)
        app.add_url_rule("/b", "b", b)
        app.add_url_rule("/health", "health", exempt(health))

    calls = interleaved("/a", 201) + interleaved("/b", 201) + interleaved("/health", 250)
    expected_codes = statuses(peer, calls)
    assert statuses(ours, calls) == expected_codes
    admitted = per_client(calls, expected_codes)
    assert admitted[CLIENTS[0]] == [True] * 200 + [False] + [True] * 200 + [False] + [True] * 250


def test_deduct_when_401_is_count_401() -> None:
    """`deduct_when=lambda r: r.status_code == 401` is `count=[401]`: only failures count."""
    peer, limiter = limiter_app()

    def login() -> tuple[str, int]:
        right = request.form.get("password") == "right"
        return ("welcome", 200) if right else ("no", 401)

    peer.add_url_rule(
        "/login",
        "login",
        limiter.limit("5 per minute", deduct_when=lambda response: response.status_code == 401)(
            login
        ),
        methods=["POST"],
    )
    ours = Flask("with_gatekeeper")
    gk = GateKeeper(ours)
    ours.add_url_rule(
        "/login",
        "login",
        gk.limit(rate="5/minute", key="ip", count=[401])(login),
        methods=["POST"],
    )

    passwords = ["guess", "right", "guess", "right", "guess", "guess", "right", "guess", "x"]
    calls = [
        (address, "/login", {"password": password}) for password in passwords for address in CLIENTS
    ]
    expected_codes = statuses(peer, calls)
    assert statuses(ours, calls) == expected_codes
    # Five failures pass (successes in between are free), then the client is refused.
    assert [code for (address, _, _), code in zip(calls, expected_codes, strict=True)][::2] == [
        401,
        200,
        401,
        200,
        401,
        401,
        200,
        401,
        429,
    ]


@pytest.mark.parametrize(
    ("theirs", "ours_rate"), [("5 per minute", "5/minute"), ("3 per 10 seconds", "3/10s")]
)
def test_rate_strings_translate(theirs: str, ours_rate: str) -> None:
    """Flask-Limiter's "N per <unit>" strings and ours ("N/<unit>", "N/<k>s") count alike."""
    peer, limiter = limiter_app()

    @peer.route("/x")
    @limiter.limit(theirs)
    def x() -> str:
        return "x"

    ours = Flask("with_gatekeeper")
    gk = GateKeeper(ours)

    @ours.route("/x")
    @gk.limit(rate=ours_rate, key="ip")
    def x_gk() -> str:
        return "x"

    calls = interleaved("/x", 7)
    expected = per_client(calls, statuses(peer, calls))
    assert per_client(calls, statuses(ours, calls)) == expected
    assert expected[CLIENTS[1]].count(True) == int(theirs.split()[0])


def test_a_views_own_limit_replaces_the_default_limit() -> None:
    """A view's own limit replaces the default one in both: `*/*/*` yields to `<p>/<view>/*`."""
    peer, limiter = limiter_app(["200 per day"])
    ours = Flask("with_gatekeeper")
    ours.config["GATEKEEPER"] = {"limits": {"*/*/*": {"rate": "200/day", "key": "ip"}}}
    gk = GateKeeper(ours)
    for app, limit in (
        (peer, limiter.limit("2 per minute")),
        (ours, gk.limit(rate="2/minute", key="ip")),
    ):

        def export() -> str:
            return "csv"

        app.add_url_rule("/export", "export", limit(export))

    calls = interleaved("/export", 4)
    expected = per_client(calls, statuses(peer, calls))
    assert per_client(calls, statuses(ours, calls)) == expected
    assert expected[CLIENTS[0]] == [True, True, False, False]
