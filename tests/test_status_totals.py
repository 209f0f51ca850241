"""Per-limit totals (SPEC §7): status JSON and Prometheus read what the backends keep per
limit, so their cost follows the number of limits, not of tracked keys."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.monitor import REFUSED_KEYS
from tests.conftest import FakeClock

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {
        "shop": {"concurrency": 1000},
        "shop/login/*": {"rate": "2/minute"},
        "shop/partner/*": {"concurrency": 1},
    },
}


@pytest.fixture
def keeper(clock: FakeClock) -> Iterator[GateKeeper]:
    """A memory-backed GateKeeper on the fake clock."""
    gk = GateKeeper(SETTINGS, clock=clock)
    yield gk
    gk.close()


def test_refused_keys_are_remembered_per_limit_and_bounded(keeper: GateKeeper) -> None:
    """A spray of refused keys leaves at most REFUSED_KEYS per limit, the latest ones."""
    for index in range(REFUSED_KEYS * 5):
        key = f"sprayer{index}"
        keeper.admit("shop", "login", key).release(200)
        keeper.admit("shop", "login", key).release(200)
        with pytest.raises(Rejected):
            keeper.admit("shop", "login", key)
    refused = keeper.monitor.refused_keys()["shop/login/*"]
    assert len(refused) == REFUSED_KEYS
    assert refused[-1] == f"shop/login/sprayer{REFUSED_KEYS * 5 - 1}"
