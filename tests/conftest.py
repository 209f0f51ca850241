"""Shared fixtures: the backend table that parametrizes the conformance suite, a clock
tests move by hand, and a real redis-server started for the session."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# No per-example deadline and no too-slow check for any property test: tests assert
# behaviour, never timing, and on a loaded CI machine one example can take any time.
settings.register_profile("gatekeeper", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("gatekeeper")

REDIS_BINARY = shutil.which("redis-server")
#: CI sets this, so a missing redis-server fails instead of skipping.
REQUIRE_REDIS = os.environ.get("GATEKEEPER_REQUIRE_REDIS") == "1"


def replace_file(path: Path, text: str) -> None:
    """Replace a configuration file by an atomic rename, the instant way of
    docs/configuration.md (swapped in at the next check; a file rewritten in place waits
    until it has settled, SPEC §4.10). The temporary name is the thread's own, so threads
    may replace one file at once."""
    temporary = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def busy(source: Any) -> dict[str, int]:
    """The in-flight counts of a GateKeeper (or a mapping of them) without the paths at
    zero, which a backend may omit or show."""
    counts = source if isinstance(source, Mapping) else source.inflight()
    return {path: count for path, count in counts.items() if count}


def refusal(fault: Any) -> tuple[str, str | None, str | None, str | None]:
    """(code, level, limit path, limit value) of a Rejected: what a refusal names."""
    return fault.code, fault.level, fault.limit_path, fault.limit_value


def admits_exactly(gk: Any, limit: int, project: str, service: str, caller: str) -> None:
    """``gk`` admits ``limit`` requests of (project, service, caller) at once and refuses the
    next by a concurrency limit; then the admitted ones are released."""
    from gatekeeper_wsgi import Rejected

    held = [gk.admit(project, service, caller) for _ in range(limit)]
    with pytest.raises(Rejected) as refused:
        gk.admit(project, service, caller)
    assert refused.value.code == "GK-CONCURRENCY-LIMIT"
    for admission in held:
        admission.release(200)


class FakeClock:
    """A monotonic clock the test advances explicitly: delays and windows without sleeps."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    """A clock at t=1000 that only moves when the test says so."""
    return FakeClock()


def redis_binary() -> str:
    """The redis-server binary; without one a skip (a failure when CI requires Redis)."""
    if REDIS_BINARY is None:
        if REQUIRE_REDIS:
            pytest.fail("GATEKEEPER_REQUIRE_REDIS=1 but no redis-server binary on PATH")
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    return REDIS_BINARY


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port for the whole session; yields its URL."""
    from tests.servers import RedisServer

    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Any]:
    """A redis-server of this test alone (a ``tests.servers.ControlledRedis``), to stop,
    freeze and restart."""
    from tests.servers import ControlledRedis

    server = ControlledRedis(redis_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prefixed(redis_server: str) -> str:
    """The session redis-server with a key prefix of this test alone."""
    return f"{redis_server}?prefix=gk-test-{uuid.uuid4().hex[:8]}"


#: One backend table for the conformance suite (engine and middleware tests use it).
BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("shared", id="shared"),
    pytest.param("redis", id="redis", marks=pytest.mark.redis),
]
#: The backends that count time by the engine's clock, so a test can move it by hand
#: (Redis counts by its own ``TIME``: the real-time variants cover it).
CLOCKED_BACKENDS = [param for param in BACKENDS if param.id in ("memory", "shared")]


def new_backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh, empty backend of the kind in ``request.param``."""
    kind = request.param
    if kind == "memory":
        return "memory"
    if kind == "shared":
        return f"shared://{tmp_path}/gatekeeper.shm"
    base = request.getfixturevalue("redis_server")
    # A generous read timeout: these tests are about counting, and on a loaded machine a
    # SCAN of a status read can take longer than the default 0.5 s. The timeout tests set
    # their own.
    return f"{base}?prefix=gk-test-{uuid.uuid4().hex[:8]}&socket_timeout=5"


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh, empty backend of each kind."""
    return new_backend_url(request, tmp_path)


@pytest.fixture(params=CLOCKED_BACKENDS)
def clocked_backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh, empty backend of each kind that follows the engine's clock."""
    return new_backend_url(request, tmp_path)
