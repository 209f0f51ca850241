"""``gk.stats()`` has the shape SPEC §7 fixes, and its TypedDict (``monitor.Stats``) says
exactly that shape: every key, no other, each value of its declared type."""

from __future__ import annotations

import json
import typing
from typing import Any, get_type_hints

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.adaptive import AdaptiveReport
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.monitor import STAGES, Counters, StageSummary, Stats
from tests.conftest import FakeClock

#: SPEC §7's counters and the stages it requires at least.
SPEC_COUNTERS = {
    "admitted",
    "rejected",
    "rejected_by_limit",
    "shadow_rejected",
    "delayed_pending",
    "reloads",
    "reload_failed",
    "backend_errors",
    "capacity_refused",
    "rejected_log_dropped",
}
SPEC_STAGES = {
    "resolve_limits",
    "decide",
    "request",
    "reject",
    "response",
    "service_error",
    "reload",
    "delay_place",
    "delay_process",
}


def _conforms(value: Any, hint: Any, where: str) -> None:
    """Assert ``value`` is of type ``hint`` (TypedDicts key by key, dicts item by item)."""
    if typing.is_typeddict(hint):
        hints = get_type_hints(hint)
        assert isinstance(value, dict), where
        assert set(value) == set(hints), (where, set(value) ^ set(hints))
        for key, item_hint in hints.items():
            _conforms(value[key], item_hint, f"{where}[{key!r}]")
        return
    origin = typing.get_origin(hint)
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        assert isinstance(value, dict), where
        for key, item in value.items():
            _conforms(key, key_hint, f"{where} key")
            _conforms(item, value_hint, f"{where}[{key!r}]")
        return
    # A JSON consumer reads an int where a float is declared as well (0 and 0.0).
    allowed = (int, float) if hint is float else hint
    assert isinstance(value, allowed) and not isinstance(value, bool), (where, value)


@pytest.fixture
def busy_keeper(clock: FakeClock) -> GateKeeper:
    """An engine that admitted, rejected, delayed and adapted, so every part is filled."""
    keeper = GateKeeper(
        {
            "project": "shop",
            "limits": {
                "shop/checkout": {"concurrency": 1, "delay": 5.0},
                "shop/search": {"concurrency": "auto"},
            },
        },
        clock=clock,
    )
    held = keeper.admit("shop", "checkout", "crm")
    with pytest.raises(Rejected):
        keeper.admit("shop", "checkout", "crm")
    held.release(500, faulty=True)
    for _ in range(3):
        keeper.admit("shop", "search", "web").release(200)
        clock.advance(0.01)
    return keeper


def test_stats_match_the_typed_dict_key_by_key(busy_keeper: GateKeeper) -> None:
    """Every key of ``stats()`` is declared by ``Stats`` with its type, and none is missing;
    it is plain JSON."""
    stats = busy_keeper.stats()
    _conforms(stats, Stats, "stats()")
    assert set(stats) == {"counters", "stages", "adaptive"}
    assert json.loads(json.dumps(stats)) == stats


def test_a_fresh_engine_has_the_whole_shape() -> None:
    """Before any request every counter and every stage is there already (zeros)."""
    stats = GateKeeper({"project": "shop", "limits": {"shop": {"concurrency": 1}}}).stats()
    _conforms(stats, Stats, "stats()")
    assert set(stats["counters"]) == SPEC_COUNTERS
    assert set(STAGES) <= set(stats["stages"])
    for summary in stats["stages"].values():
        assert set(summary) == {"count", "mean_us", "p99_us", "max_us"}


def test_the_typed_dict_is_spec_section_7(busy_keeper: GateKeeper) -> None:
    """``Counters`` holds exactly SPEC §7's counters; every SPEC stage is reported."""
    assert set(get_type_hints(Counters)) == SPEC_COUNTERS
    assert set(get_type_hints(StageSummary)) == {"count", "mean_us", "p99_us", "max_us"}
    assert set(get_type_hints(AdaptiveReport)) == {"limit", "latency_ms", "min_latency_ms"}
    stats = busy_keeper.stats()
    assert SPEC_STAGES <= set(stats["stages"]) == set(STAGES)


def test_stats_count_what_happened(busy_keeper: GateKeeper) -> None:
    """The typed counters carry the real counts: admissions, the refusal, the delay."""
    stats = busy_keeper.stats()
    counters = stats["counters"]
    assert counters["admitted"] == 4
    assert counters["rejected"] == {"GK-CONCURRENCY-LIMIT": 1}
    assert counters["rejected_by_limit"] == {"shop/checkout": 1}
    assert counters["delayed_pending"] == 1
    assert stats["stages"]["request"]["count"] == 4
    assert set(stats["adaptive"]) == {"shop/search"}
