"""The backend contract lives in the ABC (``backends/base.py``): every registered backend is
built through ``Backend.from_url``, answers the optional extras the base declares, and a
refusal carries only what a backend can tell (no ``remaining`` that is always 0), and
whatever goes wrong inside a backend leaves it as a ``BackendError`` (wrapped once, by the
base), never as a 500."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest
from werkzeug.test import Client

from gatekeeper_wsgi import fault
from gatekeeper_wsgi.backends import BACKENDS, backend_from_url
from gatekeeper_wsgi.backends.base import GUARDED, Backend, Denial
from gatekeeper_wsgi.backends.memory import MemoryBackend
from gatekeeper_wsgi.engine import GateKeeper
from gatekeeper_wsgi.errors import BackendError, Rejected
from gatekeeper_wsgi.frs import FrequencyService
from gatekeeper_wsgi.middleware import GateKeeperMiddleware
from gatekeeper_wsgi.values import Limit, Rate, Slot
from tests.conftest import FakeClock


def _registered() -> list[type[Backend]]:
    classes = []
    for target in sorted(set(BACKENDS.values())):
        module_name, class_name = target.split(":")
        try:
            module = import_module(module_name)
        except ImportError:  # an optional extra not installed: nothing to check
            continue
        classes.append(getattr(module, class_name))
    return classes


@pytest.mark.parametrize("cls", _registered(), ids=lambda cls: cls.__name__)
def test_every_registered_backend_is_built_through_the_abc(cls: type[Backend]) -> None:
    """Each registered class is a Backend whose ``from_url(url, config)`` is the ABC's
    signature (a backend may add keyword-only options), so the registry needs no cast."""
    assert issubclass(cls, Backend)
    parameters = list(inspect.signature(cls.from_url).parameters.values())
    assert [p.name for p in parameters[:2]] == ["url", "config"]
    assert parameters[1].default is None
    assert all(p.kind is p.KEYWORD_ONLY for p in parameters[2:])


def test_memory_is_built_by_the_default_from_url() -> None:
    """``memory`` goes through ``Backend.from_url`` like every backend: a fresh, empty one."""
    first, second = backend_from_url("memory"), backend_from_url("memory://")
    assert isinstance(first, MemoryBackend) and isinstance(second, MemoryBackend)
    assert first is not second
    assert first.inflight(0.0) == {} and first.usage() is None


def test_shared_usage_reports_its_capacities(tmp_path: Path) -> None:
    """``usage()``, declared on the base, reports the shared table's keys and leases
    against their capacities."""
    backend = backend_from_url(f"shared://{tmp_path / 'gk.shm'}")
    try:
        usage = backend.usage()
        assert usage is not None
        assert usage["keys"] <= usage["key_capacity"]
        assert usage["leases"] == 0 < usage["lease_capacity"]
    finally:
        backend.close()


def test_a_denial_says_where_what_and_when_only() -> None:
    """A Denial names the refusing slot, the count that refused and when to retry; the
    remaining admissions of a refused rate are 0 by definition, which the fault says."""
    assert Denial._fields == ("at", "kind", "retry_after")
    gk = GateKeeper(
        {"project": "shop", "limits": {"shop": {"rate": "2/minute"}}}, clock=FakeClock()
    )
    try:
        for _ in range(2):
            gk.admit("shop", "api", "crm").release(200)
        with pytest.raises(Rejected) as refused:
            gk.admit("shop", "api", "crm")
        rate = refused.value.rate
        assert rate is not None and (rate.quota, rate.remaining) == (2, 0)
    finally:
        gk.close()


def test_frs_parses_at_most_accept_cap_characters_of_accept() -> None:
    """The frequency service reads Accept through the fault module's one parser, which
    parses at most ACCEPT_CAP characters: 50 distinct 100 KiB headers that differ only
    past the cap are answered alike and cached as one, never as 5 MB of keys."""
    gk = GateKeeper({"limits": {"frs/login/*": {"rate": "5/minute"}}}, clock=FakeClock())
    try:
        client = Client(FrequencyService(gk))
        body = b"<request><cmd_type>query</cmd_type><key>k</key><biz_id>login</biz_id></request>"
        fault._parsed_preference.cache_clear()
        for n in range(50):
            accept = "application/json, " + "x-a/b;q=0.1, " * 8_000 + f"x-{n}/y"
            response = client.post("/", data=body, headers={"Accept": accept})
            assert response.status_code == 200
            assert response.get_json() == {"result": 0, "msg": "not restricted"}
        assert fault._parsed_preference.cache_info().currsize == 1
    finally:
        gk.close()


@pytest.mark.parametrize("cls", _registered(), ids=lambda cls: cls.__name__)
def test_every_contract_method_a_backend_defines_is_guarded(cls: type[Backend]) -> None:
    """The base wraps every contract method a registered backend defines, so no method can
    let a raw library exception out, however the backend is written."""
    defined = [name for name in GUARDED if name in cls.__dict__]
    assert "acquire" in defined and "release" in defined
    for name in defined:
        assert getattr(cls.__dict__[name], "__gatekeeper_guarded__", False), name


def _hostile_slots() -> list[Slot]:
    """A sound slot, then one whose rate was built with strings where numbers belong: the
    backend's own arithmetic fails on it (a TypeError no backend anticipates)."""
    limit: Any = "5"
    seconds: Any = "60"
    hostile_rate = Rate(limit=limit, seconds=seconds, text="5/minute")
    return [
        Slot("shop", Limit("shop", ("shop",), concurrency=5), True),
        Slot("shop/api", Limit("shop/api", ("shop", "api"), rate=hostile_rate), True),
    ]


