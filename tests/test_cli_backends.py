"""`gatekeeper check` judges backend URLs exactly as start-up does: the same URLs pass, by the
backends' own parsing, and checking creates or connects to nothing."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.backends import backend_from_url
from gatekeeper_wsgi.cli import run_check
from gatekeeper_wsgi.errors import ConfigError

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
    # redis-py takes these, and every request would then fail at the backend
    "redis://127.0.0.1:9/0?socket_timeout=nan",
    "redis://127.0.0.1:9/0?socket_timeout=-1",
    "redis://127.0.0.1:9/0?socket_timeout=1e999",
    "redis://127.0.0.1:9/0?socket_connect_timeout=nan",
    "redis://127.0.0.1:9/0?socket_connect_timeout=0",
    "redis://127.0.0.1:9/0?health_check_interval=-3",
    "redis://127.0.0.1:9/0?max_connections=" + "9" * 5000,
    # an option given twice: one value would win unseen
    "redis://127.0.0.1:9/0?max_hold=5&max_hold=600",
    "redis://127.0.0.1:9/0?socket_timeout=1&socket_timeout=2",
    "shared:///{tmp}/gk.shm?size=100&size=5000000",
    "valkey://127.0.0.1:9/0?bogus=1",
    "unix:///tmp/redis.sock?db=zero",
    "memory://somewhere",
    "memcached://127.0.0.1:11211",
    "redis://:hunter2@[::1/0",
    "redis://127.0.0.1:9/notanumber",
    "redis://127.0.0.1:9/-5",
]
GOOD_URLS = [
    "memory",
    "shared:///{tmp}/gk.shm",
    "shared:///{tmp}/gk.shm?size=1000&leases=500&procs=64&windows=100",
    "shared:///{tmp}/gk.shm?mode=0660",
    "redis://127.0.0.1:9/0",
    "redis://:secret@127.0.0.1:9/0?prefix=shop&max_hold=600&socket_timeout=0.5",
    "redis://127.0.0.1:9/0?socket_connect_timeout=2&health_check_interval=0&max_connections=50",
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
    # a Redis URL given to the memory backend by mistake: refused, its password masked
    status, output = checked({"backend": "memory://:hunter2@redis.internal:6379/0"})
    assert status == 1 and "memory backend takes no address" in output
    assert "hunter2" not in output and "redis.internal" in output


def test_a_typo_in_a_redis_option_fails_at_start_up() -> None:
    """An unknown Redis URL option is refused when the app starts, not at its first request."""
    with pytest.raises(ConfigError, match="max_holdd"):
        GateKeeper({"backend": "redis://127.0.0.1:9/0?max_holdd=5"})


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("gk.toml", 'project = "shop"\n\nbackend = "redis://:hunter2@127.0.0.1:9/0?bogus=1"\n'),
        ("gk.toml", '[gatekeeper]\nproject = "shop"\nbackend = "redis://:hunter2@[::1/0"\n'),
        (
            "gk.properties",
            "project = shop\n# the backend\nbackend = shared:///{tmp}/gk.shm?sise=9\n",
        ),
        ("gk.properties", "project = shop\n\nbackend = redis://127.0.0.1:9/notanumber\n"),
    ],
)
def test_a_bad_backend_url_in_a_file_names_the_file_and_line(
    name: str, text: str, tmp_path: Path
) -> None:
    """What only the backend's own parsing finds (an unknown option, a malformed URL) is a
    ConfigError at the file and line of ``backend`` too, at start-up and from `gatekeeper
    check`, with the URL's password masked."""
    path = tmp_path / name
    path.write_text(text.replace("/{tmp}", str(tmp_path)), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GateKeeper(str(path))
    assert (info.value.file, info.value.line, info.value.key) == (str(path), 3, "backend")
    assert "hunter2" not in str(info.value)
    out = io.StringIO()
    assert run_check(str(path), out) == 1
    assert out.getvalue().startswith(f"error: {path}:3: backend: ")
    assert "hunter2" not in out.getvalue()


@pytest.mark.parametrize(
    ("plant", "problem"),
    [
        (lambda path: path.symlink_to(path.with_name("real.shm")), "symbolic link"),
        (lambda path: path.write_bytes(b"precious data, not a table\n"), "not a gatekeeper"),
        (lambda path: (path.write_bytes(b""), path.chmod(0o666)), "writable by group and others"),
    ],
    ids=["symlink", "foreign file", "world-writable"],
)
def test_check_judges_an_existing_shared_file_as_start_up_does(
    plant: Any, problem: str, tmp_path: Path
) -> None:
    """A file already at the shared path that start-up would refuse fails `gatekeeper
    check` too, with the same reason, and is left as it was."""
    (tmp_path / "real.shm").write_bytes(b"")
    path = tmp_path / "gk.shm"
    plant(path)
    before = path.lstat()
    url = f"shared://{path}"
    status, output = checked({"backend": url})
    assert status == 1 and problem in output
    assert not starts(url)
    after = path.lstat()
    assert (after.st_mtime_ns, after.st_size, after.st_mode) == (
        before.st_mtime_ns,
        before.st_size,
        before.st_mode,
    )


def test_check_accepts_an_existing_table(tmp_path: Path) -> None:
    """A table the backend made (and one it left empty) passes the check."""
    url = f"shared://{tmp_path}/gk.shm"
    backend_from_url(url).close()
    assert checked({"backend": url})[0] == 0
    (tmp_path / "empty.shm").write_bytes(b"")
    (tmp_path / "empty.shm").chmod(0o600)
    assert checked({"backend": f"shared://{tmp_path}/empty.shm"})[0] == 0


def test_a_redis_backend_names_an_ipv6_host_in_brackets() -> None:
    """The backend's name in its log lines keeps an IPv6 address apart from its port."""
    from gatekeeper_wsgi.backends.redis import RedisBackend

    backend = RedisBackend.from_url("redis://u:pw@[::1]:7250/0", check=False)
    try:
        assert backend.label == "redis at [::1]:7250"
    finally:
        backend.close()
