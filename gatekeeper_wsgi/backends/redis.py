"""The Redis backend: exact limits shared by every host that talks to one Redis.

Keys (``<prefix>`` from ``?prefix=``, default ``gatekeeper``; ``<project>`` is the first
segment of the concrete path, so every key of one request shares one hash tag and one
Redis Cluster slot)::

    <prefix>:{<project>}:l:<path>   lease set: member = lease id, score = expiry (µs, Redis TIME)
    <prefix>:{<project>}:w:<path>   window log: member = lease id, score = admission time (µs)

Admission is one ``EVALSHA`` of ``lua/acquire.lua`` for all slots of a request: it drops
expired leases and slid-out window entries, checks every slot and takes all or none.
Release is one ``EVALSHA`` of ``lua/release.lua``. All time is Redis ``TIME``, so host
clocks do not matter (``engine_clock = False``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from importlib import resources
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from gatekeeper_wsgi.backends.base import Backend, Denial, Grant, Slot
from gatekeeper_wsgi.config import Config
from gatekeeper_wsgi.errors import BackendError, ConfigError
from gatekeeper_wsgi.redact import mask_text, mask_url

__all__ = ["RedisBackend"]

logger = logging.getLogger("gatekeeper")

DEFAULT_PREFIX = "gatekeeper"
DEFAULT_MAX_HOLD = 300.0
#: A request waits at most this long for a Redis that does not answer.
DEFAULT_CONNECT_TIMEOUT = 0.25
DEFAULT_READ_TIMEOUT = 0.5
#: After a failure every call fails fast for this long; then one probe goes through.
DEFAULT_BREAKER_COOLDOWN = 1.0
#: Releases that failed during an outage, kept to be replayed once Redis answers again.
_PENDING_RELEASES = 10_000
#: Replayed per successful release, so no single response pays for a whole backlog.
_FLUSH_BATCH = 32
_KEY_CACHE_SIZE = 10_000
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_KINDS = {1: "concurrency", 2: "rate"}


def _load_script(name: str) -> str:
    return (resources.files("gatekeeper_wsgi.backends") / "lua" / name).read_text("utf-8")


# Lease ids: a random token per process (renewed in forked children, so workers forked
# from one master never share it) plus a counter.
_token = os.urandom(8).hex()


def _new_token() -> None:
    global _token
    _token = os.urandom(8).hex()


os.register_at_fork(after_in_child=_new_token)
_sequence = itertools.count()


class _RedisGrant(Grant):
    __slots__ = ("lease", "lease_keys", "reserved")

    def __init__(
        self,
        slots: Sequence[Slot],
        shadowed: tuple[int, ...],
        lease: str,
        lease_keys: list[str],
        reserved: list[tuple[frozenset[int], str]],
    ) -> None:
        super().__init__(slots, shadowed)
        self.lease = lease
        self.lease_keys = lease_keys
        #: window logs holding a reservation that only listed statuses confirm
        self.reserved = reserved


class _PendingRelease(NamedTuple):
    lease: str
    lease_keys: list[str]
    log_keys: list[str]
    delay: float
    failed_at: float  # time.monotonic()


class CircuitOpen(BackendError):
    """Redis failed moments ago: failing fast, without touching the network."""


class _Breaker:
    """Closed: calls go through. After a failure, open for ``cooldown`` seconds (every call
    raises :class:`CircuitOpen` at once); then one probe goes through: success closes the
    breaker, failure opens it again."""

    def __init__(self, cooldown: float, location: str) -> None:
        self.cooldown = cooldown
        self._location = location
        self._lock = threading.Lock()
        self._open_until = 0.0  # 0: closed
        self._probing = False
        self._last_error = ""

    def before(self) -> None:
        if not self._open_until:
            return
        with self._lock:
            if not self._open_until:
                return
            remaining = self._open_until - time.monotonic()
            if remaining > 0 or self._probing:
                raise CircuitOpen(
                    f"redis at {self._location} unavailable, failing fast "
                    f"(last error: {self._last_error})"
                )
            self._probing = True  # this caller is the probe; the others keep failing fast

    def success(self) -> None:
        if self._open_until:
            with self._lock:
                if self._open_until:
                    self._open_until = 0.0
                    self._probing = False
                    logger.warning("gatekeeper: redis at %s is back", self._location)

    def abandon(self) -> None:
        """The call was interrupted (not a Redis failure): let another caller probe."""
        self._probing = False

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            was_closed = not self._open_until
            self._open_until = time.monotonic() + self.cooldown
            self._probing = False
            self._last_error = str(exc) or type(exc).__name__
        if was_closed:
            logger.error(
                "gatekeeper: redis at %s failed (%s); failing fast for %.2g s, then probing",
                self._location,
                self._last_error,
                self.cooldown,
            )


def _denial(result: list[Any]) -> Denial:
    """The Denial of a refusing acquire.lua answer {0, slot, kind, retry after in us}."""
    return Denial(int(result[1]), _KINDS[int(result[2])], max(0, int(result[3])) / 1e6, 0)


class RedisBackend(Backend):
    """Counters in Redis, exact across hosts; one round trip to admit, one to release.

    URL: ``redis://[user:pass@]host:port/db``, ``rediss://…``, ``unix:///path.sock?db=0``
    or ``valkey://…``, with the redis-py query options (``socket_timeout``,
    ``socket_connect_timeout``, …; defaults here 0.5 s and 0.25 s) and these::

        backend = "redis://redis.internal:6379/0?prefix=shop-gk&max_hold=600"

    - ``prefix`` (default ``gatekeeper``): the start of every key.
    - ``max_hold`` (seconds, default 300): a concurrency slot is a lease that expires
      after this long, so a crashed worker's slot comes back. A request held longer (a
      long streaming response) loses its lease: from then on its slot counts as free,
      and its release later does nothing. Set it above your longest response.
    - ``breaker_cooldown`` (seconds, default 1): after a failure every request fails fast
      (``on_backend_error`` applies at once, no network) for this long, then one request
      probes Redis; success recovers automatically.
    - ``cluster=1``: talk to a Redis Cluster (keys of one project share a hash tag).

    ``max_keys`` is not counted here: idle keys expire instead (a lease set when its last
    lease ends, a window log one window after its newest entry), so state is bounded by
    the traffic of one ``max_hold`` / window rather than by a key count. Releases that
    fail during an outage are replayed when Redis answers again; those lost (a restart
    without persistence, more than 10 000 pending) end by lease expiry. Replication can
    lose acknowledged writes on failover, so a limit may over-admit briefly then.
    Queued waiters poll (``local = False``), so the queue is FIFO per process only.
    """

    local = False
    engine_clock = False
    poll_interval = 0.005

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_hold: float = DEFAULT_MAX_HOLD,
        breaker_cooldown: float = DEFAULT_BREAKER_COOLDOWN,
        location: str = "redis",
    ) -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ConfigError(
                "backend", f"prefix: expected [A-Za-z0-9._:/-]{{1,64}}, got {prefix!r}"
            )
        if not max_hold > 0:
            raise ConfigError("backend", f"max_hold: expected seconds > 0, got {max_hold!r}")
        self.client = client
        self.prefix = prefix
        self.max_hold = max_hold
        self._hold_us = round(max_hold * 1_000_000)
        self._hold_ms = -(-self._hold_us // 1000)
        self._acquire_script: Script = client.register_script(_load_script("acquire.lua"))
        self._release_script: Script = client.register_script(_load_script("release.lua"))
        self._breaker = _Breaker(breaker_cooldown, location)
        self.location = location
        self._keys: dict[str, tuple[str, str]] = {}
        self._pending: deque[_PendingRelease] = deque(maxlen=_PENDING_RELEASES)
        self._delayed: list[float] = []
        self._delayed_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, config: Config | None = None) -> RedisBackend:
        """Build the backend from a ``redis://``, ``rediss://``, ``unix://`` or
        ``valkey://`` URL (see the class docstring for the query options)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "valkey":
            scheme = "redis"
        query = parse_qsl(parts.query, keep_blank_values=True)
        ours = {"prefix", "max_hold", "breaker_cooldown", "cluster"}
        options = {name: value for name, value in query if name in ours}
        passed = [(name, value) for name, value in query if name not in ours]
        redis_url = urlunsplit((scheme, parts.netloc, parts.path, urlencode(passed), ""))
        cluster = options.get("cluster", "0").strip().lower()
        if cluster not in _TRUE + _FALSE:
            raise ConfigError(
                "backend", f"cluster: expected 1 or 0, got {cluster!r} in {mask_url(url)!r}"
            )
        kwargs: dict[str, Any] = {
            "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT,
            "socket_timeout": DEFAULT_READ_TIMEOUT,
            # No retries: a retried admission that did run would hold a second lease.
            "retry": Retry(NoBackoff(), 0),
            # Maintenance notifications would relax the timeouts to 10 s and skip the
            # pool's stale-connection check.
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        client: redis.Redis | RedisCluster
        try:
            if cluster in _TRUE:
                client = RedisCluster.from_url(redis_url, **kwargs)
            else:
                client = redis.Redis.from_url(redis_url, **kwargs)
        except (ValueError, TypeError, redis.exceptions.RedisError) as exc:
            raise ConfigError(
                "backend", f"invalid redis URL {mask_url(url)!r}: {mask_text(str(exc))}"
            ) from exc
        location = parts.hostname or ""
        if parts.port:
            location = f"{location}:{parts.port}"
        if scheme == "unix":
            location = parts.path
        return cls(
            client,
            prefix=options.get("prefix", DEFAULT_PREFIX),
            max_hold=_seconds(url, "max_hold", options, DEFAULT_MAX_HOLD),
            breaker_cooldown=_seconds(url, "breaker_cooldown", options, DEFAULT_BREAKER_COOLDOWN),
            location=location or url.split("?", 1)[0].rsplit("@", 1)[-1],
        )

    # --- keys -----------------------------------------------------------------------------

    def keys_of(self, path: str) -> tuple[str, str]:
        """The lease set and window log keys of a concrete path."""
        keys = self._keys.get(path)
        if keys is None:
            if len(self._keys) >= _KEY_CACHE_SIZE:
                self._keys = {}
            base = f"{self.prefix}:{{{path.split('/', 1)[0]}}}:"
            keys = self._keys[path] = (f"{base}l:{path}", f"{base}w:{path}")
        return keys

    # --- admission ------------------------------------------------------------------------

    def acquire(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        if self._pending:
            # Slots whose release failed during an outage are given back first, so this
            # decision sees them free.
            self._flush()
        lease = f"{_token}{next(_sequence):x}"
        keys, args, lease_keys = self._script_input(slots, lease)
        try:
            result = self._call(self._acquire_script, keys, args)
        except BackendError as exc:
            if not isinstance(exc, CircuitOpen):
                # The script may have run before the connection broke: give the lease back
                # once Redis answers again instead of holding it for max_hold.
                self._pending.append(_PendingRelease(lease, lease_keys, [], 0.0, 0.0))
            raise
        if result[0] != 1:
            return _denial(result)
        shadowed = tuple(int(index) for index in result[1])
        unrecorded = {int(index) for index in result[2]}
        reserved = [
            (slot.limit.count, self.keys_of(slot.key)[1])
            for index, slot in enumerate(slots)
            if slot.limit.count is not None
            and slot.limit.rate is not None
            and index not in unrecorded
        ]
        return _RedisGrant(slots, shadowed, lease, lease_keys, reserved)

    def _script_input(
        self, slots: Sequence[Slot], lease: str
    ) -> tuple[list[str], list[str | int], list[str]]:
        """KEYS and ARGV of acquire.lua, and the lease sets among the KEYS."""
        keys: list[str] = []
        args: list[str | int] = [lease, self._hold_us, self._hold_ms]
        lease_keys: list[str] = []
        for slot in slots:
            lease_key, log_key = self.keys_of(slot.key)
            keys.append(lease_key)
            lease_keys.append(lease_key)
            limit = slot.limit
            concurrency = -1 if limit.concurrency is None else limit.concurrency
            rate = limit.rate
            if rate is None:
                args += (concurrency, 0, 0, int(slot.enforce))
            else:
                keys.append(log_key)
                args += (
                    concurrency,
                    rate.limit,
                    round(rate.seconds * 1_000_000),
                    int(slot.enforce),
                )
        return keys, args, lease_keys

    def peek(self, slots: Sequence[Slot], now: float) -> Denial | None:
        """Whether acquire would admit now: acquire.lua without a lease checks only (it
        drops expired entries and records nothing)."""
        keys, args, _ = self._script_input(slots, "")
        result = self._call(self._acquire_script, keys, args)
        return None if result[0] == 1 else _denial(result)

    # --- release --------------------------------------------------------------------------

    def release(self, grant: Grant, status: int | None, delay: float, now: float) -> None:
        assert isinstance(grant, _RedisGrant)
        log_keys = [key for counted, key in grant.reserved if status not in counted]
        if delay > 0:
            due = time.monotonic() + delay
            with self._delayed_lock:
                heapq.heappush(self._delayed, due)
        try:
            self._release(grant.lease, grant.lease_keys, log_keys, delay)
        except BackendError:
            self._pending.append(
                _PendingRelease(grant.lease, grant.lease_keys, log_keys, delay, time.monotonic())
            )
            raise
        if self._pending:
            self._flush()

    def _release(
        self, lease: str, lease_keys: list[str], log_keys: list[str], delay: float
    ) -> None:
        delay_us = round(delay * 1_000_000)
        self._call(
            self._release_script,
            lease_keys + log_keys,
            [lease, len(lease_keys), delay_us, -(-delay_us // 1000)],
        )

    def _flush(self) -> None:
        """Replay a batch of releases that failed while Redis was away."""
        for _ in range(_FLUSH_BATCH):
            try:
                pending = self._pending.popleft()
            except IndexError:
                return
            delay = pending.delay
            if delay > 0:
                delay = max(0.0, delay - (time.monotonic() - pending.failed_at))
            try:
                self._release(pending.lease, pending.lease_keys, pending.log_keys, delay)
            except BackendError:
                self._pending.appendleft(pending)
                return

    # --- the one way to Redis -------------------------------------------------------------

    def _call(self, script: Script, keys: list[str], args: list[str | int]) -> list[Any]:
        breaker = self._breaker
        breaker.before()
        try:
            result = script(keys=keys, args=args)
        except Exception as exc:  # redis-py's, or anything it let through: never a 500
            breaker.failure(exc)
            raise BackendError(f"redis at {self.location}: {exc}") from exc
        except BaseException:
            breaker.abandon()
            raise
        breaker.success()
        return result  # type: ignore[no-any-return]

    # --- observation ----------------------------------------------------------------------

    def inflight(self, now: float) -> dict[str, int]:
        """Leases per concrete path, found by SCAN over the prefix (for status pages)."""
        self._breaker.before()
        prefix = self.prefix
        pattern = _glob_escape(prefix) + ":{*}:l:*"
        counts: dict[str, int] = {}
        try:
            seconds, micros = self.client.time()
            now_us = seconds * 1_000_000 + micros
            keys = sorted({_text(key) for key in self.client.scan_iter(match=pattern, count=1000)})
            if keys:
                pipe = self.client.pipeline(transaction=False)
                for key in keys:
                    pipe.zcount(key, f"({now_us}", "+inf")
                for key, held in zip(keys, pipe.execute(), strict=True):
                    path = key.split("}:l:", 1)[1]
                    if held:
                        counts[path] = int(held)
        except Exception as exc:
            self._breaker.failure(exc)
            raise BackendError(f"redis at {self.location}: {exc}") from exc
        except BaseException:
            self._breaker.abandon()
            raise
        self._breaker.success()
        if self._pending:
            self._flush()
        return counts

    def delayed_pending(self) -> int:
        """Delayed releases this process placed that have not matured yet (best effort:
        other hosts' are not counted)."""
        delayed = self._delayed
        if not delayed:
            return 0
        now = time.monotonic()
        with self._delayed_lock:
            while delayed and delayed[0] <= now:
                heapq.heappop(delayed)
            return len(delayed)

    def close(self) -> None:
        self.client.close()


def _seconds(url: str, name: str, options: dict[str, str], default: float) -> float:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ConfigError(
            "backend", f"{name}: expected seconds > 0, got {text!r} in {mask_url(url)!r}"
        )
    return value


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
