"""``gatekeeper_adaptive_limit`` (SPEC §4.9): a plain adaptive limit as ``{limit}``, the keys
of a wildcard one as ``{limit, key}`` for its busiest keys only, so a spray of callers can
grow neither a scrape nor, in multiprocess mode, the workers' files."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.prometheus import ADAPTIVE_KEYS, register
from tests.conftest import FakeClock
from tests.test_adaptive_engine import simulate
from tests.test_prometheus import scrape, start_worker

AUTO: dict[str, Any] = {"concurrency": "auto", "adaptive": {"max": 50}}


def adaptive_series(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """``{(limit, key or ""): value}`` of every ``gatekeeper_adaptive_limit`` sample."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {
        (sample.labels["limit"], sample.labels.get("key", "")): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "gatekeeper_adaptive_limit"
        for sample in family.samples
    }


def test_a_wildcards_busiest_keys_are_exported_with_their_own_limit(clock: FakeClock) -> None:
    """Under a spray of 1000 callers, a scrape shows the adaptive limit of exactly the
    ADAPTIVE_KEYS busiest keys of `shop/a/*` (the one that learned a limit among them, at
    the value stats report), and the plain limit `shop/b` as `{limit="shop/b"}`."""
    limits = {"shop/b": {"concurrency": "auto", "adaptive": {"initial": 7}}, "shop/a/*": AUTO}
    gk = GateKeeper({"project": "shop", "limits": limits}, clock=clock)
    registry = CollectorRegistry()
    register(gk, registry, multiprocess=False)
    simulate(gk, clock, capacity=20, seconds=5.0)  # caller "c" learns a limit of its own
    learned = gk.stats()["adaptive"]["shop/a/c"]["limit"]
    assert learned != 10  # moved away from `initial`: the value below is really its own
    held = [gk.admit("shop", "a", "c") for _ in range(3)]
    held += [gk.admit("shop", "a", f"busy{n}") for n in range(ADAPTIVE_KEYS - 1) for _ in (1, 2)]
    held += [gk.admit("shop", "a", f"sprayed{n}") for n in range(1000)]

    series = adaptive_series(registry)
    keyed = {key: value for (limit, key), value in series.items() if key}
    assert {limit for limit, key in series if key} == {"shop/a/*"}
    assert set(keyed) == {"shop/a/c", *(f"shop/a/busy{n}" for n in range(ADAPTIVE_KEYS - 1))}
    assert keyed["shop/a/c"] == learned
    assert series["shop/b", ""] == 7
    assert ("shop/a/*", "") not in series  # a wildcard has no value of its own

    for admission in held:
        admission.release(200)
    assert len([key for _, key in adaptive_series(registry) if key]) <= ADAPTIVE_KEYS
    gk.close()


def test_a_plain_adaptive_limit_is_exported_before_its_first_request() -> None:
    """An adaptive limit nobody has called yet reads its `initial` value, the value its
    faults would carry, instead of being absent."""
    gk = GateKeeper(
        {"project": "shop", "limits": {"shop": {"concurrency": "auto", "adaptive": {"initial": 7}}}}
    )
    registry = CollectorRegistry()
    register(gk, registry, multiprocess=False)
    assert adaptive_series(registry) == {("shop", ""): 7.0}
    gk.close()


SPRAYING_WORKER = textwrap.dedent(
    """
    import sys
    from gatekeeper_wsgi import GateKeeper
    from gatekeeper_wsgi.prometheus import register

    keeper = GateKeeper({"project": "shop", "limits": {
        "shop/b": {"concurrency": "auto", "adaptive": {"initial": 7}},
        "shop/a/*": {"concurrency": "auto"},
    }})
    exporter = register(keeper, interval=None)
    # Three steady callers, two requests each, all along.
    steady = [keeper.admit("shop", "a", f"steady{n}") for n in range(3) for _ in (1, 2)]
    # 100 rounds of 20 new callers each: a spray far past what any scrape shows.
    for round in range(100):
        held = [keeper.admit("shop", "a", f"r{round}-{n}") for n in range(20)]
        exporter.sync()
        for admission in held:
            admission.release(200)
    exporter.sync()
    print("ready", flush=True)
    sys.stdin.readline()
    exporter.close()
    """
)


def test_multiprocess_mode_labels_a_bounded_number_of_keys(tmp_path: Path) -> None:
    """A worker sprayed with 2000 callers in turn writes at most 4 x ADAPTIVE_KEYS key
    series (prometheus_client cannot remove one in multiprocess mode): its steady busy
    callers keep their value, the sprayed keys it labelled read NaN once gone, and the
    plain limit keeps its value."""
    with start_worker(SPRAYING_WORKER, tmp_path) as worker:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().strip() == "ready"
        series = adaptive_series(scrape(tmp_path))
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.wait(30) == 0
    keyed = {key: value for (_, key), value in series.items() if key}
    assert len(keyed) <= 4 * ADAPTIVE_KEYS
    live = {key: value for key, value in keyed.items() if not math.isnan(value)}
    assert live == {f"shop/a/steady{n}": 10.0 for n in range(3)}
    assert len(keyed) > len(live)  # sprayed keys were shown while they were busy
    assert series["shop/b", ""] == 7
