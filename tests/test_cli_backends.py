"""`gatekeeper check` judges backend URLs exactly as start-up does, and `gatekeeper status`
counts requests (not slots summed over levels) and delayed releases on every backend."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.backends import backend_from_url
from gatekeeper_wsgi.cli import run_check, run_status
from gatekeeper_wsgi.errors import ConfigError
from tests.conftest import BACKENDS, new_backend_url
from tests.test_cli import gatekeeper_script

# Redis URLs name a port nothing listens on: neither check nor start-up connects.
BAD_URLS = [
    "shared:///{tmp}/gk.shm?size=abc",
    "shared:///{tmp}/gk.shm?size=-5",
    "shared:///{tmp}/gk.shm?size=0",
    "shared:///{tmp}/gk.shm?size=" + "9" * 5000,
    "shared:///{tmp}/gk.shm?sise=100",
    "shared:///{tmp}/gk.shm?leases=1e3",
    "shared:///{tmp}/gk.shm?mode=0666",
    "shared://",
    "redis://127.0.0.1:9/0?max_hold=-5",
    "redis://127.0.0.1:9/0?max_hold=abc",
    "redis://127.0.0.1:9/0?max_hold=" + "9" * 5000,
    "redis://127.0.0.1:9/0?breaker_cooldown=inf",
    "redis://127.0.0.1:9/0?cluster=maybe",
    "redis://127.0.0.1:9/0?max_holdd=5",
    "redis://127.0.0.1:9/0?bogus=1",
    "redis://127.0.0.1:9/0?socket_timeout=abc",
    "valkey://127.0.0.1:9/0?bogus=1",
    "unix:///tmp/redis.sock?db=zero",
    "memory://somewhere",
    "memcached://127.0.0.1:11211",
]
GOOD_URLS = [
    "memory",
    "shared:///{tmp}/gk.shm",
    "shared:///{tmp}/gk.shm?size=1000&leases=500&procs=64&windows=100",
    "shared:///{tmp}/gk.shm?mode=0660",
    "redis://127.0.0.1:9/0",
    "redis://:secret@127.0.0.1:9/0?prefix=shop&max_hold=600&socket_timeout=0.5",
    "rediss://127.0.0.1:9/0?ssl_cert_reqs=none",
    "valkey://127.0.0.1:9/2?breaker_cooldown=2.5",
    "unix:///tmp/redis.sock?db=3",
]


def starts(url: str) -> bool:
    """Whether start-up accepts the URL (the engine builds its backend from it)."""
    try:
        backend_from_url(url).close()
    except ConfigError:
        return False
    return True


def checked(settings: dict[str, Any]) -> tuple[int, str]:
    out = io.StringIO()
    return run_check(settings, out), out.getvalue()


@pytest.mark.parametrize("url", BAD_URLS + GOOD_URLS, ids=lambda url: url[:60])
def test_check_judges_a_backend_url_as_start_up_does(url: str, tmp_path: Path) -> None:
    """`gatekeeper check` accepts exactly the backend URLs start-up accepts, and creates no
    file doing so."""
    url = url.replace("/{tmp}", str(tmp_path))
    status, output = checked({"backend": url})
    assert list(tmp_path.iterdir()) == []  # check created nothing
    assert (status == 0) == starts(url), output
    assert (status == 0) == (url in [u.replace("/{tmp}", str(tmp_path)) for u in GOOD_URLS])
    if status:
        assert output.startswith("error: backend") and len(output) < 2_000


def test_check_names_the_bad_option_and_masks_the_password(tmp_path: Path) -> None:
    """The error names the option at fault and never prints the password of the URL."""
    status, output = checked({"backend": "redis://:hunter2@127.0.0.1:9/0?max_hold=-5"})
    assert status == 1
    assert "max_hold" in output
    status, output = checked({"backend": f"shared://{tmp_path}/gk.shm?size=abc"})
    assert status == 1 and "size" in output


def test_a_typo_in_a_redis_option_fails_at_start_up() -> None:
    """An unknown Redis URL option is refused when the app starts, not at its first request."""
    with pytest.raises(ConfigError, match="max_holdd"):
        GateKeeper({"backend": "redis://127.0.0.1:9/0?max_holdd=5"})


@pytest.fixture(params=[param for param in BACKENDS if param.id != "memory"])
def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A backend URL that other processes can read: shared file or Redis."""
    return new_backend_url(request, tmp_path)


def status_json(url: str) -> dict[str, Any]:
    """`gatekeeper status --json`, run as its own process."""
    done = subprocess.run(
        [gatekeeper_script(), "status", "--backend", url, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def test_status_counts_requests_and_delayed_releases(shared_backend: str) -> None:
    """Two requests limited on three levels are 2 in flight, not 6; a faulty response's
    delayed release shows as 1 delayed, from another process, on shared and Redis alike."""
    settings = {
        "project": "shop",
        "backend": shared_backend,
        "limits": {
            "shop": {"concurrency": 10, "delay": 600},
            "shop/checkout": {"concurrency": 10},
            "shop/checkout/*": {"concurrency": 10},
        },
    }
    keeper = GateKeeper(settings)
    try:
        first = keeper.admit("shop", "checkout", "crm")
        second = keeper.admit("shop", "checkout", "erp")
        document = status_json(shared_backend)
        assert (document["requests"], document["delayed_pending"]) == (2, 0)
        assert sum(document["inflight"].values()) == 6  # the slots, per path
        out = io.StringIO()
        assert run_status(shared_backend, as_json=False, out=out, config=settings) == 0
        assert "2 in flight" in out.getvalue()

        first.release(500, faulty=True)  # holds its slots for the 600 s delay
        assert keeper.stats()["counters"]["delayed_pending"] == 1
        document = status_json(shared_backend)
        assert (document["requests"], document["delayed_pending"]) == (1, 1)
        assert document["inflight"]["shop/checkout"] == 2
        out = io.StringIO()
        assert run_status(shared_backend, as_json=False, out=out) == 0
        assert "1 in flight" in out.getvalue()
        assert "delayed releases pending: 1" in out.getvalue()
        second.release(200)
        assert (status_json(shared_backend)["requests"]) == 0
    finally:
        keeper.close()
