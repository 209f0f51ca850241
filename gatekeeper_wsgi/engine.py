"""The admission engine: :class:`GateKeeper` decides, counts and releases.

Framework-free: it knows (project, service, caller), a WSGI-style environ for the other
key kinds (ip, user, header), and a clock. The WSGI middleware and the Django and Flask
plugins all call it; none of them re-implements admission or release.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from gatekeeper_wsgi.adaptive import AdaptiveReport
from gatekeeper_wsgi.backends import backend_from_url, check_backend_url
from gatekeeper_wsgi.backends.base import (
    TOP_KEYS,
    Backend,
    Denial,
    Grant,
    LimitTotals,
    WaitingLine,
    unguarded,
)
from gatekeeper_wsgi.config import (
    Config,
    ConfigSource,
    config_file,
    expand_source,
    load_config,
    located,
)
from gatekeeper_wsgi.errors import (
    BackendError,
    CapacityError,
    ConfigError,
    Rejected,
    escape_controls,
)
from gatekeeper_wsgi.fileformats import open_for_writing, read_file
from gatekeeper_wsgi.identify import Identifier
from gatekeeper_wsgi.limitindex import counting_limit, counts
from gatekeeper_wsgi.monitor import Monitor, Stats
from gatekeeper_wsgi.redact import Throttle, mask_text, mask_url
from gatekeeper_wsgi.resolve import Route
from gatekeeper_wsgi.values import Limit, QueueSpec, RateInfo, Slot

__all__ = ["Admission", "ConfigSource", "GateKeeper"]

logger = logging.getLogger("gatekeeper")

_EMPTY: Mapping[str, Any] = MappingProxyType({})
# Unbounded service names (first path segment of arbitrary URLs) must not grow the cache.
_ROUTE_CACHE_SIZE = 10_000
# Seconds after its last change during which a file's contents are compared even when its
# (mtime, size, inode) stamp is unchanged.
_FRESH_FILE = 2.0
# How long content rewritten in place must stay the same before it is swapped in: an
# editor's truncate-and-write is done long before, a half-written file is not taken.
_SETTLE_SECONDS = 0.1
# Whether a perf_counter() reading is also a monotonic() one (see GateKeeper._perf_clock).
_PERF_IS_MONOTONIC = (
    time.get_clock_info("perf_counter").implementation
    == time.get_clock_info("monotonic").implementation
)
# A backend outage is logged at most this often.
_ERROR_LOG_INTERVAL = 10.0
# A limit whose keys, leases or window entries ran out is named in a WARNING at most this
# often (engine clock), however many requests it refuses meanwhile.
_CAPACITY_LOG_INTERVAL = 60.0
# A shadow limit's admissions over it are logged at most this often (engine clock), with
# how many there were: in the request's thread, and they come by the thousand when the
# limit is being sized on live traffic.
_SHADOW_LOG_INTERVAL = 10.0


class _Retired:
    """The backend of an engine the garbage collector took (an engine a framework dropped:
    Django's rebuilt on ``override_settings``, a Flask app of a test's factory). Its file
    descriptor, connections and sender thread are let go by :meth:`release`, made with
    the collected releases: not in the collector, which may run inside a lock, on any
    thread, where a Redis flush could wait for a socket timeout."""

    __slots__ = ("backend",)

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def release(self, status: int | None = None, faulty: bool = False) -> None:
        self.backend.close()


#: Releases the garbage collector asked for (see :meth:`Admission.release_collected`),
#: and backends of collected engines to close (:class:`_Retired`), made by the next call
#: into an engine that is sure to hold no lock: (admission, status, faulty). A deque:
#: appending and popping are atomic, from any thread, under any lock.
_collected: deque[tuple[Admission | _Retired, int | None, bool]] = deque()


#: how often a nudge of the local line tries its lock (see _LocalLine.nudge)
_NUDGE_TRIES = 3


def _release_collected() -> None:
    """Make the releases the garbage collector asked for, outside any lock."""
    while True:
        try:
            admission, status, faulty = _collected.popleft()
        except IndexError:
            return
        try:
            admission.release(status, faulty)
        except Exception:  # the backend's expiry frees them anyway: never fail the caller
            logger.debug("gatekeeper: a collected response's release failed", exc_info=True)


def _forget_collected() -> None:
    """In a forked child: the releases waiting are the parent's to make."""
    _collected.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_collected)


#: (mtime ns, size, inode, ctime ns): see _stamp
Stamp = tuple[int, int, int, int]


def _stamp(status: os.stat_result) -> Stamp:
    """What tells a file's versions apart without reading it: (mtime ns, size, inode,
    ctime ns). The ctime moves with a change of mode or owner too: a file found
    unreadable is read again once that is fixed."""
    return (status.st_mtime_ns, status.st_size, status.st_ino, status.st_ctime_ns)


class Admission:
    """An admitted request's hold on its slots. Call :meth:`release` when the response is
    finished; further calls, from any thread at any moment, do nothing."""

    __slots__ = ("_held", "_keeper", "delay", "route")
    # Made by GateKeeper.admit only, field by field: no __init__, whose call costs ~600
    # instructions per request (callgrind); Admission() is then C code alone.
    _keeper: GateKeeper
    #: the grant in a one-item list: release takes it with one pop, which only one thread
    #: can win (see Grant.claim), so no two releases ever both free the slots
    _held: list[Grant | None]
    route: Route
    #: seconds the slots are held after a faulty response
    delay: float

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return not self._held

    @property
    def slots(self) -> tuple[Slot, ...]:
        """The slots held: one per level whose limit counts this request (its concrete
        path and the configured limit). Empty once released, or when no limit counts it."""
        try:
            grant = self._held[0]
        except IndexError:  # released, maybe by another thread just now
            return ()
        return () if grant is None else tuple(grant.slots)

    def release(self, status: int | None = None, faulty: bool = False) -> None:
        """Give the slots back: now, or after ``delay`` when the response was faulty.

        ``status`` confirms or returns the rate reservations of limits that count only
        some statuses (``count = [401]``). Timed as the ``response`` stage, or
        ``service_error`` when faulty.
        """
        held = self._held
        # Most releases after the first (a body handed out, then closed, then collected)
        # find it empty: a test, where a raised IndexError would cost a microsecond.
        if not held:
            return
        try:
            grant = held.pop()
        except IndexError:  # another thread took it between the test and the pop
            return
        self._keeper._settle(grant, status, faulty, self.delay if faulty else 0.0)

    def release_collected(self, status: int | None = None, faulty: bool = False) -> None:
        """:meth:`release` for a response the garbage collector found unclosed: made by the
        next call into an engine (an admission, a status read, ``close()``), not here. The
        collector runs whenever an allocation calls for it, on any thread, also one inside
        a backend's lock, which a release here would wait for forever."""
        if self._held:
            _collected.append((self, status, faulty))
            keeper = self._keeper
            if keeper._waiting:
                # Its waiters make it (they hold no lock when they look): told without
                # waiting for any lock, which this thread may hold already.
                keeper._line.nudge()