def test_an_unexpected_exception_inside_a_backend_leaves_as_backend_error(
    backend_url: str,
) -> None:
    """A TypeError deep inside acquire (memory, shared table, Redis) leaves as a
    BackendError naming the store and quoting the cause; the slot taken before it is given
    back, and the backend admits normally afterwards."""
    backend = backend_from_url(backend_url)
    try:
        slots = _hostile_slots()
        with pytest.raises(BackendError, match="TypeError") as failed:
            backend.acquire(slots, 1000.0)
        assert str(failed.value).startswith(backend.label)
        assert isinstance(failed.value.__cause__, TypeError)
        assert backend.inflight(1000.0).get("shop", 0) == 0
        grant = backend.acquire(slots[:1], 1000.0)
        assert not isinstance(grant, Denial)
        assert backend.inflight(1000.0)["shop"] == 1
        backend.release(grant, 200, 0.0, 1000.0)
        assert backend.inflight(1000.0).get("shop", 0) == 0
    finally:
        backend.close()


def test_a_wrapped_error_masks_the_secrets_its_cause_quotes(tmp_path: Path) -> None:
    """A library message quoting a URL with a password or a ``password=`` pair is masked in
    the BackendError, and control characters are escaped (it goes to the log)."""
    backend = backend_from_url(f"shared://{tmp_path / 'gk.shm'}")
    try:
        cause = RuntimeError("redis://:hunter2@db:6379/0 password=hunter2\n\x1b[2J forged")
        error = backend.backend_error(cause)
        assert "hunter2" not in str(error) and "\x1b" not in str(error)
        assert "\n" not in str(error)
        assert str(error).startswith(f"shared table {str(tmp_path / 'gk.shm')!r}: RuntimeError")
        assert error.__cause__ is cause
    finally:
        backend.close()


def _hello(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


@pytest.mark.parametrize(("policy", "status"), [("allow", 200), ("reject", 503)])
def test_a_closed_shared_table_answers_by_on_backend_error(
    tmp_path: Path, policy: str, status: int
) -> None:
    """The shared table closed under a running app: every request gets what
    on_backend_error says (GK-BACKEND-UNAVAILABLE when "reject"), never a 500."""
    app = GateKeeperMiddleware(
        _hello,
        {
            "project": "shop",
            "backend": f"shared://{tmp_path / 'gk.shm'}",
            "on_backend_error": policy,
            "limits": {"shop": {"concurrency": 1}},
        },
    )
    app.gatekeeper.backend.close()
    client = Client(app)
    for _ in range(3):
        response = client.get("/work")
        assert response.status_code == status
        if status == 503:
            assert json.loads(response.data)["code"] == "GK-BACKEND-UNAVAILABLE"
    assert app.gatekeeper.monitor.backend_errors == 3


class _Failing(MemoryBackend):
    """A memory backend whose acquire (before taking anything) or release (after giving
    back) raises a library's error quoting a password, while ``failing`` names it."""

    failing = ""

    def acquire(self, slots: Any, now: float) -> Any:
        if self.failing == "acquire":
            raise RuntimeError("redis://:hunter2@db:6379/0 went away")
        return super().acquire(slots, now)

    def release(self, grant: Any, status: int | None, delay: float, now: float) -> None:
        super().release(grant, status, delay, now)
        if self.failing == "release":  # applied, but its answer was lost
            raise RuntimeError("redis://:hunter2@db:6379/0 went away")


@pytest.mark.parametrize(("policy", "status"), [("allow", 200), ("reject", 503)])
def test_the_engine_wraps_what_the_backends_own_acquire_and_release_raise(
    policy: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The hot path calls acquire and release past their guards: an unexpected error of
    either still ends as the guard's BackendError (on_backend_error for an admission; a
    counted failure for a release, the response unharmed), the password masked in the log,
    and the backend admits and releases normally once it recovers."""
    backend = _Failing()
    keeper = GateKeeper(
        {"project": "shop", "on_backend_error": policy, "limits": {"shop": {"concurrency": 1}}},
        backend=backend,
    )
    client = Client(GateKeeperMiddleware(_hello, keeper))
    backend.failing = "acquire"
    with caplog.at_level("WARNING", logger="gatekeeper"):
        response = client.get("/work")
    assert response.status_code == status
    assert keeper.monitor.backend_errors == 1
    assert "RuntimeError" in caplog.text and "hunter2" not in caplog.text
    assert "_Failing: RuntimeError: redis://:***@db" in caplog.text
    backend.failing = "release"
    response = client.get("/work")
    assert response.status_code == 200 and response.data == b"hello"
    # Counted (the log says a backend failed at most every 10 s).
    assert keeper.monitor.backend_errors == 2
    backend.failing = ""
    assert keeper.inflight() == {"shop": 0}
    assert client.get("/work").status_code == 200
    assert keeper.inflight() == {"shop": 0}
