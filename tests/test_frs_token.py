"""The FRS endpoint's token (SPEC §8): with ``token=``, HTTP requests need
``Authorization: Bearer <token>`` (401 with a ``<response>`` otherwise, nothing counted);
without one, a WARNING at start says anyone can use up any key's quota."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from defusedxml.ElementTree import fromstring
from werkzeug.test import Client, EnvironBuilder

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.frs import FrequencyService

TOKEN = "frs-s3cret"
UPDATE = (
    b"<request><cmd_type>update</cmd_type><key>victim@example.com</key>"
    b"<biz_id>login</biz_id></request>"
)


@pytest.fixture
def keeper() -> Iterator[GateKeeper]:
    """A memory-backed GateKeeper with a 3-per-minute FRS limit."""
    gk = GateKeeper({"limits": {"frs/login/*": {"rate": "3/minute"}}})
    yield gk
    gk.close()


def reply(response: Any) -> tuple[int | None, str]:
    root = fromstring(response.data)
    assert root.tag == "response"
    result = root.findtext("result")
    return (None if result is None else int(result)), root.findtext("msg") or ""


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", "Basic " + TOKEN, "Bearer", TOKEN, "Bearer " + "x" * 1_000_000],
)
def test_foreign_updates_without_the_token_count_nothing(
    keeper: GateKeeper, authorization: str | None
) -> None:
    """Updates without the right bearer token get 401 with a <response> and never use up
    the victim's quota: after many of them, the victim is not restricted."""
    client = Client(FrequencyService(keeper, token=TOKEN))
    headers = {} if authorization is None else {"Authorization": authorization}
    for _ in range(10):
        response = client.post("/", data=UPDATE, headers=headers)
        assert response.status_code == 401
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert reply(response) == (None, "unauthorized: send Authorization: Bearer <token>")
    assert keeper.stats()["counters"]["admitted"] == 0
    assert FrequencyService(keeper, token=TOKEN).query("login", "victim@example.com").result == 0


def test_the_right_token_is_served(keeper: GateKeeper) -> None:
    """With the bearer token, updates are recorded and the fourth in a minute restricted."""
    client = Client(FrequencyService(keeper, token=TOKEN))
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    results = [reply(client.post("/", data=UPDATE, headers=bearer))[0] for _ in range(4)]
    assert results == [0, 0, 0, 1]


def test_unauthorized_request_body_is_never_read(keeper: GateKeeper) -> None:
    """A 401 is answered before the body is read: an unauthenticated client costs nothing."""

    class Unreadable:
        def read(self, *args: Any) -> bytes:
            raise AssertionError("the body of an unauthorized request was read")

    environ = EnvironBuilder(method="POST", data=UPDATE).get_environ()
    environ["wsgi.input"] = Unreadable()
    statuses: list[str] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        statuses.append(status)
        return lambda data: None

    body = FrequencyService(keeper, token=TOKEN)(environ, start_response)
    assert statuses == ["401 Unauthorized"]
    assert b"<response>" in b"".join(body)


def test_framework_views_pass_the_authorization_header(keeper: GateKeeper) -> None:
    """respond() checks the Authorization value a framework view passes on."""
    service = FrequencyService(keeper, token=TOKEN)
    refused = service.respond("POST", UPDATE, content_type="application/xml")
    assert refused.status == "401 Unauthorized"
    assert b"<response>" in refused.body
    served = service.respond("POST", UPDATE, authorization=f"Bearer {TOKEN}")
    assert served.status == "200 OK"


def test_json_clients_get_a_json_401(keeper: GateKeeper) -> None:
    """A client preferring JSON gets the 401 as JSON, without a result member."""
    response = Client(FrequencyService(keeper, token=TOKEN)).post(
        "/", data=UPDATE, headers={"Accept": "application/json"}
    )
    assert response.status_code == 401
    assert response.json == {"msg": "unauthorized: send Authorization: Bearer <token>"}


def test_without_a_token_a_warning_is_logged_once(
    keeper: GateKeeper, caplog: pytest.LogCaptureFixture
) -> None:
    """No token: one WARNING per engine that anyone can use up any key's quota (not one
    per FrequencyService built, as a per-request view builds them)."""
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        for _ in range(3):
            FrequencyService(keeper)
    warnings = [r for r in caplog.records if "frequency service has no token" in r.message]
    assert len(warnings) == 1
    assert "use up any key's quota" in warnings[0].getMessage()


def test_with_a_token_nothing_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    """With a token there is no warning; an empty token is refused at construction."""
    gk = GateKeeper({"limits": {"frs/login/*": {"rate": "3/minute"}}})
    try:
        with caplog.at_level(logging.WARNING, logger="gatekeeper"):
            FrequencyService(gk, token=TOKEN)
        assert not [r for r in caplog.records if "no token" in r.message]
        with pytest.raises(ValueError, match="must not be empty"):
            FrequencyService(gk, token=" ")
    finally:
        gk.close()