class GateKeeper:
    """Admits or rejects requests by the limits of a configuration.

    ``config`` is a settings dict (SPEC §3) or the path of a ``.toml`` / ``.properties``
    file. ``clock`` returns monotonic seconds; tests inject one to travel in time.
    ``code_limits`` are limits defined in code, as :meth:`add_limits` takes them;
    ``validated``, the :class:`Config` of ``config`` with them that the caller has built
    already (``load_config(config).with_code_limits(code_limits)``), used as is::

        gk = GateKeeper({"project": "shop", "limits": {"shop": {"concurrency": 100}}})
        admission = gk.admit("shop", "checkout", "crm")   # raises Rejected when full
        try:
            ...  # handle the request
        finally:
            admission.release(status=200)
    """

    def __init__(
        self,
        config: ConfigSource,
        *,
        clock: Callable[[], float] = time.monotonic,
        backend: Backend | None = None,
        code_limits: Mapping[str, Mapping[str, Any]] | None = None,
        validated: Config | None = None,
    ) -> None:
        # A file naming another in reload.file is settings that file is laid over.
        self._source = config = expand_source(config)
        self._file = (
            config_file(config) if isinstance(config, (str, os.PathLike, Mapping)) else None
        )
        self._code_limits: dict[str, Mapping[str, Any]] = dict(code_limits or {})
        self._clock = clock
        # Where the default clock is the one behind perf_counter (both CLOCK_MONOTONIC on
        # Linux), admission and release take "now" from the reading they take for their
        # stage timings instead of asking the clock a second time.
        self._perf_clock = clock is time.monotonic and _PERF_IS_MONOTONIC
        self.monitor = Monitor()
        self._file_stamp: Stamp | None = None
        self._file_digest = b""
        # Changed content first seen while it may still be being written:
        # (stamp, digest, time.monotonic() when seen).
        self._pending: tuple[Stamp, bytes, float] | None = None
        # The stamp of a path found not to be a readable regular file (a FIFO, a device).
        self._unreadable: Stamp | None = None
        # A framework that validated its settings at start-up hands the result over, so
        # nothing is validated twice; a file is then read again at the first reload check.
        self.config = validated if validated is not None else self._build()
        # The inode found at the path by the last check (a rename brings another one).
        self._seen_inode: int | None = None if self._file_stamp is None else self._file_stamp[2]
        #: the request helpers (service, caller, request id) of the configuration in force
        self.identifier = Identifier(self.config)
        #: closes the backend this engine made once the engine is collected unclosed
        #: (one passed in is its owner's to close)
        self._retire: weakref.finalize[Any, Any] | None = None
        if backend is None:
            try:
                backend = backend_from_url(self.config.backend, self.config)
            except ConfigError as exc:
                raise located(exc, self._file) from exc
            self._retire = weakref.finalize(
                self, _collected.append, (_Retired(backend), None, False)
            )
            self._retire.atexit = False  # the process's exit lets everything go
        self.backend = backend
        #: what stats() last read from the backend (delayed releases pending, adaptive
        #: limits), reported again while it fails
        self._last_read: tuple[int, dict[str, AdaptiveReport]] = (0, {})
        self._check_adaptive(self.config)
        stages = self.monitor.stages
        self.backend.delay_stage = stages["delay_process"]
        # The hot path's two calls, past the guards: admit and _settle wrap what they
        # raise as the guards would (_failure).
        self._acquire = unguarded(self.backend, "acquire")
        self._release = unguarded(self.backend, "release")
        self._response_stage = stages["response"]
        self._error_stage = stages["service_error"]
        self._routes: dict[tuple[str, str], Route] = {}
        self._reload_lock = threading.Lock()
        self._requests_since_check = 0
        self._next_check = clock() + self.config.reload.every_seconds
        # Queues: concrete limit path -> FIFO of waiters (the process's line); one
        # condition for all of them. _waiting counts this process's waiting requests.
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[str, deque[_Place]] = {}
        self._waiting = 0
        # Bumped under _cond by every wake-up of the process's line: a waiter that saw a
        # release happen after it last looked does not go to sleep.
        self._wakes = 0
        self._line: WaitingLine[Any] = self.backend.waiting_line() or _LocalLine(self)
        # Per thread: how long its request's queue wait took (see _take_wait).
        self._waited = threading.local()
        self._errors_logged = Throttle(_ERROR_LOG_INTERVAL)
        #: the backend's incidents this engine has answered (see Backend.incidents), and
        #: whether it can have any: looked up once here, a class attribute read through
        #: an instance costs ~300 instructions on every admission
        self._incidents = 0
        self._recovers = self.backend.recovers
        # limit path -> the throttle of its capacity WARNINGs, of its shadow-mode INFO
        # lines (paths come from the configuration, not from requests: these stay small)
        self._capacity_logged: dict[str, Throttle] = {}
        self._shadow_logged: dict[str, Throttle] = {}

    # --- configuration --------------------------------------------------------------------

    def _build(self, data: bytes | None = None) -> Config:
        """Validate settings + code limits + file into a Config; raises ConfigError.

        ``data`` is the file's content as read by the caller; without it the file is read
        here (start-up, ``add_limits``), only if it is a regular file (``read_file``).
        """
        if self._file is not None and data is None:
            data, status = read_file(self._file)
            self._file_stamp = _stamp(status)
            self._file_digest = hashlib.blake2b(data).digest()
        return load_config(self._source, code_limits=self._code_limits, data=data)

    def add_limits(self, limits: Mapping[str, Mapping[str, Any]]) -> None:
        """Add limits defined in code (framework decorators). Settings and the file win
        over them for the same path; they survive reloads."""
        self._code_limits.update(limits)
        self._swap(self._keep_backend(self._build()))

    def _keep_backend(self, config: Config) -> Config:
        """A reloaded ``config`` with the backend in use: it cannot change while running.
        A URL start-up would refuse fails the reload (ConfigError, with file and line);
        another one is warned about and kept for the restart, so what the configuration
        reports (status page, ``gatekeeper check``) is the backend that counts."""
        if config.backend == self.config.backend:
            return config
        try:
            check_backend_url(config.backend)
        except ConfigError as exc:
            raise located(exc, self._file) from exc
        logger.warning(
            "gatekeeper: the backend cannot change while running (%r -> %r); "
            "keeping %r until restart",
            mask_url(self.config.backend),
            mask_url(config.backend),
            mask_url(self.config.backend),
        )
        return dataclasses.replace(config, backend=self.config.backend)

    def _swap(self, config: Config) -> None:
        self._check_adaptive(config)
        self.config = config
        # Built here, not on the next request: a helper kept for the old configuration
        # would keep it alive until then (SPEC §3: nothing keeps it alive once swapped).
        self.identifier = Identifier(config)
        # Admissions under the old config keep their own Route; new requests re-resolve.
        self._routes = {}
        self.backend.reconfigure(config)
        if self._waiting:
            # A limit raised (or removed) may have room for them now: no release will say so.
            self._line.wake()

    def _check_adaptive(self, config: Config) -> None:
        """Warn when a backend cannot follow ``concurrency = "auto"`` yet (it enforces
        ``adaptive.max`` instead) rather than pretend."""
        if self.backend.adaptive_limits:
            return
        paths = [path for path, limit in config.limits.items() if limit.adaptive is not None]
        if paths:
            logger.warning(
                'gatekeeper: backend %s does not adapt concurrency = "auto" limits yet; '
                "it enforces their adaptive.max (%s). Use the memory backend for adaptive "
                "limits.",
                config.backend.split("://")[0],
                ", ".join(sorted(paths)),
            )

    def reload(self) -> bool:
        """Check the configuration file now; returns True if a changed, valid file was
        swapped in. An invalid file keeps the current configuration (logged, counted).

        Never raises. A file rewritten in place (same inode) within the last
        ``_SETTLE_SECONDS``, or still open for writing, may be half-written: this call then
        waits that long once (it is not a request's check, which never waits) and swaps it
        in only if it read the same then and no process is writing it; an atomic rename is
        swapped in at once.
        """
        with self._reload_lock:
            if self._reload_file(force=True):
                return True
            if self._pending is None:
                return False
            time.sleep(_SETTLE_SECONDS)
            return self._reload_file(force=True)

    def reload_if_due(self) -> None:
        """Check the configuration file if a check is due (``reload.every_seconds`` have
        passed, or ``every_requests`` requests were handled), as handling a request does:
        for what reads the configuration outside requests (the status endpoint's token).
        Never raises or waits; nothing without a file."""
        if self._file is not None:
            self._reload_if_due(self._clock())

    def _reload_file(self, *, force: bool = False) -> bool:
        """One check of the file: swap it in if it changed, settled, and is valid.
        ``force`` (:meth:`reload`) reads and judges it again even if it did not change:
        what failed it may have been outside it (its mode, a module it names)."""
        self._requests_since_check = 0
        self._next_check = self._clock() + self.config.reload.every_seconds
        if self._file is None:
            return False
        started = time.perf_counter()
        try:
            return self._check_file(force)
        except Exception as exc:
            # A file is an input too (SPEC §4.10): whatever it holds, the request that
            # happened to check it must not fail, and the running configuration stays.
            self.monitor.reload_failed += 1
            self._pending = None
            logger.error(
                "gatekeeper: reload of %s failed, keeping the previous configuration: %s",
                escape_controls(self._file),
                # A ConfigError escapes what it quotes; anything else is escaped here.
                exc
                if isinstance(exc, ConfigError)
                else escape_controls(f"{type(exc).__name__}: {exc}"),
            )
            return False
        finally:
            self.monitor.stages["reload"].record(time.perf_counter() - started)

    def _check_file(self, force: bool) -> bool:
        assert self._file is not None
        try:
            stamp = _stamp(os.stat(self._file))
        except OSError as exc:
            if self._file_stamp is None:
                return False  # still missing: reported once
            self._file_stamp = None
            raise ConfigError(
                "", f"cannot read file: {exc.strerror or exc}", file=self._file
            ) from exc
        # A same-size rewrite within one timestamp tick keeps the stamp: while the file is
        # that fresh, compare its contents too.
        if (
            not force
            and stamp == self._file_stamp
            and self._pending is None
            and time.time() - stamp[0] / 1e9 > _FRESH_FILE
        ):
            return False
        # The stamp kept is the one of what is read (fstat on the opened descriptor),
        # whatever replaced the path since the stat above.
        self._file_stamp = stamp
        seen_inode, self._seen_inode = self._seen_inode, stamp[2]
        if stamp == self._unreadable and not force:
            return False  # still the FIFO, device or oversized file reported before
        try:
            data, status = read_file(self._file)
        except ConfigError:
            if stamp == self._unreadable:
                return False  # forced, and failing as reported: not reported again
            # Its stamp is remembered, so it is reported once, then retried when it changes.
            self._unreadable = stamp
            raise
        self._unreadable = None
        stamp = self._file_stamp = _stamp(status)
        digest = hashlib.blake2b(data).digest()
        # Content judged before (valid or not) is judged again only when forced: what
        # failed it may have been outside it (a module it names deployed since).
        judged = digest == self._file_digest
        if judged and not force:
            self._pending = None
            return False
        if not judged and not self._settled(stamp, digest, seen_inode):
            return False
        self._pending = None
        try:
            config = self._keep_backend(self._build(data))
        except ConfigError:
            if judged:
                return False  # failing as reported: not reported again
            raise
        finally:
            # Valid or not, this content has been judged: not re-read until it changes.
            self._file_digest = digest
        changed = config != self.config
        self._swap(config)
        self._next_check = self._clock() + config.reload.every_seconds
        if changed:
            self.monitor.reloads += 1
            logger.info("gatekeeper: reloaded %s", escape_controls(self._file))
        return changed

    def _settled(self, stamp: Stamp, digest: bytes, seen_inode: int | None) -> bool:
        """Whether changed content may be swapped in, or may still be half-written.

        An inode other than the one the previous check found is a file renamed into
        place (created while that one still existed), complete: the atomic way. Content
        rewritten in place is taken once its modification time is _SETTLE_SECONDS old, or
        once a check that long after the first one read the same stamp and digest - and
        never while a process has the file open for writing (a writer that paused, however
        long: :func:`~gatekeeper_wsgi.fileformats.open_for_writing`, where the system can
        tell). Until then the next check comes due after _SETTLE_SECONDS, and nobody waits.
        """
        if stamp[2] != seen_inode:
            return True
        file = self._file
        assert file is not None
        if not open_for_writing(file, stamp[2]):
            if time.time() - stamp[0] / 1e9 >= _SETTLE_SECONDS:
                return True
            now = time.monotonic()
            pending = self._pending
            if pending is not None and pending[:2] == (stamp, digest):
                if now - pending[2] >= _SETTLE_SECONDS:
                    return True
            else:
                self._pending = (stamp, digest, now)
        elif self._pending is None or self._pending[:2] != (stamp, digest):
            self._pending = (stamp, digest, time.monotonic())
        self._next_check = min(self._next_check, self._clock() + _SETTLE_SECONDS)
        return False

    # --- admission ------------------------------------------------------------------------

    def admit(
        self,
        project: str,
        service: str,
        caller: str,
        environ: Mapping[str, Any] = _EMPTY,
        user: str | None = None,
        started: float | None = None,
    ) -> Admission:
        """Admit a request or raise :class:`Rejected` (after queueing, if configured).

        ``caller`` must already be a valid caller name (see ``CALLER_RE``); ``environ``
        supplies ``REMOTE_ADDR``, ``REMOTE_USER`` and headers for ``key`` kinds other than
        the caller; ``user`` overrides ``REMOTE_USER`` (Django's ``request.user``).
        ``started`` (a ``time.perf_counter()`` reading) is when timing begins: the
        integrations pass the moment they began to name the request, so naming counts as
        resolving.
        """
        perf = time.perf_counter
        if started is None:
            started = perf()
        if _collected:  # responses the garbage collector found unclosed: their slots first
            _release_collected()
        now = started if self._perf_clock else self._clock()
        # The route, the slots on every level and the delay of the request, found here
        # rather than by a helper (a frame less per admission). It is one of the requests
        # that count towards reload.every_requests.
        if self._file is not None:
            self._requests_since_check += 1
            self._reload_if_due(now)
        try:  # a subscript: a hit costs a bytecode, not a method call
            route = self._routes[(project, service)]
        except KeyError:
            route = self._route(project, service)
        if route.caller_candidates:
            slots, caller_delay = route.caller_level(caller, environ, user)
            delay = route.delay if caller_delay is None else caller_delay
        else:
            slots, delay = route.slots, route.delay
        monitor = self.monitor
        # One decision in monitor.SAMPLING is timed (each one while an exporter observes
        # them), every one counted: see Monitor.untimed. 0.0: not timed.
        decisions = monitor.admitted + monitor.refused_decisions
        resolved = perf() if not decisions & monitor.untimed else 0.0
        grant: Grant | None = None
        # Whether this request may have waited in a queue (then `decide` leaves it out).
        queueing = False
        if slots:
            try:
                # Looked up once: the last waiter may leave between two lookups.
                queued = self._queued_slot(slots) if self._waiting else None
                if queued is not None:
                    queueing = True
                    grant = self._wait(
                        slots, queued, now, (project, service, caller, environ, user)
                    )
                    route, slots, delay = self._resolved(route, slots, delay)
                else:
                    recovers = self._recovers
                    incidents = self.backend.incidents if recovers else 0
                    try:
                        result = self._acquire(slots, now)
                    except CapacityError as exc:
                        result = self._untracked(slots, exc, now)
                    except Exception as exc:
                        raise self._failure(exc)  # noqa: B904 - its cause is set
                    if isinstance(result, Denial):
                        queueing = True
                        grant = self._refused(
                            slots, result, now, (project, service, caller, environ, user)
                        )
                        route, slots, delay = self._resolved(route, slots, delay)
                    else:
                        grant = result
                    if recovers and self.backend.incidents != self._incidents:
                        grant = self._incident(grant, incidents, now)
                # A grant for fewer slots than asked left untrackable shadow slots out.
                if grant.shadowed or grant.slots is not slots:
                    self._shadow(slots, grant)
                if not grant.slots:  # nothing held (or a waiter a reload left no limit)
                    grant = None
            except BackendError as exc:
                self._log_backend_error(exc)
                if self.config.on_backend_error == "reject":
                    monitor.decision(started, resolved, perf(), False)
                    rejected = Rejected("GK-BACKEND-UNAVAILABLE", retry_after=1.0)
                    raise self.count_rejection(rejected) from exc
                grant = None  # fail open
            except Rejected:
                waited = self._take_wait() if queueing else 0.0
                monitor.decision(started, resolved, perf(), False, waited)
                raise
        if queueing:
            monitor.decision(started, resolved, perf(), True, self._take_wait())
        elif monitor.observed:
            monitor.decision(started, resolved, perf(), True)
        else:
            # Monitor.decision of a plain admission, without its frame (see Monitor.recent).
            if resolved:
                monitor.recent.append((started, resolved, perf(), 0.0, True))
            monitor.admitted += 1
        admission = Admission()
        admission._keeper = self
        admission._held = [grant]
        admission.route = route
        admission.delay = delay
        return admission

    def query(
        self,
        project: str,
        service: str,
        caller: str,
        environ: Mapping[str, Any] = _EMPTY,
        user: str | None = None,
    ) -> Rejected | None:
        """The :class:`Rejected` that :meth:`admit` would raise right now, or None if it
        would admit. Records nothing: no slot, no rate window entry, no counted rejection.

        It never waits: a full limit with a ``queue`` answers its refusal. Arguments are
        those of :meth:`admit`. A failing backend answers per ``on_backend_error``
        (``GK-BACKEND-UNAVAILABLE`` when "reject", else None)::

            if gk.query("frs", "login", "alice") is not None:
                ...  # alice is restricted now
        """
        _release_collected()
        route = self.route(project, service)
        now = self._clock()
        slots = route.slots
        if route.caller_candidates:
            slots = route.caller_level(caller, environ, user)[0]
        while slots:
            try:
                denial = self.backend.peek(slots, now)
            except CapacityError as exc:
                slot = slots[exc.at]
                if slot.enforce:
                    return self._rejection(slot, self._capacity_denial(slot, exc), counted=False)
                # As admit would: a shadow slot that cannot be tracked is left out.
                slots = slots[: exc.at] + slots[exc.at + 1 :]
                continue
            except BackendError as exc:
                self._log_backend_error(exc)
                if self.config.on_backend_error == "reject":
                    return Rejected("GK-BACKEND-UNAVAILABLE", retry_after=1.0)
                return None
            if denial is None:
                return None
            return self._rejection(*self._longest_wait(slots, denial, now), counted=False)
        return None

    def route(self, project: str, service: str) -> Route:
        """The limits that apply to ``(project, service)`` under the current configuration,
        reloading the configuration file first when a check is due."""
        self.reload_if_due()
        route = self._routes.get((project, service))
        return route if route is not None else self._route(project, service)

    def count_request(self) -> None:
        """A request refused before any admission (``GK-CALLER-MISSING``): it is handled
        too, so it counts towards ``reload.every_requests`` and checks the file when due
        (SPEC §3), or a file that made every request refused would never be replaced."""
        if self._file is not None:
            self._requests_since_check += 1
            self._reload_if_due(self._clock())

    def _reload_if_due(self, now: float) -> None:
        if (
            self._requests_since_check >= self.config.reload.every_requests
            or now >= self._next_check
        ) and self._reload_lock.acquire(blocking=False):
            try:
                self._reload_file()
            finally:
                self._reload_lock.release()

    def _route(self, project: str, service: str) -> Route:
        # Read the cache before the config: _swap sets the config first, then a new cache,
        # so a reload racing with us can never leave a Route of the old config cached.
        routes = self._routes
        config = self.config
        if len(routes) >= _ROUTE_CACHE_SIZE:
            routes = self._routes = {}
        route = routes[(project, service)] = Route(config, project, service)
        return route

    def _failure(self, exc: Exception) -> BackendError:
        """What the backend's unguarded ``acquire`` or ``release`` raised, as its guard
        would have raised it (see ``backends.base.unguarded``)."""
        return exc if isinstance(exc, BackendError) else self.backend.backend_error(exc)

    def _refused(
        self, slots: tuple[Slot, ...], denial: Denial, now: float, request: _Request
    ) -> Grant:
        slot = slots[denial.at]
        queue = slot.limit.queue
        answer, longest = self._longest_wait(slots, denial, now)
        # A request waits in the queue of the limit that refused it, unless a rate window
        # (its own, or another's) refuses it for longer than it may wait there: it would
        # only time out, holding its worker thread and a place in the line meanwhile.
        if queue is not None and (longest.kind != "rate" or longest.retry_after <= queue.wait):
            return self._wait(slots, slot, now, request)
        raise self._rejection(answer, longest)

    def _longest_wait(
        self, slots: tuple[Slot, ...], denial: Denial, now: float
    ) -> tuple[Slot, Denial]:
        """The refusal to answer: ``denial``, or the one of the limits after it full now
        that waits longer. A backend answers with the first slot that does not fit; with
        two windows full (2/10s and 2/minute), a concurrency limit full and a caller's
        window after it, or two concurrency limits held by delays of different lengths,
        the time until the request can be admitted (its Retry-After, SPEC 5) is the
        longest wait, and the limit named is the one it waits for (a concurrency limit
        full of running requests waits for no time it can state: 0). Looked up on this
        path only, by peeks; a backend failing one leaves the refusal found so far."""
        slot = slots[denial.at]
        rest = tuple(
            other
            for other in slots[denial.at + 1 :]
            if other.enforce and (other.limit.rate or other.limit.concurrency is not None)
        )
        if denial.kind == "concurrency" and slot.limit.rate is not None:
            # The limit that refused counts a rate too, which the backends look at after
            # its concurrency: its own window may keep the request out far longer.
            rest = (slot._replace(limit=_rate_only(slot.limit)), *rest)
        while rest:
            try:
                found = self.backend.peek(rest, now)
            except Exception:  # a failure or capacity refusal here changes nothing
                break
            if found is None:
                break
            if found.retry_after > denial.retry_after:
                slot, denial = rest[found.at], found
            rest = rest[found.at + 1 :]
        return slot, denial

    def _resolve_now(self, request: _Request) -> _Resolution:
        """The route, slots and delay of ``request`` (project, service, caller, environ,
        user) under the configuration in force now, as :meth:`admit` resolves them."""
        project, service, caller, environ, user = request
        try:
            route = self._routes[(project, service)]
        except KeyError:
            route = self._route(project, service)
        if route.caller_candidates:
            slots, caller_delay = route.caller_level(caller, environ, user)
            return route, slots, route.delay if caller_delay is None else caller_delay
        return route, route.slots, route.delay

    def _resolved(self, route: Route, slots: tuple[Slot, ...], delay: float) -> _Resolution:
        """What a wait of this thread ended on: the request resolved again when a reload
        swapped the configuration while it waited (see :meth:`_wait`), else as it was."""
        again: _Resolution | None = self._waited.__dict__.pop("again", None)
        return (route, slots, delay) if again is None else again

    def _rejection(self, slot: Slot, denial: Denial, *, counted: bool = True) -> Rejected:
        limit = slot.limit
        if denial.kind == "rate":
            assert limit.rate is not None
            rate = limit.rate
            rejected = Rejected(
                "GK-RATE-LIMIT",
                level=limit.level,
                limit_path=limit.path,
                limit_value=rate.text,
                retry_after=denial.retry_after,
                # Refused by its rate: none remains in the window.
                rate=RateInfo(rate.limit, rate.seconds, 0, denial.retry_after),
            )
        else:
            rejected = Rejected(
                "GK-CONCURRENCY-LIMIT",
                level=limit.level,
                limit_path=limit.path,
                limit_value=self._concurrency_value(slot),
                retry_after=denial.retry_after,
            )
        return self.count_rejection(rejected, slot.key) if counted else rejected

    def _concurrency_value(self, slot: Slot) -> str:
        """A concurrency limit's value in faults: an adaptive one's current limit."""
        limit = slot.limit
        if limit.adaptive is not None:
            return str(self.backend.adaptive_limit(slot.key, limit))
        return str(limit.concurrency)

    def count_rejection(self, rejected: Rejected, key: str | None = None) -> Rejected:
        """Count a rejection decided outside the engine (an integration's missing caller)
        in the counters, as the engine counts its own; returns it, to be raised."""
        self.monitor.count_rejection(rejected.code, rejected.limit_path, key)
        return rejected

    def _shadow(self, slots: tuple[Slot, ...], grant: Grant) -> None:
        """Count and log a request that shadow limits admitted: over their limit
        (``grant.shadowed``) or left out because their keys could not be tracked."""
        over = [grant.slots[index].limit.path for index in grant.shadowed]
        untracked = [slot.limit.path for slot in slots if slot not in grant.slots]
        if not over and not untracked:
            return
        self.monitor.shadow_rejected += 1
        for path in over:
            if admitted := self._throttle(self._shadow_logged, path, _SHADOW_LOG_INTERVAL).due():
                logger.info(
                    "gatekeeper: shadow mode admitted %d request(s) over the limit of %s since"
                    " the last report",
                    admitted,
                    path,
                )

    # --- the product's own capacity -------------------------------------------------------

    def _untracked(
        self,
        slots: tuple[Slot, ...],
        exc: CapacityError,
        now: float,
        acquire: Callable[[Sequence[Slot], float], Grant | Denial] | None = None,
    ) -> Grant | Denial:
        """The answer to a request one of whose slots the backend could not track.

        An enforcing slot refuses the request by its limit (raises :class:`Rejected`): a
        full table never admits uncounted (SPEC §4.5). A shadow slot must not refuse, so
        it is left out and the other slots are acquired again (by ``acquire``: the first
        waiter of a line acquires through it; else ``backend.acquire``); they keep
        counting. A Denial names its slot by its position in ``slots``; a grant may hold no
        slot at all.
        """
        if acquire is None:
            acquire = self.backend.acquire
        kept = list(range(len(slots)))  # positions in ``slots`` still asked for
        asked = slots
        while True:
            slot = asked[exc.at]
            self._log_capacity(slot, exc)
            if slot.enforce:
                self.monitor.capacity_refused += 1
                raise self._rejection(slot, self._capacity_denial(slot, exc))
            del kept[exc.at]
            asked = tuple(slots[position] for position in kept)
            if not asked:
                return Grant(asked)
            try:
                result = acquire(asked, now)
            except CapacityError as again:
                exc = again
                continue
            if isinstance(result, Denial):
                return result._replace(at=kept[result.at])
            return result

    @staticmethod
    def _capacity_denial(slot: Slot, exc: CapacityError) -> Denial:
        """The refusal of a slot that could not be tracked, by its limit's usual code: the
        count that ran out when the backend says, else concurrency when the limit has one."""
        limit = slot.limit
        kind = exc.kind or ("concurrency" if limit.concurrency is not None else "rate")
        if kind == "rate" and limit.rate is None:
            kind = "concurrency"
        elif kind == "concurrency" and limit.concurrency is None:
            kind = "rate"
        return Denial(exc.at, kind, exc.retry_after)

    def _throttle(self, throttles: dict[str, Throttle], path: str, interval: float) -> Throttle:
        """The throttle of limit ``path``'s log lines in ``throttles`` (engine clock)."""
        throttle = throttles.get(path)
        if throttle is None:
            throttle = throttles[path] = Throttle(interval, self._clock)
        return throttle

    def _log_capacity(self, slot: Slot, exc: CapacityError) -> None:
        path = slot.limit.path
        if not self._throttle(self._capacity_logged, path, _CAPACITY_LOG_INTERVAL).due():
            return
        consequence = (
            "requests it cannot track are refused by it"
            if slot.enforce
            else "shadow mode: requests it cannot track are admitted without counting there"
        )
        logger.warning("gatekeeper: limit %r is at capacity: %s; %s", path, exc.what, consequence)

    def _incident(self, grant: Grant, before: int, now: float) -> Grant:
        """Failures the backend recovered from by itself (a damaged shared table
        re-created, a replaced one followed; the backend logged each) since the last
        admission: counted in ``backend_errors`` (SPEC 4.6). One this admission met (the
        backend's count moved while it acquired ``grant``) refuses it under
        ``on_backend_error = "reject"``: its slots in the recovered backend go back, and a
        BackendError takes the way of any failure. Else it stays admitted, counted there
        (one a release or a status read met is only counted)."""
        backend = self.backend
        seen, self._incidents = self._incidents, backend.incidents
        if self.config.on_backend_error != "reject" or backend.incidents == before:
            self.monitor.backend_errors += backend.incidents - seen
            return grant
        self.monitor.backend_errors += backend.incidents - seen - 1  # the raise counts one
        with contextlib.suppress(BackendError):
            backend.release(grant, None, 0.0, now)
        raise BackendError(f"{backend.label} failed and recovered: see the ERROR it logged")

    def _log_backend_error(self, exc: BaseException) -> None:
        self.monitor.backend_errors += 1
        if self._errors_logged.due():
            logger.error(
                "gatekeeper: backend %s failed (%s); on_backend_error=%s",
                mask_url(self.config.backend),
                mask_text(str(exc)),
                self.config.on_backend_error,
            )

    # --- the bounded wait queue -----------------------------------------------------------

    def _queued_slot(self, slots: tuple[Slot, ...]) -> Slot | None:
        """A slot whose limit has waiters: newcomers line up behind them (FIFO)."""
        queues = self._queues
        for slot in slots:
            if slot.limit.queue is not None and queues.get(slot.key):
                return slot
        return None

    def _wait(
        self, slots: tuple[Slot, ...], queued: Slot | None, now: float, request: _Request
    ) -> Grant:
        """Wait in the line of ``queued`` (SPEC §4.4) until first and admitted; raises the
        queue's faults, or the refusal of a limit without a queue.

        A reload that swaps the configuration while the request waits (a limit lowered,
        removed, given no queue) applies to it at once: its slots are resolved again under
        the configuration in force (handed to :meth:`admit` by :meth:`_resolved`), so a
        waiter is never admitted past a limit no longer in force (SPEC §4.1). It keeps its
        place in its line, and the size and wait it joined with."""
        assert queued is not None and queued.limit.queue is not None
        spec = queued.limit.queue
        backend = self.backend
        clock = self._clock
        deadline = now + spec.wait
        line = self._line
        ticket = line.join(queued.key, spec.size)
        if ticket is None:
            raise self._queue_fault("GK-QUEUE-FULL", queued, self._queue_retry(slots, now, spec))

        def take(asked: Sequence[Slot], at: float) -> Grant | Denial:
            # What is left to acquire once a shadow slot could not be tracked: still first.
            result = line.admit(ticket, asked, at)
            return backend.acquire(asked, at) if result is None else result

        with self._cond:
            self._waiting += 1
        entered = time.perf_counter()
        config = self.config
        self._waited.__dict__.pop("again", None)  # left by a wait of this thread that raised
        # When the queued limit's rate refused last: how long it said to wait, and when.
        rate_wait: tuple[float, float] | None = None
        try:
            while True:
                if _collected:  # a response collected unclosed: its slots may be ours
                    _release_collected()
                retry_hint = None
                now = clock()
                if self._file is not None:
                    # A waiter checks the file as a request does: a reload due meanwhile
                    # (no newcomer may come to make it) applies to the waiters at once.
                    self._reload_if_due(now)
                if self.config is not config:
                    config = self.config
                    again = self._waited.again = self._resolve_now(request)
                    slots = again[1]
                    if not slots:  # no limit applies any more: admitted, holding nothing
                        return Grant(slots)
                try:
                    result = line.admit(ticket, slots, now)
                except CapacityError as exc:
                    result = self._untracked(slots, exc, clock(), take)
                if result is not None:
                    if not isinstance(result, Denial):
                        return result
                    refusing = slots[result.at]
                    if refusing.limit.queue is None:
                        raise self._rejection(refusing, result)
                    retry_hint = result.retry_after
                    rate_wait = None
                    if result.kind == "rate" and refusing.key == queued.key:
                        rate_wait = (result.retry_after, now)
                now = clock()
                timeout = deadline - now
                if timeout <= 0:
                    if rate_wait is not None:  # the next admission's time is known exactly
                        wait, seen = rate_wait
                        rate_left = max(0.0, wait - (now - seen))
                        raise self._queue_fault("GK-QUEUE-TIMEOUT", queued, rate_left, rated=True)
                    raise self._queue_fault(
                        "GK-QUEUE-TIMEOUT", queued, self._queue_retry(slots, now, spec)
                    )
                # Maturing delays free slots without any release to wake us: wake then.
                due = backend.next_due()
                if due is not None:
                    timeout = min(timeout, max(due - now, 0.0005))
                if retry_hint:
                    timeout = min(timeout, retry_hint)
                if self._file is not None:  # awake when the file is due to be checked
                    timeout = min(timeout, max(self._next_check - now, 0.001))
                line.sleep(ticket, timeout)
        finally:
            line.leave(ticket)
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
            # Its own stage, and taken out of `decide` by admit: a decision's time is
            # the backend's answer, not the seconds spent waiting for a slot.
            waited = time.perf_counter() - entered
            self.monitor.stages["queue_wait"].record(waited)
            self._waited.seconds = waited

    def _queue_retry(self, slots: tuple[Slot, ...], now: float, spec: QueueSpec) -> float:
        """The Retry-After of a queue fault: the queue's wait, or the longest wait the
        request's limits state when that is longer (slots held by delayed releases, a
        window full for a while), as a refusal without a queue would say it. Looked at
        by a peek (records nothing); a backend failing it leaves the queue's wait."""
        try:
            denial = self.backend.peek(slots, now)
        except Exception:
            return spec.wait
        if denial is None:  # a slot is free, for the waiters ahead
            return spec.wait
        return max(spec.wait, self._longest_wait(slots, denial, now)[1].retry_after)

    def _take_wait(self) -> float:
        """Seconds this thread's last queue wait took (0 if none since the last call)."""
        waited: float = getattr(self._waited, "seconds", 0.0)
        self._waited.seconds = 0.0
        return waited

    def _queue_fault(self, code: str, slot: Slot, wait: float, *, rated: bool = False) -> Rejected:
        """A fault of ``slot``'s queue; ``rated``: its rate refused the request last and
        ``wait`` is the time until its window admits again, which the fault says as a rate
        refusal says it (Retry-After and the RateLimit fields, SPEC 5)."""
        limit = slot.limit
        value = self._concurrency_value(slot) if limit.concurrency is not None else None
        if value is None and limit.rate is not None:
            value = limit.rate.text
        rate = limit.rate
        info = RateInfo(rate.limit, rate.seconds, 0, wait) if rated and rate is not None else None
        return self.count_rejection(
            Rejected(
                code,
                level=limit.level,
                limit_path=limit.path,
                limit_value=value,
                retry_after=wait,
                rate=info,
            ),
            slot.key,
        )

    # --- release --------------------------------------------------------------------------

    def _settle(self, grant: Grant | None, status: int | None, faulty: bool, delay: float) -> None:
        """The work of :meth:`Admission.release`, once it has won the grant: feed an
        adaptive limit its sample, give the slots back (after ``delay``), wake waiters, and
        time it as the ``response`` stage (``service_error`` when faulty; a plain release
        is timed once in ``SAMPLING``, see :mod:`~gatekeeper_wsgi.monitor`)."""
        started = time.perf_counter()
        stage = self._error_stage if faulty else self._response_stage
        timed = delay > 0 or not stage.count & stage.untimed
        if grant is not None:
            try:
                now = started if self._perf_clock else self._clock()
                try:
                    if grant.adaptive:
                        self.backend.observe(grant, faulty, now)
                finally:
                    # Whatever a sample does, the slots come back.
                    self._release(grant, status, delay, now)
            except Exception as exc:
                # The backend's own expiry (lease) gives these slots back; never fail a
                # response.
                self._log_backend_error(self._failure(exc))
            if self._waiting:
                self._line.wake()
        if not timed:
            stage.count += 1
            return
        elapsed = time.perf_counter() - started
        if delay > 0:
            self.monitor.stages["delay_place"].record(elapsed)
        stage.record(elapsed)

    # --- observation ----------------------------------------------------------------------

    def inflight(self) -> dict[str, int]:
        """Requests in flight per concrete limit path, due delayed releases applied.

        Raises :class:`BackendError` when the backend cannot be read (Redis unreachable, a
        shared file replaced by something else): a count that cannot be read is no zero.
        (``stats()`` reports such an outage in its counters instead, and the status page
        says so.)"""
        _release_collected()
        return self.backend.inflight(self._clock())

    def delayed_pending(self) -> int:
        """Delayed releases not matured yet (``stats()``'s ``delayed_pending``, alone);
        raises :class:`BackendError` as :meth:`inflight` does."""
        _release_collected()
        return self.backend.delayed_pending(self._clock())

    def totals(self, *, top: int = TOP_KEYS) -> dict[str, LimitTotals] | None:
        """Per counting limit of the configuration: in flight summed over its keys, keys
        tracked and in flight, and details of its busiest and lately refused keys; None
        when the backend does not keep totals (see :meth:`Backend.totals`)."""
        _release_collected()
        limits = [limit for limit in self.config.limits.values() if counts(limit)]
        watch = self.monitor.refused_keys()
        return self.backend.totals(limits, self._clock(), top=top, watch=watch)

    def stats(self, *, adaptive_keys: Collection[str] | None = None) -> Stats:
        """Counters, stage timings and adaptive limits (SPEC §7, §4.9). Always the dict:
        while the backend fails (its failures are counted in ``backend_errors``), the
        figures it holds are the ones last read. ``adaptive_keys`` reports the adaptive
        limits of those concrete paths only (a status page's: not one report per key a
        wildcard limit tracks)."""
        _release_collected()
        backend = self.backend
        try:
            self._last_read = (
                backend.delayed_pending(self._clock()),
                backend.adaptive(adaptive_keys),
            )
        except BackendError as exc:
            logger.debug("gatekeeper: stats() read the backend's last figures: %s", exc)
        delayed, reported = self._last_read
        snapshot = self.monitor.snapshot(delayed)
        adaptive = _adaptive_in_force(
            self.config, reported, adaptive_keys, backend.adaptive_reports
        )
        return Stats(counters=snapshot["counters"], stages=snapshot["stages"], adaptive=adaptive)

    def close(self) -> None:
        """Release backend resources (after the releases still waiting)."""
        if self._retire is not None:
            self._retire.detach()
        _release_collected()
        self.backend.close()


