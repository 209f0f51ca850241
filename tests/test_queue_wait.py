"""Queue waits are their own stage (``queue_wait``): ``decide`` is the backend's decision
time only, so a dashboard's ``decide`` mean is not inflated by seconds spent queueing."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.errors import Rejected
from tests.conftest import replace_file
from tests.servers import wait_until

SETTINGS: dict[str, Any] = {
    "project": "shop",
    "limits": {"shop/slow": {"concurrency": 1, "queue": {"size": 2, "wait": 30.0}}},
}


def wait_until_queued(gk: GateKeeper, waiters: int) -> None:
    # Watches the engine's waiter count under its condition's lock: the test goes on as
    # soon as the request is queued, whatever the machine's speed (the timeout only
    # bounds each look).
    with gk._cond:
        for _ in range(600):
            if gk._waiting >= waiters:
                return
            gk._cond.wait(0.05)
    pytest.fail("the request never queued")


def test_decide_leaves_the_queue_wait_out() -> None:
    """For a request that waited: request = resolve_limits + decide + queue_wait exactly,
    and queue_wait counts the waits, so decide is the decision alone."""
    gk = GateKeeper(SETTINGS)
    samples: dict[str, list[float]] = {"resolve_limits": [], "decide": [], "request": []}
    samples["queue_wait"] = []
    for name, recorded in samples.items():
        gk.monitor.observe(name, recorded.append)
    holder = gk.admit("shop", "slow", "a")
    for recorded in samples.values():
        recorded.clear()
    admitted = threading.Event()

    def waiter() -> None:
        gk.admit("shop", "slow", "b").release(200)
        admitted.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until_queued(gk, 1)
    holder.release(200)
    thread.join(30)
    assert admitted.is_set()
    assert len(samples["queue_wait"]) == 1
    (resolve,), (decide,), (total,) = (
        samples[name][:1] for name in ("resolve_limits", "decide", "request")
    )
    assert total - resolve - decide == pytest.approx(samples["queue_wait"][0], abs=1e-9)
    assert gk.stats()["stages"]["queue_wait"]["count"] == 1
    gk.close()


def test_a_queue_timeout_is_timed_as_a_wait_too() -> None:
    """A request refused after waiting (GK-QUEUE-TIMEOUT) also records its queue_wait,
    and its refusal's decide leaves it out."""
    settings = {
        "project": "shop",
        "limits": {"shop/slow": {"concurrency": 1, "queue": {"size": 2, "wait": 0.0001}}},
    }
    gk = GateKeeper(settings)
    decide: list[float] = []
    waits: list[float] = []
    gk.monitor.observe("decide", decide.append)
    gk.monitor.observe("queue_wait", waits.append)
    holder = gk.admit("shop", "slow", "a")
    decide.clear()
    with pytest.raises(Rejected) as refused:
        gk.admit("shop", "slow", "b")
    assert refused.value.code == "GK-QUEUE-TIMEOUT"
    assert len(waits) == 1 and len(decide) == 1
    holder.release(200)
    gk.close()


def test_a_reload_that_lowers_the_limit_applies_to_the_waiters(tmp_path: Path) -> None:
    """Two requests wait behind a limit of 2; a reload lowers it to 1. When one holder
    ends, no waiter gets in while the other is still in flight (the limit in force is 1);
    once it ends too, the waiters get in one at a time."""
    path = tmp_path / "gatekeeper.toml"

    def limit(concurrency: int) -> None:
        replace_file(
            path,
            '[gatekeeper]\nproject = "shop"\n[gatekeeper.limits."shop/slow"]\n'
            f"concurrency = {concurrency}\nqueue = {{ size = 5, wait = 30.0 }}\n",
        )

    limit(2)
    gk = GateKeeper(str(path))
    holders = [gk.admit("shop", "slow", "a") for _ in range(2)]
    admitted: list[Any] = []
    go = threading.Event()

    def waiter() -> None:
        admission = gk.admit("shop", "slow", "w")
        with gk._cond:
            admitted.append(admission)
        go.wait(30)
        admission.release(200)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for thread in threads:
        thread.start()
    wait_until_queued(gk, 2)
    limit(1)
    assert gk.reload() is True
    holders[0].release(200)

    def every_waiter_looked() -> bool:
        with gk._cond:
            return all(place.seen == gk._wakes for place in gk._queues.get("shop/slow", ()))

    wait_until(every_waiter_looked, what="the waiters to look after the release")
    assert admitted == [] and gk.inflight() == {"shop/slow": 1}
    holders[1].release(200)
    wait_until(lambda: len(admitted) == 1, what="one waiter admitted")
    assert gk.inflight() == {"shop/slow": 1}
    go.set()
    for thread in threads:
        thread.join(30)
    assert len(admitted) == 2 and not any(gk.inflight().values())


def test_a_reload_that_removes_the_limit_admits_the_waiters(
    backend_url: str, tmp_path: Path
) -> None:
    """A request waits in the queue of a limit a reload removes: no limit applies to it
    any more, so it is admitted holding nothing (on Redis, the backend was asked to
    admit no slots at all and raised out of admit), and everything comes back to zero."""
    path = tmp_path / "gatekeeper.toml"

    def limits(text: str) -> None:
        replace_file(path, f'[gatekeeper]\nproject = "shop"\nbackend = "{backend_url}"\n{text}')

    other = '[gatekeeper.limits."shop/other"]\nconcurrency = 100\n'
    queued = '[gatekeeper.limits."shop/slow"]\nconcurrency = 1\nqueue = { size = 5, wait = 30.0 }\n'
    limits(queued + other)
    gk = GateKeeper(str(path))
    try:
        holder = gk.admit("shop", "slow", "a")
        admitted: list[Any] = []

        def waiter() -> None:
            admitted.append(gk.admit("shop", "slow", "w"))

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_until_queued(gk, 1)
        limits(other)
        assert gk.reload() is True
        holder.release(200)
        # Releases on their way to the backend while the waiter is let in (on Redis,
        # those the next admission carries along).
        while thread.is_alive() and not admitted:
            gk.admit("shop", "other", "b").release(200)
        thread.join(30)
        assert not thread.is_alive()
        (admission,) = admitted  # not an error out of admit (a 500)
        # Holding nothing; or, had its look at the configuration come just before the
        # swap and its try just after the holder's release, the old limit's slot.
        assert [slot.key for slot in admission.slots] in ([], ["shop/slow"])
        admission.release(200)
        assert not any(gk.inflight().values())
        assert gk.stats()["counters"]["backend_errors"] == 0
    finally:
        gk.close()