@functools.lru_cache(maxsize=1024)
def _rate_only(limit: Limit) -> Limit:
    """``limit`` without its concurrency: its rate window alone, for a peek (see
    GateKeeper._longest_wait). Cached by the limit (compared by identity), so a backend's
    memos of routes see one such limit, not one per refusal."""
    return dataclasses.replace(limit, concurrency=None, adaptive=None)


def _adaptive_in_force(
    config: Config,
    reported: Mapping[str, AdaptiveReport],
    keys: Collection[str] | None,
    read: Callable[[Mapping[str, Limit]], dict[str, AdaptiveReport]],
) -> dict[str, AdaptiveReport]:
    """``stats()["adaptive"]``: what the backend reports of the paths an adaptive limit of
    ``config`` governs (one that a reload made fixed is no longer adaptive, though the
    backend still holds its controller for a while), each within its bounds in force.
    ``keys``: of those concrete paths only.

    A path it does not report (an adaptive limit without ``*`` this process has not
    admitted on yet, a key of one ``keys`` names that a backend's bounded memo forgot: on
    Redis, the limit other hosts moved) is ``read`` (:meth:`Backend.adaptive_reports`):
    its limit in force, the value of its faults (``initial`` until one was learned)."""
    index = config.limit_index

    def within(report: AdaptiveReport, limit: Limit) -> AdaptiveReport:
        # A reload that narrowed the bounds is enforced at once, while a controller
        # learned under the old ones moves on its next sample.
        assert limit.adaptive is not None
        value = min(max(report["limit"], limit.adaptive.min), limit.adaptive.max)
        return report if value == report["limit"] else {**report, "limit": value}

    adaptive: dict[str, AdaptiveReport] = {}
    for key, report in reported.items():
        limit = counting_limit(index, key)
        if limit is not None and limit.adaptive is not None:
            adaptive[key] = within(report, limit)
    unreported: dict[str, Limit] = {
        limit.path: limit
        for limit in config.limits.values()
        if limit.adaptive is not None
        and not limit.wildcard
        and limit.path not in adaptive
        and (keys is None or limit.path in keys)
    }
    for key in keys or ():
        limit = counting_limit(index, key)
        if limit is not None and limit.adaptive is not None and key not in adaptive:
            unreported[key] = limit
    if unreported:
        for path, report in read(unreported).items():
            adaptive[path] = within(report, unreported[path])
    return adaptive


#: what :meth:`GateKeeper.admit` resolves a request's slots from: (project, service,
#: caller, environ, user)
_Request = tuple[str, str, str, Mapping[str, Any], "str | None"]
#: a request's route, slots and delay under one configuration
_Resolution = tuple[Route, tuple[Slot, ...], float]


class _Place:
    """A waiter's place in the process's line of one limit path."""

    __slots__ = ("key", "queue", "seen")

    def __init__(self, key: str, queue: deque[_Place], seen: int) -> None:
        self.key = key
        self.queue = queue
        #: the line's wake-ups counted when the waiter last looked (``GateKeeper._wakes``)
        self.seen = seen


class _LocalLine(WaitingLine[_Place]):
    """The line of a process: a deque per concrete limit path and the engine's condition,
    which releases notify. With a backend shared by other processes (Redis) a slot freed
    there notifies nobody here: a waiter looks again every ``backend.poll_interval``."""

    __slots__ = ("_keeper", "_poll")

    def __init__(self, keeper: GateKeeper) -> None:
        self._keeper = keeper
        backend = keeper.backend
        self._poll = None if backend.local else backend.poll_interval

    def join(self, key: str, size: int) -> _Place | None:
        keeper = self._keeper
        with keeper._cond:
            queue = keeper._queues.setdefault(key, deque())
            if len(queue) >= size:
                return None
            place = _Place(key, queue, keeper._wakes)
            queue.append(place)
            return place

    def admit(self, ticket: _Place, slots: Sequence[Slot], now: float) -> Grant | Denial | None:
        keeper = self._keeper
        with keeper._cond:
            ticket.seen = keeper._wakes
            if ticket.queue[0] is not ticket:
                return None
            return keeper.backend.acquire(slots, now)

    def sleep(self, ticket: _Place, timeout: float) -> None:
        keeper = self._keeper
        if self._poll is not None:
            timeout = min(timeout, self._poll)
        with keeper._cond:
            # Not with releases waiting to be made: a nudge may have found the lock held.
            if ticket.seen == keeper._wakes and not _collected:
                keeper._cond.wait(timeout)

    def leave(self, ticket: _Place) -> None:
        keeper = self._keeper
        with keeper._cond:
            queue = ticket.queue
            if ticket in queue:
                queue.remove(ticket)
                if not queue and keeper._queues.get(ticket.key) is queue:
                    del keeper._queues[ticket.key]
            self.wake_locked()

    def wake(self) -> None:
        with self._keeper._cond:
            self.wake_locked()

    def wake_locked(self) -> None:
        keeper = self._keeper
        keeper._wakes += 1
        keeper._cond.notify_all()

    def nudge(self) -> None:
        cond = self._keeper._cond
        # A few tries: a waiter holds the lock only between its look and its wait (which
        # looks at _collected too); a thread that holds it and waits for a backend lock
        # this thread holds would never let go.
        for _ in range(_NUDGE_TRIES):
            if cond.acquire(blocking=False):
                try:
                    self.wake_locked()
                finally:
                    cond.release()
                return
            time.sleep(0)
