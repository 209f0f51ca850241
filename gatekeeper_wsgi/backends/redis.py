"""The Redis backend: exact limits shared by every host that talks to one Redis.

Keys (``<prefix>`` from ``?prefix=``, default ``gatekeeper``; ``<project>`` is the first
segment of the concrete path, so every key of one request shares one hash tag and one
Redis Cluster slot)::

    <prefix>:{<project>}:z:<path>    the path's leases, delayed releases and rate window
                                     (and, in a route's first path, give-back tombstones)
    <prefix>:{<project>}:t:<limit>   the totals of a configured wildcard limit: its paths'
                                     leases and which of its paths have a live rate window
                                     (a limit without one has only its own path: its set
                                     serves)
    <prefix>:{<project>}:d:<limit>   the delayed releases of a wildcard limit's paths, for
                                     its totals (it lives as long as its latest one)
    <prefix>:{<project>}:a:<path>    an adaptive limit's value in force, its controller's
                                     state and the window of samples being gathered

Admission is one ``EVALSHA`` of ``lua/gate.lua`` for all slots of a request, carrying the
releases the process placed since (a release sender thread sends the others): it drops
expired entries, checks every slot and takes all or none, keeping the totals sets in the
same call. Status reads and scrapes read the totals sets (:meth:`RedisBackend.totals`),
O(limits + requests in flight), not the keys. An adaptive limit is one for all hosts: the
script enforces the value its hash holds, releases add their samples, and the process whose
release finds a window due computes the next value with :class:`~gatekeeper_wsgi.adaptive.
Controller` and writes it back in a later call. All time is Redis ``TIME``, so host clocks
do not matter (nor an injected engine clock); only latencies are measured on the host.
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import heapq
import itertools
import logging
import math
import os
import re
import socket
import struct
import sys
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from importlib import resources
from operator import itemgetter
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.maint_notifications import MaintNotificationsConfig
from redis.retry import Retry

from gatekeeper_wsgi.adaptive import SAMPLE_CEILING, AdaptiveReport, AdaptiveSpec, Controller
from gatekeeper_wsgi.backends.base import (
    NO_WATCH,
    TOP_KEYS,
    Backend,
    Census,
    Denial,
    Grant,
    KeyUsage,
    LimitTotals,
    Slot,
    WaitingLine,
    busiest,
)
from gatekeeper_wsgi.config import Config, Limit
from gatekeeper_wsgi.errors import BackendError, CapacityError, ConfigError, LimitKind
from gatekeeper_wsgi.forks import ForkWatch
from gatekeeper_wsgi.redact import Throttle, mask_text, mask_url

__all__ = ["RedisBackend", "check_report"]

logger = logging.getLogger("gatekeeper")

DEFAULT_PREFIX = "gatekeeper"
DEFAULT_MAX_HOLD = 300.0
#: A request waits at most this long for a Redis that does not answer.
DEFAULT_CONNECT_TIMEOUT = 0.25
DEFAULT_READ_TIMEOUT = 0.5
#: After a failure every call fails fast for this long; then one probe goes through.
DEFAULT_BREAKER_COOLDOWN = 1.0
#: The release sender gathers releases this long before it sends them (those an admission
#: of the process takes along first never wait for it). The bound itself: a busy sender
#: looks once per interval, and each look takes the GIL from the request threads (at 1 ms
#: gunicorn gthread workers spent more CPU per request: benchmarks/RESULTS.md).
DEFAULT_FLUSH_INTERVAL = 0.005
#: A release must not wait longer than this to be sent.
MAX_FLUSH_INTERVAL = 0.005
#: A request thread looks for its admission's answer this long, awake, before it sleeps
#: on the socket (see _await_answer)...
DEFAULT_SPIN = 0.0002
#: ... and never longer than this.
MAX_SPIN = 0.01
# A look at the socket: is anything there? (Nothing is taken; never blocks.)
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT
#: After this many looks in a row ran out before the answer came (a Redis on another
#: host), the connection's thread sleeps on its next _SLEEPS_AFTER_LATE answers, then
#: looks once more (another late one: it sleeps again). Not after one: on a machine busy
#: to its last CPU, Redis answers late too, and looking there costs nothing (the CPU goes
#: to whoever wants it); gunicorn on 2 CPUs lost the looks' gain with a single late one.
_LATE_STREAK = 8
_SLEEPS_AFTER_LATE = 63
#: After a concurrency refusal, releases are sent at once (not left waiting) this long.
_CONTENDED_FOR = 1.0
#: A release sender with nothing to send for this long ends (a new one starts on demand).
_SENDER_IDLE = 10.0
#: A sender whose releases the admissions took along keeps looking, once per flush
#: interval, for this long before it waits to be woken again (see _Outbox._run)...
_LINGER = 0.005
#: ... with an interval of at least this: one shorter would look more often than the
#: responses it spares a wake-up arrive.
_LINGER_FROM = 0.001
#: Releases waiting to be sent (or sent again, after an outage); past this the oldest are
#: dropped and end by lease expiry.
_PENDING_RELEASES = 10_000
# A dropped release (see RedisBackend._apply_alone) is named in a WARNING at most this often.
_DROPPED_LOG_INTERVAL = 10.0
#: seconds between two ERRORs of the breaker opening (and WARNINGs of it closing)
_BREAKER_LOG_INTERVAL = 10.0
_KEY_CACHE_SIZE = 10_000
#: Tombstones and marks score above this (lua/gate.lua): counts read below it.
_BELOW_BAND = "(4503599627370496"
#: The longest max_hold (a year): every score stays an exact integer (below 2^53).
_MAX_HOLD = 365 * 86400.0
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_KINDS: dict[int, LimitKind] = {1: "concurrency", 2: "rate"}

# Where the window being gathered sits in Controller.STATE: the script keeps these four
# as fields of its own (samples add to them), the rest as the state string.
_WINDOW = tuple(Controller.STATE.index(name) for name in ("_count", "_total", "_drops", "_peak"))
_DUE = Controller.STATE.index("_due")
#: Infinities in a state are written as this (the script reads ``due`` as a Lua number).
_HUGE = 1e300
#: gate.lua's answer for an admission that took the last slot of a concurrency limit
_TIGHT = 4
#: releases written on a connection whose answers wait to be read before it is looked at
_POSTED_UNREAD = 32
#: seconds after which a written release whose answer no thread has read is sent again
_POSTED_STALE = 1.0
#: An adaptive limit seen this recently (seconds) is reported without asking Redis again.
_FRESH = 0.5


def _kernel_timed(sock: socket.socket, timeout: float | None) -> socket.socket:
    """``sock`` made blocking, its read and write timeouts kept by the kernel.

    With a Python timeout, CPython polls the socket before every send and receive: two
    system calls more per round trip, which on loopback cost a request ~8 µs (a tenth of
    its round trip; benchmarks/redis_backend.py). The kernel's SO_RCVTIMEO / SO_SNDTIMEO
    bound the same waits in the call itself; a wait that runs out fails with EAGAIN, which
    :meth:`RedisBackend._exchange` reports as the timeout it is. (A signal handled during a
    wait starts it over: the servers' workers this runs in do not take signals per request.)
    """
    if timeout:  # None or 0: redis-py's blocking or non-blocking modes, left as they are
        micros = max(1, round(timeout * 1_000_000))
        value = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        sock.settimeout(None)
    return sock


class _KernelTimed:
    """What the request threads' connections add to redis-py's: timeouts the kernel
    keeps (see :func:`_kernel_timed`), and a socket :func:`_await_answer` may look at."""

    socket_timeout: float | None
    gatekeeper_socket: socket.socket | None = None
    #: answers its thread sleeps on before it looks again (see _look)
    gatekeeper_sleeps = 0
    #: its looks in a row that ran out before the answer came
    gatekeeper_late = 0

    def _connect(self) -> socket.socket:
        sock = _kernel_timed(super()._connect(), self.socket_timeout)  # type: ignore[misc]
        self.gatekeeper_socket = sock
        return sock


class _TCPConnection(_KernelTimed, redis.Connection):
    pass


class _UnixConnection(_KernelTimed, redis.UnixDomainSocketConnection):
    pass


def _await_answer(sock: socket.socket, spin: float) -> bool:
    """Return once ``sock`` has something to read (True), or after ``spin`` seconds
    (False), whichever comes first; awake all the while, giving the CPU to any other
    thread or process that wants it (``sched_yield``) between looks.

    A thread that sleeps on a socket leaves its CPU idle, and a virtual machine's idle CPU
    halts: waking it for the answer costs far more than the answer itself. Here, with the
    guest's halt-polling off, a round trip to Redis took 92 µs when the script ran 10 µs
    and Redis sat on the other CPU, against 33 µs for a thread that kept looking
    (benchmarks/RESULTS.md). Looking costs CPU only while nothing else wants it; a
    Redis that answers later than ``spin`` (another host, a slow script) is slept on as
    before. Whatever the look meets (a closed socket, an error) is left to the read that
    follows, which reports it.
    """
    clock = time.perf_counter
    deadline = clock() + spin
    while True:
        try:
            sock.recv(1, _PEEK)
        except BlockingIOError:
            if clock() >= deadline:
                return False
            os.sched_yield()
        except OSError:
            return True
        else:
            return True


def _look(connection: Any, spin: float) -> None:
    """Look for the answer of the command just sent on ``connection`` for up to ``spin``
    seconds (:func:`_await_answer`), keeping count of the looks that ran out: after
    ``_LATE_STREAK`` in a row, sleep on the next ``_SLEEPS_AFTER_LATE`` answers first.
    Not on a TLS connection (it has no ``gatekeeper_socket``), nor on a socket a Python
    timeout came back to: redis-py's own parser (without hiredis) sets one in
    ``can_read``, and CPython would wait up to that timeout in each look."""
    sock = getattr(connection, "gatekeeper_socket", None)
    if sock is None or sock.gettimeout() is not None:
        return
    sleeps = connection.gatekeeper_sleeps
    if sleeps:
        connection.gatekeeper_sleeps = sleeps - 1
    elif _await_answer(sock, spin):
        connection.gatekeeper_late = 0
    else:
        late = connection.gatekeeper_late + 1
        if late >= _LATE_STREAK:
            late = _LATE_STREAK - 1  # one more late look: sleeps again
            connection.gatekeeper_sleeps = _SLEEPS_AFTER_LATE
        connection.gatekeeper_late = late


#: the connection classes of the request threads' own connections, by the pool's class:
#: on Linux, where struct timeval is two longs; TLS connections keep Python's timeouts.
_KERNEL_TIMED: dict[type[Any], type[Any]] = (
    {redis.Connection: _TCPConnection, redis.UnixDomainSocketConnection: _UnixConnection}
    if sys.platform == "linux"
    else {}
)


def _load_script(name: str) -> str:
    return (resources.files("gatekeeper_wsgi.backends") / "lua" / name).read_text("utf-8")


# Lease ids: a random token per process (renewed in forked children, so workers forked
# from one master never share it) plus a counter.
_token = os.urandom(8).hex()
#: Counts forks in this process's ancestry: a connection or sender thread made under an
#: older generation belongs to the parent.
_generation = 0
# Every Redis backend of this process, for the fork hook below.
_BACKENDS: weakref.WeakSet[RedisBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _token, _generation
    _token = os.urandom(8).hex()
    _generation += 1
    for backend in list(_BACKENDS):
        backend._after_fork()


#: renews the token and connections in a forked child, also one forked without Python's
#: fork hooks (uWSGI's default mode): checked by every admission, which uses the token
_FORKS = ForkWatch(_after_fork_in_child)


#: the process whose exit flush ran (it is registered twice: atexit and multiprocessing)
_exit_flushed_pid = 0


def _flush_at_exit() -> None:
    # A worker that exits (a graceful restart) may have releases waiting from its last
    # responses: send them, or their slots would stay held until max_hold. Once per
    # process, and one try per backend even while its breaker is open (a closed backend
    # tried at its close and left this set).
    global _exit_flushed_pid
    if _exit_flushed_pid == os.getpid():
        return
    _exit_flushed_pid = os.getpid()
    for backend in list(_BACKENDS):
        outbox = backend._outbox
        if len(outbox):
            backend._breaker.probe_now()
            with contextlib.suppress(BackendError):
                outbox.flush()


atexit.register(_flush_at_exit)
#: the process in which _flush_at_exit is registered with multiprocessing too
_exit_flush_pid = 0


def _flush_at_multiprocessing_exit() -> None:
    """Run :func:`_flush_at_exit` also when this process is a multiprocessing child: one
    started by fork or forkserver ends with ``os._exit``, which skips ``atexit``, after
    running the finalizers registered in it. Called as the process's release sender
    starts (its first release)."""
    global _exit_flush_pid
    pid = os.getpid()
    if _exit_flush_pid != pid:
        _exit_flush_pid = pid
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=100)


_sequence = itertools.count()


def _bulk(data: bytes) -> bytes:
    """``data`` as a RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(data), data)


class _Input(NamedTuple):
    """What gate.lua needs about the slots of one route, packed once (redis-py would encode
    every argument anew on every call, which costs more than the round trip)."""

    #: per slot: its path's sorted set, then a wildcard limit's totals, delayed and tracked
    #: sets, and an adaptive slot's hash (see gate.lua)
    keys: list[str]
    key_bulks: list[bytes]  #: the same, packed
    spec_words: list[str]  #: every slot's spec (see gate.lua)
    specs: list[bytes]  #: the same, packed
    #: every slot's release code, in words (window in ms * 4, + 2 for a wildcard limit)
    codes: str
    #: (slot index, statuses that confirm it) of the rate reservations a release decides
    reserved: list[tuple[int, frozenset[int]]]
    #: those codes as numbers, for a release that gives reservations back (+ 1)
    code_values: list[int]
    #: indexes of the adaptive slots (a fourth key: their hash)
    adaptive: frozenset[int] = frozenset()


def _codes(input: _Input, returned: Collection[int] = (), sample: str = "") -> str:
    """The release codes of ``input``'s slots in words (see gate.lua): reservations
    ``returned``, and the request's ``sample`` ("<latency us>:<faulty>") on adaptive ones."""
    words = []
    for index, value in enumerate(input.code_values):
        word = str(value + (index in returned))
        if index in input.adaptive:
            word = f"{word}:{sample}"
        words.append(word)
    return " ".join(words)


def _given_back(input: _Input) -> str:
    """The release codes of an admission whose request never ran (its answer was lost, or
    it was refused after all): every rate slot gives its window entry back too."""
    return _codes(input, [index for index, value in enumerate(input.code_values) if value >= 4])


def _restored(
    spec: AdaptiveSpec, path: str, text: str, window: Sequence[bytes] = ()
) -> Controller | None:
    """The controller a hash's state string (and the ``window`` kept beside it, as in a
    claim) describes; None when there is none or it does not parse."""
    if not text:
        return None
    try:
        state = [float(word) for word in text.split()]
        if window:
            for index, value in zip(_WINDOW, window, strict=True):
                state[index] = float(value)
        return Controller.restore(spec, tuple(state), key=path)
    except (ValueError, IndexError):
        return None


def _number(value: float) -> str:
    """A state number in words that reads back the same (infinities as +-_HUGE)."""
    if math.isinf(value):
        value = math.copysign(_HUGE, value)
    return repr(value)


class _RedisGrant(Grant):
    __slots__ = ("input", "lease", "reserved", "sample", "started", "tight")

    def __init__(
        self,
        slots: Sequence[Slot],
        shadowed: tuple[int, ...],
        lease: str,
        input: _Input,
        reserved: list[tuple[int, frozenset[int]]],
    ) -> None:
        super().__init__(slots, shadowed)
        self.lease = lease
        self.input = input
        #: the reservations actually taken (a full shadow window takes none)
        self.reserved = reserved
        if input.adaptive:
            self.adaptive = True
            self.started = time.monotonic()
        #: "<latency us>:<faulty>" once observed (adaptive slots only)
        self.sample = ""
        #: it took the last slot of a concurrency limit: released at once (see release)
        self.tight = False


class _Release(NamedTuple):
    """A release placed and not yet seen applied by Redis."""

    lease: str
    input: _Input
    codes: str  #: release codes of the keys, in words
    delay: float  #: seconds, counted from ``placed``
    placed: float  #: time.monotonic() when the response ended
    #: a give-back of an admission whose answer never came: µs its tombstone lives (0: none)
    tombstone: int = 0
    #: not a release: a claimed adaptive state to write (``codes`` is its whole spec)
    write: bool = False
    #: a copy sent along while the sender's call with it is out: gate.lua applies it only
    #: if that call has not (one look, not a removal per key)
    again: bool = False

    def spec(self, now: float) -> str:
        """This release's spec for gate.lua. The delay is what is left of it ``now``, so a
        release sent late (a replay after an outage) frees its slots when they were due."""
        if self.write:
            return self.codes
        if self.tombstone:
            return f"!{self.lease} {self.tombstone} {self.codes}"
        delay = self.delay
        if delay > 0:
            delay = max(0.0, delay - (now - self.placed))
        mark = "?" if self.again else ""
        return f"{mark}{self.lease} {round(delay * 1_000_000)} {self.codes}"


class _ClusterOnDemand:
    """A Redis Cluster client made at its first use when the Cluster did not answer at
    start. ``RedisCluster`` asks a node for the slot map as it is built: a worker starting
    during an outage (a restart after max_requests, a deploy, an OOM respawn) must come up
    and answer by ``on_backend_error``, as on a plain Redis, which connects lazily - not
    fail to boot (SPEC 4.6). Until a node answers, every use raises redis's
    ``ConnectionError``, which the backend takes as an outage (the breaker spares the
    requests the wait); then it is the client."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self._url = url
        self._options = options
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def _made(self) -> RedisCluster:
        client = self._client
        if client is None:
            with self._lock:
                client = self._client
                if client is None:
                    try:
                        client = self._client = RedisCluster.from_url(self._url, **self._options)
                    except redis.exceptions.RedisClusterException as exc:
                        raise redis.exceptions.ConnectionError(str(exc)) from exc
        return client

    def __getattr__(self, name: str) -> Any:
        if name == "connection_pool":  # a Cluster has none: Script asks for its encoder
            raise AttributeError(name)
        return getattr(self._made(), name)

    def register_script(self, script: str) -> Script:
        return Script(self, script)  # type: ignore[arg-type]

    def get_encoder(self) -> Any:
        # Scripts are ASCII: their SHA is the same whatever the URL's encoding.
        from redis._parsers.encoders import Encoder  # what Script asks a client for

        return Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


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
        # A Redis that stalls now and then (slow commands, fork pauses) opens and closes
        # the breaker every few seconds: its ERROR (and the WARNING that it is back) at
        # most every _BREAKER_LOG_INTERVAL, with how often it opened meanwhile, as the
        # engine's own outage ERROR (one per worker, many workers: a page per second).
        self._opened = Throttle(_BREAKER_LOG_INTERVAL)
        self._closed = Throttle(_BREAKER_LOG_INTERVAL)

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
                    if self._closed.due():
                        logger.warning("gatekeeper: redis at %s is back", self._location)

    def abandon(self) -> None:
        """The call was interrupted (not a Redis failure): let another caller probe."""
        self._probing = False

    def after_fork(self) -> None:
        """In a forked child: a lock another thread of the parent held is held for good."""
        self._lock = threading.Lock()
        self._probing = False

    def probe_now(self) -> None:
        """Let the next call probe at once, whatever is left of the cooldown: the last
        sends of a closing backend or an exiting process cannot wait it out, and Redis
        may well be back (a hiccup opened it a moment ago)."""
        with self._lock:
            if self._open_until:
                self._open_until = time.monotonic()
                self._probing = False

    @property
    def open(self) -> bool:
        """Failing fast, or probing (a look that is not a call, and not a probe)."""
        return bool(self._open_until)

    def failure(self, exc: BaseException) -> None:
        with self._lock:
            was_closed = not self._open_until
            self._open_until = time.monotonic() + self.cooldown
            self._probing = False
            self._last_error = str(exc) or type(exc).__name__
        if was_closed and (opened := self._opened.due()):
            logger.error(
                "gatekeeper: redis at %s failed (%s); failing fast for %.2g s, then probing"
                " (%d failures since the last report)",
                self._location,
                self._last_error,
                self.cooldown,
                opened,
            )


def _wrong_type(exc: BaseException | None) -> bool:
    """Whether Redis refused a call for a key that holds another type than the script
    reads (WRONGTYPE): someone else's key under the prefix, not an outage."""
    return isinstance(exc, redis.exceptions.ResponseError) and "WRONGTYPE" in str(exc)


def _denial(result: list[Any]) -> Denial:
    """The Denial of a refusing gate.lua answer {0, slot, kind, retry after in us}; a
    {3, slot, kind, retry after in us, max_keys} answer (a new key of a wildcard limit whose
    tracked keys are all busy) raises CapacityError for that slot instead."""
    if result[0] == 3:
        raise CapacityError(
            int(result[1]),
            f"it tracks max_keys={int(result[4])} keys and none is idle (each has a request "
            "in flight or an entry in its rate window); raise max_keys",
            retry_after=max(1, int(result[3])) / 1e6,
            kind=_KINDS[int(result[2])],
        )
    return Denial(int(result[1]), _KINDS[int(result[2])], max(0, int(result[3])) / 1e6)


class _Outbox:
    """The releases of one backend in one process that Redis has not yet confirmed, and the
    thread that sends them.

    :meth:`put` costs the responding thread an append and a wake-up, no I/O. The sender
    thread sends what has waited ``flush_interval`` in one script call (one round trip,
    however many releases piled up), keeps what failed and tries again once the breaker
    lets it. An admission takes what is waiting along in its own script call
    (:meth:`take`), and the sender's batch while its call is out, so a process's releases
    are always applied before its next decision. A release is idempotent, so one sent
    twice (by the sender and alongside an admission) does nothing the second time; the
    copy is marked, so gate.lua finds that out with one look.

    The thread is started on the first release in each process (a thread does not survive
    ``fork``: gunicorn ``--preload`` forks workers from a master that may have used the
    backend).
    """

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        self._waiting: deque[_Release] = deque(maxlen=_PENDING_RELEASES)
        #: the batch the sender has out right now (an admission sends it again: idempotent)
        self._sending: list[_Release] = []
        # Taking the waiting releases and marking them as out is one step, so an admission
        # never misses a release that is between the two.
        self._lock = threading.Lock()
        self._wake = threading.Event()
        #: the sender was woken and will drain; later releases need not wake it again
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._generation = -1
        #: batches written by RedisBackend._post whose answers no thread has read yet:
        #: id -> (batch, when written); sent again by the sender once stale (their
        #: connection may have broken, and its thread may not call again for long)
        self._posted: dict[int, tuple[list[_Release], float]] = {}

    def __len__(self) -> int:
        posted = sum(len(batch) for batch, _ in list(self._posted.values()))
        return len(self._waiting) + len(self._sending) + posted

    def after_fork(self) -> None:
        """In a forked child: the parent sends what was waiting; locks may be held."""
        self._waiting = deque(maxlen=_PENDING_RELEASES)
        self._sending = []
        self._posted = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._armed = False
        self._thread = None

    def posted(self, batch: list[_Release]) -> None:
        """``batch`` was written to Redis and its answer is yet to be read: watched until
        :meth:`confirmed`, and sent again by the sender if that takes ``_POSTED_STALE``."""
        self._posted[id(batch)] = (batch, time.monotonic())
        if not self._armed:
            self._arm()

    def confirmed(self, batch: list[_Release]) -> None:
        """``batch``'s answer was read (or it was put back to be sent again)."""
        self._posted.pop(id(batch), None)

    def _stale(self, now: float) -> None:
        """Posted batches unanswered for ``_POSTED_STALE``: first in line to be sent again
        (with ``_lock`` held; a release applied twice does nothing the second time)."""
        posted = self._posted
        for key, (batch, written) in list(posted.items()):
            # pop, not del: its thread may read its answer (confirmed) meanwhile
            if written <= now - _POSTED_STALE and posted.pop(key, None) is not None:
                self._waiting.extendleft(reversed(batch))

    def put(self, release: _Release) -> None:
        self._waiting.append(release)
        if not self._armed:
            self._arm()

    def _arm(self) -> None:
        with self._lock:  # against a sender deciding to exit meanwhile
            self._armed = True
            if self._thread is None or self._generation != _generation:
                self._start()
        self._wake.set()

    def take(self, tag: str | None = None) -> list[_Release]:
        """Everything waiting, plus the batch the sender has out. With ``tag`` (a key's
        start up to its hash tag), only the releases of that tag: a Cluster script
        touches one slot."""
        with self._lock:
            taken = self._drain(tag)
            sending = self._sending
            if not sending:
                return taken
        # Sent again: gate.lua skips those the sender's call applied already. A give-back
        # or an adaptive write is sent as it is (both are idempotent).
        return taken + [
            release if release.write or release.tombstone else release._replace(again=True)
            for release in sending
            if tag is None or release.input.keys[0].startswith(tag)
        ]

    def _drain(self, tag: str | None) -> list[_Release]:
        waiting = self._waiting
        taken: list[_Release] = []
        others: list[_Release] = []
        while True:
            try:
                release = waiting.popleft()
            except IndexError:
                break
            if tag is None or release.input.keys[0].startswith(tag):
                taken.append(release)
            else:
                others.append(release)
        if others:
            waiting.extendleft(reversed(others))
        return taken

    def give_back(self, releases: list[_Release]) -> None:
        """Releases whose call failed: first in line for the sender's next try (a posted
        batch given back is no longer watched: it is sent again from here)."""
        self._posted.pop(id(releases), None)
        with self._lock:
            sending = self._sending
            mine = [release for release in releases if not release.again and release not in sending]
            self._waiting.extendleft(reversed(mine))
        self._arm()

    def _start(self) -> None:
        """Start the sender (with ``_lock`` held)."""
        _flush_at_multiprocessing_exit()
        self._generation = _generation
        if self._stop.is_set():
            self._thread = None
            return
        self._thread = threading.Thread(
            target=self._guarded, name="gatekeeper-redis-release", daemon=True
        )
        self._thread.start()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException:
            # A bug, not an outage (those are BackendErrors, handled in _run): say so, and
            # let the next release start a new sender.
            logger.exception("gatekeeper: the redis release sender failed")
            with self._lock:
                self._thread = None
                self._armed = False

    def _run(self) -> None:
        backend = self._backend
        generation = _generation
        stop = self._stop
        interval = backend.flush_interval
        lingering = round(_LINGER / interval) if interval >= _LINGER_FROM else 0
        while generation == _generation:
            if not self._wake.wait(_SENDER_IDLE):
                with self._lock:
                    if not self._armed and not self._waiting:
                        # Idle: end, so an unused backend's thread (and the backend it
                        # holds) goes; the next release starts a new one.
                        self._thread = None
                        return
                continue
            self._wake.clear()
            idle = 0
            while not stop.is_set():
                with self._lock:
                    if self._posted:
                        self._stale(time.monotonic())
                    waiting = self._waiting
                    if waiting:
                        oldest = waiting[0].placed
                    elif idle < lingering or self._posted:
                        oldest = None
                    else:
                        # Checked and disarmed in one step: a release put after this
                        # finds the sender disarmed and wakes it.
                        self._armed = False
                        break
                if oldest is None:
                    # The admissions took everything along. Still armed, so the releases
                    # of the next responses cost their threads an append and no wake-up
                    # (a wake-up per release, and the GIL handed back and forth with it,
                    # cost each direct request ~50 µs); looked at once per interval, so
                    # none waits longer than the interval.
                    idle += 1
                    stop.wait(interval)
                    continue
                idle = 0
                # A release waits the interval first, leaving the GIL to the request
                # threads: most ride along with an admission of the process meanwhile,
                # and only those left are sent (sent now, they would be sent again by
                # every admission while this call is out).
                due = oldest + interval - time.monotonic()
                if due > 0:
                    stop.wait(due)
                    continue
                with self._lock:
                    batch = self._sending = self._drain_due(time.monotonic() - interval)
                if not batch:  # taken along by an admission meanwhile
                    continue
                try:
                    backend._send(batch)
                except BackendError:
                    with self._lock:
                        self._sending = []
                        self._waiting.extendleft(reversed(batch))
                    # Until the breaker lets a probe through, every call would fail fast.
                    stop.wait(backend._breaker.cooldown)
                    continue
                self._sending = []
            if stop.is_set():
                return

    def _drain_due(self, cutoff: float) -> list[_Release]:
        """The waiting releases placed at ``cutoff`` or before (with ``_lock`` held)."""
        waiting = self._waiting
        due: list[_Release] = []
        while waiting and waiting[0].placed <= cutoff:
            due.append(waiting.popleft())
        return due

    def flush(self) -> None:
        """Send what is waiting from this thread, now (status reads, close)."""
        batch = self.take()
        if batch:
            try:
                self._backend._send(batch)
            except BackendError:
                self.give_back(batch)
                raise

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)


#: How long (seconds) a queued waiter may go without looking at its line before the others
#: count it as gone (its process died or hangs): a live one looks every poll_interval.
WAITER_GONE_AFTER = 1.0


class _Ticket(NamedTuple):
    """A waiter's place: its line (sorted set), the line's signs of life (hash), its id."""

    line: str
    life: str
    id: str


class _RedisLine(WaitingLine[_Ticket]):
    """The queues' lines of every process on this Redis (SPEC §4.4, ``lua/queue.lua``): a
    waiter may take its slots only when it is the first live waiter of its limit path, in
    the order the waiters joined across processes and hosts, and a line holds at most
    ``size`` of them. A waiter looks again every ``poll_interval`` (a release on another
    host notifies nobody here), at once after a release of its own process. A waiter whose
    process died is dropped once it has not looked for :data:`WAITER_GONE_AFTER`."""

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        self._script: Script = backend.client.register_script(_load_script("queue.lua"))
        self._gone_after_us = round(WAITER_GONE_AFTER * 1_000_000)
        self._cond = threading.Condition()

    def after_fork(self) -> None:
        self._cond = threading.Condition()  # it may have been held by another thread

    def _call(self, ticket: _Ticket, op: str, size: int = 0) -> int:
        # Through the backend's breaker, as admissions go: once a call failed, the others
        # (a waiter leaving its line, the other waiters' looks) fail fast instead of each
        # waiting its own socket timeout.
        breaker = self._backend._breaker
        breaker.before()
        try:
            answer = self._script(
                keys=[ticket.line, ticket.life], args=[op, ticket.id, size, self._gone_after_us]
            )
        except Exception as exc:  # redis-py's: an outage, which on_backend_error decides
            breaker.failure(exc)
            raise self._backend.backend_error(exc) from exc
        except BaseException:
            breaker.abandon()
            raise
        breaker.success()
        return int(answer)

    def join(self, key: str, size: int) -> _Ticket | None:
        backend = self._backend
        ticket = _Ticket(backend.line_key(key), backend.line_key(key, "w"), os.urandom(12).hex())
        return ticket if self._call(ticket, "join", size) else None

    def admit(self, ticket: _Ticket, slots: Sequence[Slot], now: float) -> Grant | Denial | None:
        if not self._call(ticket, "first"):
            return None
        return self._backend.acquire_turn(slots, now)

    def sleep(self, ticket: _Ticket, timeout: float) -> None:
        with self._cond:
            self._cond.wait(min(timeout, self._backend.poll_interval))

    def leave(self, ticket: _Ticket) -> None:
        try:
            self._call(ticket, "leave")
        except BackendError as exc:
            # Not this request's failure: the place is dropped as gone once it stops looking.
            logger.warning("gatekeeper: leaving a queue line failed: %s", exc)
        self.wake()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


class RedisBackend(Backend):
    """Counters in Redis, exact across hosts; one round trip a request waits for.

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
    - ``flush_interval`` (seconds, default 0.005, at most 0.005): see below.
    - ``spin`` (seconds, default 0.0002, at most 0.01; 0: never): how long a request's
      thread looks for its admission's answer, awake, before it sleeps on the socket
      (see :func:`_await_answer`).

    Admission is one script call (``lua/gate.lua``) the request waits for. A release is
    handed to a sender thread and the response does not wait for it: the next admission
    of the process carries the releases waiting in its own call, and the sender sends,
    all in one call, those no admission took within ``flush_interval``; so a release is
    applied before any later decision of its process, and within ``flush_interval`` plus
    one round trip (plus a thread switch, at most ``sys.getswitchinterval()``, 5 ms) for
    the other hosts. Releases that fail are kept and
    sent again once Redis answers; those lost (a crashed process, a restart without
    persistence, more than 10 000 waiting) end by lease expiry. Status reads
    (:meth:`inflight`) send the waiting releases first, so they count exactly.

    ``max_keys`` is counted as on the other backends: a wildcard limit's tracked set (see
    :meth:`tracking_key`) holds its keys; a new key evicts an idle one (nothing in flight,
    its window empty) or, none found among the 64 that end soonest, is refused by that limit
    (:class:`~gatekeeper_wsgi.errors.CapacityError`, nothing taken). Idle keys also expire
    by themselves (a key when its last lease ends, its last delayed release matures or its
    window empties). Replication can
    lose acknowledged writes on failover, so a limit may over-admit briefly then.
    Queued waiters wait in one line per limit path for every process on this Redis, FIFO
    across hosts (:class:`_RedisLine`), and look again every ``poll_interval``.
    """

    local = False
    poll_interval = 0.005
    adaptive_limits = True

    def __init__(
        self,
        client: redis.Redis | RedisCluster | _ClusterOnDemand,
        *,
        prefix: str = DEFAULT_PREFIX,
        max_hold: float = DEFAULT_MAX_HOLD,
        breaker_cooldown: float = DEFAULT_BREAKER_COOLDOWN,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        spin: float = DEFAULT_SPIN,
        location: str = "redis",
    ) -> None:
        if not _PREFIX_RE.fullmatch(prefix):
            raise ConfigError(
                "backend", f"prefix: expected [A-Za-z0-9._:/-]{{1,64}}, got {prefix!r}"
            )
        if not 0 < max_hold <= _MAX_HOLD:
            raise ConfigError(
                "backend",
                f"max_hold: expected seconds > 0, at most {_MAX_HOLD:.0f}, got {max_hold!r}",
            )
        if not 0 <= flush_interval <= MAX_FLUSH_INTERVAL:
            raise ConfigError(
                "backend",
                f"flush_interval: expected 0 to {MAX_FLUSH_INTERVAL} seconds, "
                f"got {flush_interval!r}",
            )
        if not 0 <= spin <= MAX_SPIN:
            raise ConfigError("backend", f"spin: expected 0 to {MAX_SPIN} seconds, got {spin!r}")
        self.flush_interval = flush_interval
        #: how long a request thread looks for its admission's answer before it sleeps
        self.spin = spin
        self.client = client
        self.prefix = prefix
        self.max_hold = max_hold
        self._hold_us = round(max_hold * 1_000_000)
        self._cluster = isinstance(client, (RedisCluster, _ClusterOnDemand))
        self._pool = (
            None if isinstance(client, (RedisCluster, _ClusterOnDemand)) else client.connection_pool
        )
        self._source = _load_script("gate.lua")
        self._script: Script = client.register_script(self._source)
        self._read_totals: Script = client.register_script(_load_script("totals.lua"))
        # "EVALSHA <sha>", packed: the start of every call.
        self._evalsha_head = _bulk(b"EVALSHA") + _bulk(self._script.sha.encode())
        self._hold_bulk = _bulk(b"%d" % self._hold_us)
        self._breaker = _Breaker(breaker_cooldown, location)
        self.location = location
        self._inputs: dict[tuple[Slot, ...], _Input] = {}
        #: adaptive hash -> (its limit's adaptive table, its concrete path), of the routes
        #: memoized: what a claim of that hash is computed with
        self._adaptive: dict[str, tuple[AdaptiveSpec, str]] = {}
        #: concrete path -> (the adaptive limit last seen in force there, when: monotonic)
        self._seen: dict[str, tuple[int, float]] = {}
        #: the adaptive reports last read (what adaptive() answers while Redis fails)
        self._reports: dict[str, AdaptiveReport] = {}
        #: adaptive windows this process claimed and computed (their next state written)
        self.windows_computed = 0
        #: releases Redis refused alone (a key of another type under their path): dropped
        self.releases_dropped = 0
        self._dropped_logged = Throttle(_DROPPED_LOG_INTERVAL)
        self._outbox = _Outbox(self)
        #: until when (time.monotonic()) releases are sent at once, not left waiting
        self._contended_until = 0.0
        self._delayed: list[float] = []
        self._delayed_lock = threading.Lock()
        # One connection per thread, used without the pool: the pool's bookkeeping costs
        # more than the round trip it wraps.
        self._local = threading.local()
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()
        self._line: _RedisLine | None = None
        _BACKENDS.add(self)

    def _after_fork(self) -> None:
        self._outbox.after_fork()
        self._delayed_lock = threading.Lock()
        self._breaker.after_fork()
        if self._line is not None:
            self._line.after_fork()

    def waiting_line(self) -> _RedisLine:
        """One line per queued limit path for every process on this Redis."""
        if self._line is None:
            self._line = _RedisLine(self)
        return self._line

    @property
    def label(self) -> str:
        return f"redis at {self.location}"

    @classmethod
    def from_url(
        cls, url: str, config: Config | None = None, *, check: bool = True
    ) -> RedisBackend:
        """Build the backend from a ``redis://``, ``rediss://``, ``unix://`` or
        ``valkey://`` URL (see the class docstring for the query options). With ``check``,
        log what :meth:`eviction_check` finds (a WARNING when Redis may evict keys)."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "valkey":
            scheme = "redis"
        # Credentials that a '/', '?' or '#' of a password not percent-encoded cut short:
        # the rest of them went into the path, the query or the fragment, which error
        # messages must then not quote.
        misplaced = "@" in f"{parts.path}?{parts.query}#{parts.fragment}"
        query = parse_qsl(parts.query, keep_blank_values=True)
        _check_options(url, query)
        ours = {"prefix", "max_hold", "breaker_cooldown", "flush_interval", "spin", "cluster"}
        options = {name: value for name, value in query if name in ours}
        passed = [(name, value) for name, value in query if name not in ours]
        # Not urlunsplit: it drops the "//" of a netloc-less "unix:///path.sock".
        redis_url = f"{scheme}://{parts.netloc}{parts.path}"
        if passed:
            redis_url += f"?{urlencode(passed)}"
        # redis-py reads a database that is not a number as 0 (and -5 as -5, refused by
        # Redis on every connection): a typo would share or lose the counters quietly.
        databases = [] if scheme == "unix" else [parts.path.strip("/")]
        databases += [value for name, value in passed if name == "db"]
        for database in databases:
            if database and not (database.isascii() and database.isdigit() and len(database) < 10):
                # A path with an "@" holds the rest of the credentials (a "/" in the
                # password, not written %2F, ends the host part early), and so may a path
                # before a query or fragment that holds the "@": not quoted.
                got = (
                    "the rest of the credentials (write '/', '?' and '#' in a password"
                    " percent-encoded: %2F, %3F, %23)"
                    if "@" in database or misplaced
                    else repr(database[:40])
                )
                raise ConfigError(
                    "backend",
                    f"db: expected a database number (0, 1, 2, ...), got {got} "
                    f"in {mask_url(url)[:200]!r}",
                )
        cluster = options.get("cluster", "0").strip().lower()
        if cluster not in _TRUE + _FALSE:
            raise ConfigError(
                "backend",
                f"cluster: expected 1 or 0, got {cluster[:40]!r} in {mask_url(url)[:200]!r}",
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
        client: redis.Redis | RedisCluster | _ClusterOnDemand
        try:
            if cluster in _TRUE:
                try:
                    client = RedisCluster.from_url(redis_url, **kwargs)
                except redis.exceptions.RedisClusterException as exc:
                    if "cluster mode is not enabled" in str(exc).lower():
                        raise ConfigError(
                            "backend",
                            f"cluster=1, but the Redis at {mask_url(url)!r} is no Cluster"
                            " node (cluster mode is not enabled): leave cluster out",
                        ) from exc
                    # Not answering now: made at first use (see _ClusterOnDemand).
                    client = _ClusterOnDemand(redis_url, kwargs)
            else:
                client = redis.Redis.from_url(redis_url, **kwargs)
                # redis-py hands options it does not know (a typo) to the connection,
                # which refuses them only when it first connects - inside a request,
                # failing open for good. One connection object (it connects lazily)
                # refuses them now, at start-up and in `gatekeeper check`.
                pool = client.connection_pool
                pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError, redis.exceptions.RedisError) as exc:
            # redis-py's message quotes what it could not parse, which may be a piece of
            # a password a '/', '?' or '#' cut short: then not quoted at all. Otherwise
            # (an unknown option, a bad port) it names the culprit, credentials masked.
            reason = (
                "it cannot be parsed (write '/', '?', '#' and '@' in a user name or "
                "password percent-encoded)"
                if misplaced
                else mask_text(str(exc))
            )
            raise ConfigError("backend", f"invalid redis URL {mask_url(url)!r}: {reason}") from exc
        # host and port as written: an IPv6 address keeps its brackets
        location = parts.netloc.rpartition("@")[2]
        if scheme == "unix":
            location = parts.path
        backend = cls(
            client,
            prefix=options.get("prefix", DEFAULT_PREFIX),
            max_hold=_seconds(url, "max_hold", options, DEFAULT_MAX_HOLD),
            breaker_cooldown=_seconds(url, "breaker_cooldown", options, DEFAULT_BREAKER_COOLDOWN),
            flush_interval=_seconds(
                url, "flush_interval", options, DEFAULT_FLUSH_INTERVAL, zero=True
            ),
            spin=_seconds(url, "spin", options, DEFAULT_SPIN, zero=True),
            location=location or url.split("?", 1)[0].rsplit("@", 1)[-1],
        )
        if check:
            try:
                level, message = backend.eviction_check()
            except ConfigError:
                backend.close()
                raise
            if level > logging.DEBUG:
                logger.log(level, "gatekeeper: %s", message)
        return backend

    def eviction_check(self) -> tuple[int, str]:
        """What Redis's ``maxmemory-policy`` means for the limits, as (logging level,
        message): WARNING when it may evict keys (any policy but ``noeviction``: an evicted
        key resets its limit), INFO when it cannot tell (``CONFIG`` disabled or renamed, as
        on many managed services, or Redis not answering), DEBUG for ``noeviction``.
        ConfigError when Redis answers that the URL's database does not exist."""
        try:
            reply = self.client.config_get("maxmemory-policy")
        except redis.exceptions.ResponseError as exc:
            if "DB index is out of range" not in str(exc):
                return self._unknown_policy(exc)
            # Not an outage: a server that answers has no such database, and every request
            # would fail open on it.
            raise ConfigError(
                "backend", f"redis at {self.location}: {mask_text(str(exc))}"
            ) from exc
        except Exception as exc:  # whatever the client raises: a note, never a failure
            return self._unknown_policy(exc)
        policies = sorted(set(_policies(reply)))
        if not policies:
            return logging.INFO, (
                f"cannot tell the maxmemory-policy of redis at {self.location} (no answer); "
                "it must be noeviction, or eviction resets limits (see docs/deployment.md)"
            )
        evicting = [policy for policy in policies if policy != "noeviction"]
        if evicting:
            return logging.WARNING, (
                f"redis at {self.location} has maxmemory-policy {', '.join(evicting)}: "
                "under memory pressure it may evict gatekeeper keys, and an evicted key "
                "resets its limit (a caller that used its rate is admitted again, slots in "
                "flight are forgotten); run Redis with maxmemory-policy noeviction, or give "
                "gatekeeper a dedicated instance (see docs/deployment.md)"
            )
        return logging.DEBUG, f"redis at {self.location}: maxmemory-policy noeviction"

    def _unknown_policy(self, exc: Exception) -> tuple[int, str]:
        return logging.INFO, (
            f"cannot tell the maxmemory-policy of redis at {self.location} "
            f"({mask_text(str(exc)) or type(exc).__name__}); it must be noeviction, or "
            "eviction under memory pressure resets limits (see docs/deployment.md)"
        )

    @classmethod
    def check_url(cls, url: str) -> None:
        # Building the client parses and checks everything and connects to nothing (a
        # cluster client excepted: it asks a node for the slot map, as at start-up); the
        # maxmemory-policy question is check_report's.
        cls.from_url(url, check=False).close()

    # --- keys -----------------------------------------------------------------------------

    def key_of(self, path: str) -> str:
        """The sorted set of a concrete path: its leases, delayed releases and window."""
        return f"{self.prefix}:{{{path.split('/', 1)[0]}}}:z:{path}"

    def totals_key(self, limit_path: str, path: str) -> str:
        """The totals set of configured limit ``limit_path`` for its concrete ``path``:
        the leases and rate-windowed keys of all its paths (see ``lua/gate.lua``). It
        shares the hash tag of ``path``'s own set; a limit whose project segment is ``*``
        thus has one totals set per project."""
        return f"{self.prefix}:{{{path.split('/', 1)[0]}}}:t:{limit_path}"

    def delayed_key(self, limit_path: str, path: str) -> str:
        """The delayed set of configured wildcard limit ``limit_path`` for its concrete
        ``path``: the delayed releases of all its paths (see ``lua/gate.lua``), beside its
        totals set."""
        return f"{self.prefix}:{{{path.split('/', 1)[0]}}}:d:{limit_path}"

    def line_key(self, path: str, kind: str = "q") -> str:
        """The queue line of concrete ``path`` (``lua/queue.lua``): its waiters' tickets in
        the order they joined (``lua/gate.lua`` reads it beside the path's sorted set);
        with ``kind`` "w", the line's hash of when each ticket last looked."""
        return f"{self.prefix}:{{{path.split('/', 1)[0]}}}:{kind}:{path}"

    def tracking_key(self, limit_path: str, path: str) -> str:
        """The tracked set of configured wildcard limit ``limit_path`` for its concrete
        ``path``: the keys it tracks, at most its ``max_keys`` (see ``lua/gate.lua``),
        beside its totals set."""
        return f"{self.prefix}:{{{path.split('/', 1)[0]}}}:k:{limit_path}"

    def adaptive_key(self, path: str) -> str:
        """The hash of an adaptive limit at concrete ``path``: its limit in force, its
        controller's state and the window being gathered (see ``lua/gate.lua``)."""
        return f"{self.prefix}:{{{path.split('/', 1)[0]}}}:a:{path}"

    def _input(self, slots: Sequence[Slot]) -> _Input:
        """The packed gate.lua input of ``slots``, memoized per route (bounded)."""
        route = slots if type(slots) is tuple else tuple(slots)
        found = self._inputs.get(route)
        if found is not None:
            return found
        if len(self._inputs) >= _KEY_CACHE_SIZE:
            self._inputs = {}
            self._adaptive = {}
        keys: list[str] = []
        specs: list[str] = []
        values: list[int] = []
        reserved: list[tuple[int, frozenset[int]]] = []
        adaptive: set[int] = set()
        for index, slot in enumerate(route):
            limit = slot.limit
            rate = limit.rate
            window_us = 0 if rate is None else round(rate.seconds * 1_000_000)
            concurrency = "-1" if limit.concurrency is None else str(limit.concurrency)
            quota = 0 if rate is None else rate.limit
            own = self.key_of(slot.key)
            # A limit without a wildcard has one concrete path: its own set holds all its
            # totals would (read there by totals()), so it has no totals, delayed and
            # tracked sets and sends its one key (each KEYS entry costs the script a string
            # and a slot).
            if limit.wildcard:
                keys += (own, self.totals_key(limit.path, slot.key))
                keys += (
                    self.delayed_key(limit.path, slot.key),
                    self.tracking_key(limit.path, slot.key),
                )
            else:
                keys.append(own)
            if limit.adaptive is not None:
                adaptive.add(index)
                spec = limit.adaptive
                concurrency = f"a{spec.initial}:{spec.min}:{spec.max}"
                keys.append(self.adaptive_key(slot.key))
                self._adaptive[keys[-1]] = (limit.adaptive, slot.key)
            wildcard = 2 if limit.wildcard else 0
            # A wildcard limit's spec ends with its max_keys.
            max_keys = f" {limit.max_keys}" if wildcard else ""
            # An enforced slot of a limit with a queue: newcomers line up behind its waiters.
            queued = 4 if limit.queue is not None and slot.enforce else 0
            if (
                quota
                or queued
                or not slot.enforce
                or limit.adaptive is not None
                or concurrency == "-1"
            ):
                flags = int(slot.enforce) + wildcard + queued
                specs.append(f"{concurrency} {quota} {window_us} {flags}{max_keys}")
            elif wildcard:
                # An enforced concurrency slot without a rate of a wildcard limit (four
                # keys): -2 - its limit, and its max_keys.
                specs.append(f"{-2 - int(concurrency)}{max_keys}")
            else:
                # An enforced concurrency slot without a rate, the commonest: its limit
                # alone, which the script reads without matching a pattern.
                specs.append(concurrency)
            values.append(-(-window_us // 1000) * 4 + wildcard)
            if limit.count is not None and rate is not None:
                reserved.append((index, limit.count))
        found = _Input(
            keys,
            [_bulk(key.encode()) for key in keys],
            specs,
            [_bulk(spec.encode()) for spec in specs],
            "",
            reserved,
            values,
            frozenset(adaptive),
        )
        found = self._inputs[route] = found._replace(codes=_codes(found))
        return found

    # --- admission ------------------------------------------------------------------------

    def acquire(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        return self._acquire(slots, False)

    def acquire_turn(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        """:meth:`acquire` for the first waiter of a line (:class:`_RedisLine`), which the
        waiters of its queued limits do not bar."""
        return self._acquire(slots, True)

    def _acquire(self, slots: Sequence[Slot], turn: bool) -> Grant | Denial:
        _FORKS.check()
        lease = f"{_token}{next(_sequence):x}"
        input = self._input(slots)
        try:
            # '^': the line's turn (gate.lua lets it past the waiters of queued limits).
            result, retried = self._call_with_releases(input, "^" + lease if turn else lease)
        except BackendError as exc:
            if not isinstance(exc, CircuitOpen):
                # The script may have run before the connection broke (give the lease and
                # its rate window entries back once Redis answers again: the request never
                # ran), or may run after the give-back, queued in a frozen Redis (the
                # tombstone stops it).
                codes = _given_back(input)
                self._outbox.put(_Release(lease, input, codes, 0.0, 0.0, self._hold_us))
            raise
        if result == 1:
            return _RedisGrant(slots, (), lease, input, input.reserved)
        if result == _TIGHT:
            grant = _RedisGrant(slots, (), lease, input, input.reserved)
            grant.tight = True
            return grant
        if result[0] != 1:
            if result[0] == 0 and result[2] == 1:
                self._contended_until = time.monotonic() + _CONTENDED_FOR
                if int(result[1]) in input.adaptive:
                    self._remember(slots[int(result[1])].key, int(result[4]))
            if retried:
                # The first try may have taken the slots (the retry then saw its own lease).
                self._outbox.put(_Release(lease, input, _given_back(input), 0.0, 0.0))
            return _denial(result)
        shadowed = tuple(int(index) for index in result[1])
        reserved = input.reserved
        if reserved and result[2]:
            unrecorded = {int(index) for index in result[2]}
            reserved = [entry for entry in reserved if entry[0] not in unrecorded]
        return _RedisGrant(slots, shadowed, lease, input, reserved)

    def _call_with_releases(self, input: _Input, lease: str) -> tuple[Any, bool]:
        """An admission (or, without a lease, a peek) that first applies the releases this
        process placed and Redis has not confirmed, so it decides as if they had arrived.
        Also says whether the call was sent twice (see :meth:`_evalsha`)."""
        outbox = self._outbox
        if not len(outbox):
            return self._run([], input, lease)
        releases = outbox.take(self._tag(input.keys[0]))
        try:
            try:
                return self._run(releases, input, lease)
            except BackendError as exc:
                if not _wrong_type(exc.__cause__):
                    raise
                # A key of another type under the path of one of the releases would fail
                # every admission it rides along with: each release alone first, then
                # the admission.
                self._apply_alone(releases)
        except BackendError:
            outbox.give_back(releases)
            raise
        return self._run([], input, lease)

    def _apply_alone(self, releases: list[_Release]) -> None:
        """``releases``, which Redis refused together for a key of another type: one call
        each. One refused alone is dropped (kept, it would fail every call it went with,
        for good; its lease ends by max_hold), with a WARNING at most every
        ``_DROPPED_LOG_INTERVAL``. Any other failure (an outage) is raised: the caller
        gives the releases back (those applied already do nothing when sent again)."""
        for release in releases:
            try:
                self._run([release], None, "")
            except BackendError as exc:
                if not _wrong_type(exc.__cause__):
                    raise
                self.releases_dropped += 1
                if self._dropped_logged.due():
                    logger.warning(
                        "gatekeeper: redis refused a release (%s); dropped, its lease ends"
                        " by max_hold (%d dropped so far)",
                        exc,
                        self.releases_dropped,
                    )

    def _tag(self, key: str) -> str | None:
        """``key`` up to its hash tag, which a Cluster routes it by (None off a Cluster:
        one script may touch any keys)."""
        if not self._cluster:
            return None
        return key[: key.index("}") + 1]

    def peek(self, slots: Sequence[Slot], now: float) -> Denial | None:
        """Whether acquire would admit now: gate.lua without a lease checks only (it
        drops expired entries and records nothing)."""
        result, _ = self._call_with_releases(self._input(slots), "")
        return None if result == 1 or result == _TIGHT else _denial(result)

    # --- adaptive limits ------------------------------------------------------------------

    def observe(self, grant: Grant, faulty: bool, now: float) -> None:
        """Note the request's latency (this host's monotonic clock, admission to now) for
        its release to carry to the adaptive slots' hashes."""
        assert isinstance(grant, _RedisGrant)
        latency = max(0, round((time.monotonic() - grant.started) * 1_000_000))
        grant.sample = f"{latency}:{int(faulty)}"

    def _claimed(self, reply: list[Any]) -> Any:
        """The answer inside a reply that carries claimed adaptive windows; each window's
        next state is computed here and queued to be written back."""
        for claim in reply[2:]:
            known = self._adaptive.get(_text(claim[0]))
            if known is None:  # a limit no longer in use here: the claim lapses
                continue
            try:
                write = self._next_state(known[0], known[1], claim)
            except Exception:
                # A bug must not fail the admission this reply answers; the claim lapses
                # and another release claims the window again.
                logger.exception("gatekeeper: computing the adaptive limit of %s failed", known[1])
                continue
            self._outbox.put(write)
            self.windows_computed += 1
        return reply[1]

    def _next_state(self, spec: AdaptiveSpec, path: str, claim: list[Any]) -> _Release:
        """Feed a claimed window and its sample to :class:`~gatekeeper_wsgi.adaptive.
        Controller` (the one place the algorithm lives) and spell the write of its next
        state. All its times are seconds of Redis time, shared by every host."""
        hash_key, claim_id = _text(claim[0]), _text(claim[1])
        latency = int(claim[2]) / 1e6
        now = int(claim[5]) / 1e6
        admitted = now - latency
        controller = _restored(spec, path, _text(claim[6]), claim[7:11])
        if controller is None:  # the path's first window (or a state that does not parse:
            # written by another version, or tampered with): start over, as memory starts
            # with a controller made at the admission
            controller = Controller(spec, admitted, key=path)
        controller.sample(latency, int(claim[3]), bool(int(claim[4])), admitted, now)
        state = list(controller.state())
        window = " ".join(_number(state[index]) for index in _WINDOW)
        # The most one good sample may add to the window's sum in the script, as the
        # controller's own sample() counts it (0: no baseline yet, no cap).
        cap = SAMPLE_CEILING * controller.min_latency
        spec_words = (
            f"={claim_id} {_number(state[_DUE])} {controller.limit} {window} {_number(cap)} "
            + " ".join(map(_number, state))
        )
        self._remember(path, controller.limit)
        key_bulks = [_bulk(hash_key.encode())]
        target = _Input([hash_key], key_bulks, [], [], "", [], [])
        return _Release(claim_id, target, spec_words, 0.0, 0.0, write=True)

    def _remember(self, path: str, limit: int) -> None:
        seen = self._seen
        if len(seen) >= _KEY_CACHE_SIZE:
            seen.clear()
        seen[path] = (limit, time.monotonic())

    def adaptive(self, keys: Collection[str] | None = None) -> dict[str, AdaptiveReport]:
        """The adaptive limits of the paths this process admitted on (of ``keys`` among
        them, when given), read from their hashes (one pipelined round trip): the value all
        hosts enforce, and the latencies it was computed from. On a failure, the reports
        last read."""
        known = list(self._adaptive.items())
        if keys is not None:
            wanted = set(keys)
            known = [(hash_key, found) for hash_key, found in known if found[1] in wanted]
        if not known:
            return {}
        try:
            with self._reading():
                pipe = self.client.pipeline(transaction=False)
                for hash_key, _ in known:
                    pipe.hmget(hash_key, "s", "limit")
                replies = pipe.execute()
        except BackendError:
            last = self._reports
            return dict(last) if keys is None else {key: last[key] for key in keys if key in last}
        reports = {
            path: self._report(spec, path, text, limit)
            for (_, (spec, path)), (text, limit) in zip(known, replies, strict=True)
        }
        if keys is None:
            self._reports = reports
        return reports

    def adaptive_reports(self, wanted: Mapping[str, Limit]) -> dict[str, AdaptiveReport]:
        """The reports of ``wanted`` read from their hashes, latencies included (one
        pipelined round trip): what another host's controller measured. On a failure,
        :meth:`adaptive_limit`'s last values, without latencies."""
        if not wanted:
            return {}
        try:
            with self._reading():
                pipe = self.client.pipeline(transaction=False)
                for path in wanted:
                    pipe.hmget(self.adaptive_key(path), "s", "limit")
                replies = pipe.execute()
        except BackendError:
            return super().adaptive_reports(wanted)
        reports: dict[str, AdaptiveReport] = {}
        for (path, limit), (text, value) in zip(wanted.items(), replies, strict=True):
            assert limit.adaptive is not None
            reports[path] = self._report(limit.adaptive, path, text, value)
        return reports

    def _report(
        self, spec: AdaptiveSpec, path: str, text: bytes | None, limit: bytes | None
    ) -> AdaptiveReport:
        """The report of the adaptive limit at ``path`` from its hash's state and limit."""
        controller = _restored(spec, path, _text(text or b""))
        if controller is not None:
            report = controller.report()
        else:
            report = {"limit": spec.initial, "latency_ms": 0.0, "min_latency_ms": 0.0}
        if limit is not None and _text(limit).isdigit():
            report["limit"] = int(_text(limit))
        self._remember(path, report["limit"])
        return report

    def adaptive_limit(self, key: str, limit: Limit) -> int:
        """The adaptive limit in force at ``key``: as a refusal or a read reported it
        within the last ``_FRESH`` seconds, else read from its hash (on a failure, the
        value last seen; ``initial`` before any)."""
        seen = self._seen.get(key)
        if seen is not None and time.monotonic() - seen[1] < _FRESH:
            return seen[0]
        try:
            with self._reading():
                stored = self.client.hget(self.adaptive_key(key), "limit")
        except BackendError:
            stored = None
        if stored is None:
            return super().adaptive_limit(key, limit) if seen is None else seen[0]
        self._remember(key, int(_text(stored)))
        return int(_text(stored))

    # --- release --------------------------------------------------------------------------

    def release(self, grant: Grant, status: int | None, delay: float, now: float) -> None:
        assert isinstance(grant, _RedisGrant)
        if not grant.claim():
            return
        input = grant.input
        codes = input.codes
        returned: Collection[int] = ()
        if grant.reserved:
            returned = {index for index, counted in grant.reserved if status not in counted}
        if returned or grant.sample:
            codes = _codes(input, returned, grant.sample)
        placed = time.monotonic()
        if delay > 0:
            with self._delayed_lock:
                heapq.heappush(self._delayed, placed + delay)
        release = _Release(grant.lease, input, codes, delay, placed)
        if not grant.tight and placed >= self._contended_until:
            self._outbox.put(release)
            return
        # The slot is wanted now: the request took the last one of a concurrency limit, or
        # the last place of a window that a `count` limit may give back (another process's
        # request, maybe this client's next one, may come for it before
        # this process admits again), or a limit refused here lately (left waiting, a slot
        # would go from request to request of this process while other hosts are refused).
        if not self._cluster:
            self._post(release)
            return
        outbox = self._outbox
        if placed >= self._contended_until:
            outbox.put(release)
            return
        # redis-py's Cluster client cannot write without reading the answer: after a
        # refusal a Cluster's releases are sent at once and waited for, as before.
        batch = [*outbox.take(), release]
        try:
            self._send(batch)
        except BackendError:
            outbox.give_back(batch)  # the sender tries again; no response fails for it

    def _post(self, release: _Release) -> None:
        """Write ``release`` (with those waiting) to Redis at once on this thread's own
        connection, without waiting for its answer: that is read before the answer of
        the thread's next command there (:meth:`_exchange`), and a release whose answer
        is lost or an error goes to the outbox again. To the outbox when it cannot be
        written so (the breaker open, a thread not connected yet, a failed write); not on
        a Cluster (see :meth:`release`)."""
        outbox = self._outbox
        breaker = self._breaker
        if breaker.open:  # the sender and the admissions probe; a release only waits
            outbox.put(release)
            return
        local = self._local
        connection = local.__dict__.get("connection")
        if connection is None or local.generation != _generation or not connection.is_connected:
            # Connecting is a round trip (the handshake): the sender sends it instead.
            outbox.put(release)
            return
        batch = [*outbox.take(), release]
        try:
            connection.send_packed_command((self._pack(batch, None, ""),), check_health=False)
        except Exception as exc:  # down, or a timeout: the sender sends them once it can
            breaker.failure(exc)
            connection.disconnect()
            self._repost(connection)
            outbox.give_back(batch)
            return
        posted: list[list[_Release]] | None = getattr(connection, "gatekeeper_posted", None)
        if posted is None:
            posted = connection.gatekeeper_posted = []
        posted.append(batch)
        outbox.posted(batch)
        if len(posted) >= _POSTED_UNREAD:
            # A thread that releases and does not admit (an event loop's): the answers
            # that have come are read now, so neither they nor this list grow.
            try:
                while posted and connection.can_read(timeout=0):
                    self._read_posted(connection, posted, 1)
            except Exception:
                connection.disconnect()
                self._repost(connection)

    def _read_posted(
        self, connection: Any, posted: list[list[_Release]], count: int | None = None
    ) -> None:
        """Read the answers of the releases :meth:`_post` wrote on ``connection`` (the
        first ``count``, or all), which come before that of any command sent after them;
        a release refused by an error (a restarted Redis lost the script) goes to the
        outbox again."""
        outbox = self._outbox
        for _ in range(len(posted) if count is None else count):
            batch = posted.pop(0)
            try:
                reply = connection.read_response()
            except redis.exceptions.ResponseError:
                outbox.give_back(batch)
                continue
            except BaseException:
                posted.insert(0, batch)
                raise
            outbox.confirmed(batch)
            if type(reply) is list and reply[0] == 2:
                self._claimed(reply)

    def _repost(self, connection: Any) -> None:
        """The releases written on ``connection`` whose answers were not read (it broke, or
        was replaced): to the outbox, to be sent again (a release applied twice does
        nothing the second time)."""
        posted: list[list[_Release]] | None = getattr(connection, "gatekeeper_posted", None)
        outbox = self._outbox
        while posted:
            outbox.give_back(posted.pop(0))

    def _send(self, releases: list[_Release]) -> None:
        """Apply releases: one script call (on a Cluster, one per hash tag); a batch Redis
        refuses for a key of another type, one call per release (:meth:`_apply_alone`)."""
        by_tag: dict[str, list[_Release]] = {}
        if not self._cluster:
            by_tag[""] = releases
        else:
            for release in releases:
                by_tag.setdefault(self._tag(release.input.keys[0]) or "", []).append(release)
        for batch in by_tag.values():
            try:
                self._run(batch, None, "")
            except BackendError as exc:
                if not _wrong_type(exc.__cause__):
                    raise
                self._apply_alone(batch)

    # --- the one way to Redis -------------------------------------------------------------

    def _run(self, releases: list[_Release], input: _Input | None, lease: str) -> tuple[Any, bool]:
        """One call of gate.lua: ``releases`` first, then the admission of ``input`` under
        ``lease`` (a peek when ``lease`` is empty; none when ``input`` is None). Returns
        the answer and whether the call was sent twice."""
        breaker = self._breaker
        breaker.before()
        try:
            if self._cluster:
                keys, args = self._arguments(releases, input, lease)
                answer: tuple[Any, bool] = (self._script(keys=keys, args=args), False)
            else:
                # An admission's thread waits for the answer awake (see _await_answer);
                # the sender's calls, which nothing waits for, sleep.
                spin = self.spin if input is not None else 0.0
                answer = self._evalsha(self._pack(releases, input, lease), spin)
        except Exception as exc:  # redis-py's, or anything it let through: never a 500
            if _wrong_type(exc):
                # Redis answered: a key under the prefix holds another type (written by
                # someone else). That path fails; the process's other calls go on (an
                # open breaker would refuse them all, each time that path is asked for).
                breaker.success()
            else:
                breaker.failure(exc)
            # Wrapped here, not only by the base's guard: the release sender catches it.
            raise self.backend_error(exc) from exc
        except BaseException:
            breaker.abandon()
            raise
        breaker.success()
        reply = answer[0]
        if type(reply) is list and reply[0] == 2:
            answer = (self._claimed(reply), answer[1])
        return answer

    def _pack(self, releases: list[_Release], input: _Input | None, lease: str) -> bytes:
        """The EVALSHA command of :meth:`_run`, packed."""
        keys = 0
        parts = [b"", self._evalsha_head, b""]
        others: list[_Release] = []
        riding: list[_Release] = []
        for release in releases:
            if release.input is input:
                # A release of the admission's own route (a process's release riding along
                # with its next request): sent last, marked '+', and with no keys of its
                # own, as gate.lua reads the admission's for it.
                riding.append(release)
            else:
                others.append(release)
                parts += release.input.key_bulks
                keys += len(release.input.keys)
        if input is not None:
            parts += input.key_bulks
            keys += len(input.keys)
        parts.append(_bulk(b"%d" % len(releases)))
        if releases:
            now = time.monotonic()
            parts += [_bulk(release.spec(now).encode()) for release in others]
            parts += [_bulk(b"+" + release.spec(now).encode()) for release in riding]
        if input is not None:
            parts += (_bulk(lease.encode()), self._hold_bulk, *input.specs)
        parts[2] = _bulk(b"%d" % keys)
        # EVALSHA and its SHA are two elements of the one head part.
        parts[0] = b"*%d\r\n" % len(parts)
        return b"".join(parts)

    def _arguments(
        self, releases: list[_Release], input: _Input | None, lease: str
    ) -> tuple[list[str], list[str | int]]:
        """KEYS and ARGV of :meth:`_run`, for redis-py's Script (a Cluster routes them)."""
        keys: list[str] = []
        args: list[str | int] = [len(releases)]
        now = time.monotonic()
        for release in releases:
            keys += release.input.keys
            args.append(release.spec(now))
        if input is not None:
            keys += input.keys
            args += (
                lease,
                self._hold_us,
                *(spec.split(b"\r\n")[1].decode() for spec in input.specs),
            )
        return keys, args

    def _evalsha(self, command: bytes, spin: float) -> tuple[Any, bool]:
        """Send a packed EVALSHA on this thread's own connection and read the answer,
        looking for it awake for ``spin`` seconds first; also say whether it was sent
        twice.

        A connection that was idle may have been closed by the server (a restart): when it
        fails, the call is sent once more on a new connection. That is safe: every write of
        gate.lua is keyed by the lease id, so a call that ran twice holds one lease (the
        caller gives back a lease whose second call was refused). A timeout is not retried:
        the server is there but slow, and a second wait would double the request's.
        """
        local = self._local
        connection = local.__dict__.get("connection")
        if connection is None or local.generation != _generation:
            connection = self._connect()
        if connection.is_connected:
            try:
                return self._exchange(connection, command, spin), False
            except redis.exceptions.ConnectionError:
                connection = self._connect()
            return self._exchange(connection, command, spin), True
        return self._exchange(connection, command, spin), False

    def _connect(self) -> Any:
        """A new connection for this thread (it connects on first use)."""
        pool = self._pool
        assert pool is not None  # a Cluster goes through its own client
        local = self._local
        old = local.__dict__.get("connection")
        if old is not None and local.generation == _generation:
            old.disconnect()
            self._repost(old)
        kind = pool.connection_class
        connection = local.connection = _KERNEL_TIMED.get(kind, kind)(**pool.connection_kwargs)
        local.generation = _generation
        self._connections.add(connection)
        return connection

    def _exchange(self, connection: Any, command: bytes, spin: float) -> Any:
        """One command and its answer (loading the script first when Redis lost it),
        looked for awake for ``spin`` seconds before the thread sleeps on it."""
        try:
            connection.send_packed_command((command,), check_health=False)
            posted = getattr(connection, "gatekeeper_posted", None)
            if posted:
                self._read_posted(connection, posted)
                # Reading their answers may have read this one too (hiredis keeps it).
                if spin and not connection.can_read(timeout=0):
                    _look(connection, spin)
            elif spin:
                _look(connection, spin)
            try:
                return connection.read_response()
            except redis.exceptions.NoScriptError:
                # A restarted (or flushed) Redis lost the script: load it, call again.
                connection.send_command("SCRIPT", "LOAD", self._source)
                connection.read_response()
                connection.send_packed_command((command,), check_health=False)
                return connection.read_response()
        except redis.exceptions.ConnectionError as exc:
            connection.disconnect()
            self._repost(connection)
            if isinstance(exc.__context__, BlockingIOError):
                # The kernel's timeout ran out (see _kernel_timed): Redis is there but
                # slow, and a timeout is not sent again (_evalsha).
                raise redis.exceptions.TimeoutError(f"Timeout on the socket: {exc}") from exc
            raise
        except BaseException:
            # A reply half read, or a script error: start the next call on a clean line.
            connection.disconnect()
            self._repost(connection)
            raise

    # --- observation ----------------------------------------------------------------------

    def inflight(self, now: float) -> dict[str, int]:
        """Leases per concrete path, found by SCAN over the prefix (for status pages).
        Releases not yet confirmed are sent first, so none is counted as held."""
        counts: dict[str, int] = {}
        for key, held in self._each_key(
            lambda pipe, key, now_us: pipe.zcount(key, f"({now_us}", _BELOW_BAND)
        ):
            if held:
                counts[key.split("}:z:", 1)[1]] = int(held)
        return counts

    def totals(
        self,
        limits: Sequence[Limit],
        now: float,
        *,
        top: int = TOP_KEYS,
        watch: Mapping[str, Collection[str]] = NO_WATCH,
    ) -> dict[str, LimitTotals]:
        """Per limit, from its totals sets (``lua/gate.lua``; a limit without a wildcard
        from its own path's set): the live leases (held and delayed) grouped by key, and
        the count of keys with a live rate window; then the
        window use of the keys shown. Two round trips (one script call, one pipeline; on a
        Cluster, one call per project) of O(limits + requests in flight + keys shown)
        work, however many keys Redis tracks.
        Releases still waiting are sent first, so none is counted as held.

        "Keys tracked" are the keys that hold state in Redis: a request in flight or an
        entry in the rate window (an idle key is gone, as its set expired)."""
        with self._reading():
            sets = self._totals_sets(limits)
            # One call of lua/totals.lua per hash tag (one in all off a Cluster) reads every
            # set and drops what ended (what admissions leave between two prunes).
            groups: dict[str | None, tuple[list[str], list[str]]] = {}
            for named in sets:
                for name, window in named:
                    names, windows = groups.setdefault(self._tag(name), ([], []))
                    names.append(name)
                    windows.append(window)
            read: dict[str, tuple[list[Any] | int, int]] = {}
            now_us = 0
            for names, windows in groups.values():
                reply = self._read_totals(keys=names, args=windows)
                now_us = now_us or int(reply[0])
                for index, name in enumerate(names):
                    read[name] = (reply[2 * index + 1], int(reply[2 * index + 2]))
            found: list[tuple[Limit, list[_SetRead]]] = []
            for limit, named in zip(limits, sets, strict=True):
                per_set: list[_SetRead] = []
                for name, _ in named:
                    members, live = read[name]
                    if isinstance(members, int):  # its own set: the count of its leases
                        own = Counter({limit.path.encode(): members} if members else {})
                        per_set.append((name, own, live))
                        continue
                    # <lease>|<path>: the paths counted in C, as bytes (100 000 requests
                    # in flight are 100 000 members; a Python step per member costs more
                    # than reading them)
                    raw = (
                        members if not members or type(members[0]) is bytes else map(_raw, members)
                    )
                    paths = map(itemgetter(2), map(bytes.partition, raw, _BARS))
                    per_set.append((name, Counter(paths), live))
                found.append((limit, per_set))
            return self._summed(found, now_us or self._redis_time(), top, watch)

    def _totals_sets(self, limits: Sequence[Limit]) -> list[list[tuple[str, str]]]:
        """The sets lua/totals.lua reads for each limit, with the argument it reads each
        by: a limit without a wildcard, its path's own set and its rate window in µs; a
        wildcard limit, its totals set and '' and its delayed set and 'd'; for one whose
        project segment is ``*``, those of each project that used it (found by SCAN: such
        limits are rare)."""
        sets: list[list[tuple[str, str]]] = []
        for limit in limits:
            if not limit.wildcard:
                rate = limit.rate
                window_us = 0 if rate is None else round(rate.seconds * 1_000_000)
                sets.append([(self.key_of(limit.path), str(window_us))])
                continue
            projects = [limit.path.split("/", 1)[0]]
            if projects[0] == "*":
                pattern = f"{_glob_escape(self.prefix)}:{{*}}:[td]:{_glob_escape(limit.path)}"
                found = {_text(key) for key in self.client.scan_iter(match=pattern)}
                projects = sorted({name.split("{", 1)[1].split("}", 1)[0] for name in found})
            named: list[tuple[str, str]] = []
            for project in projects:
                named.append((self.totals_key(limit.path, project), ""))
                named.append((self.delayed_key(limit.path, project), "d"))
            sets.append(named)
        return sets

    def _summed(
        self,
        found: list[tuple[Limit, list[_SetRead]]],
        now_us: int,
        top: int,
        watch: Mapping[str, Collection[str]],
    ) -> dict[str, LimitTotals]:
        """The LimitTotals of each limit from what its sets hold (per set: its name, its
        leases per key, its keys with a live window). The keys shown are the busiest
        ``top`` and the watched ones (an exact limit's own key always); for a rate limit
        one more pipeline reads their window use, and, for a wildcard one, which keys in
        flight have no live window: the live windows' keys when they are the fewer, else
        the window scores of the keys in flight (either way no more than the requests in
        flight)."""
        plans: list[_TotalsPlan] = []
        pipe = self.client.pipeline(transaction=False)
        for limit, per_set in found:
            if len(per_set) == 1:
                held = per_set[0][1]
            else:
                held = Counter()
                for _, counted, _ in per_set:
                    held.update(counted)
            keys = _busiest(held, top)
            listed = {key for key, _ in keys}
            wanted = watch.get(limit.path, ()) if limit.wildcard else (limit.path,)
            watched = [name.encode("utf-8", "surrogateescape") for name in wanted]
            keys += [(key, held.get(key, 0)) for key in watched if key not in listed]
            looks: list[tuple[bool, Counter[bytes]]] = []
            if limit.rate is None:
                # A wildcard's key refused lately is shown with nothing in flight too, as
                # memory and the shared file show it: its adaptive limit, its refusals.
                kept = set(watched) if limit.wildcard else set()
                keys = [(key, count) for key, count in keys if count or key in kept]
            else:
                window_us = round(limit.rate.seconds * 1_000_000)
                for key, _ in keys:
                    name = self.key_of(_text(key))
                    pipe.zcount(name, "-inf", f"({window_us - now_us}")
                    pipe.zrevrangebyscore(
                        name, f"({window_us - now_us}", "-inf", start=0, num=1, withscores=True
                    )
                for name, counted, windowed in per_set if limit.wildcard else ():
                    if not counted:
                        continue
                    by_windows = windowed <= len(counted)
                    if by_windows:  # a window's key scores MINUS when its window ends
                        pipe.zrangebyscore(name, "-inf", f"({-now_us}")
                    else:
                        pipe.zmscore(name, list(counted))  # type: ignore[arg-type]  # bytes go as they are
                    looks.append((by_windows, counted))
            plans.append((held, keys, looks))
        replies = iter(pipe.execute())
        totals: dict[str, LimitTotals] = {}
        for (limit, per_set), (held, keys, looks) in zip(found, plans, strict=True):
            windowed = sum(live for _, _, live in per_set)
            usages: list[KeyUsage] = []
            tracked = len(held)
            if limit.rate is None:
                usages = [KeyUsage(_text(key), count, None, 0.0) for key, count in keys]
            else:
                span_us = limit.rate.seconds * 1_000_000
                for key, count in keys:
                    used = int(next(replies))
                    oldest = next(replies)
                    if not (count or used):
                        continue  # idle: not tracked, as memory lists only keys it tracks
                    resets_in = 0.0
                    if used and oldest:
                        resets_in = max(0.0, (span_us - oldest[0][1] - now_us) / 1e6)
                    usages.append(KeyUsage(_text(key), count, used, resets_in))
                # Keys with a live window, plus those in flight whose window has ended (a
                # limit without a wildcard: its one key, if anything of it is live).
                tracked = windowed if limit.wildcard else int(bool(windowed or held))
                for by_windows, counted in looks:
                    reply = next(replies)
                    if by_windows:
                        tracked += len(counted.keys() - set(reply))
                    else:
                        tracked += sum(1 for score in reply if score is None or score >= -now_us)
            totals[limit.path] = LimitTotals(
                inflight=sum(held.values()), keys=tracked, busy=len(held), top=tuple(usages)
            )
        return totals

    def census(self, now: float) -> Census:
        """Distinct live leases over every key under the prefix, whichever host placed
        them: ``<lease>`` is a request in flight, ``<lease>:d`` a delayed release (see
        ``lua/gate.lua``); window entries score below zero and are not read."""
        leases: set[str] = set()
        for _, members in self._each_key(
            lambda pipe, key, now_us: pipe.zrangebyscore(key, f"({now_us}", _BELOW_BAND)
        ):
            leases.update(_text(member) for member in members)
        delayed = sum(1 for lease in leases if lease.endswith(":d"))
        return Census(len(leases) - delayed, delayed)

    def _each_key(self, command: Callable[[Any, str, int], Any]) -> list[tuple[str, Any]]:
        """``command(pipeline, key, now_us)`` on every limit key under the prefix, in one
        pipeline after a SCAN and after sending the releases still waiting; the (key,
        reply) pairs. Failures are backend errors; a key of another type (someone else's
        under the prefix) is left out, as it is no limit's."""
        pattern = _glob_escape(self.prefix) + ":{*}:z:*"
        replies: list[Any] = []
        with self._reading():
            now_us = self._redis_time()
            keys = sorted({_text(key) for key in self.client.scan_iter(match=pattern, count=1000)})
            if keys:
                pipe = self.client.pipeline(transaction=False)
                for key in keys:
                    command(pipe, key, now_us)
                replies = pipe.execute(raise_on_error=False)
                for reply in replies:
                    if isinstance(reply, Exception) and not _wrong_type(reply):
                        raise reply
        return [
            (key, reply)
            for key, reply in zip(keys, replies, strict=True)
            if not isinstance(reply, Exception)
        ]

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """Around a status read: the releases still waiting are sent first (so none is
        counted as held), the breaker is asked, and any failure is a BackendError."""
        if len(self._outbox):
            self._outbox.flush()
        breaker = self._breaker
        breaker.before()
        try:
            yield
        except Exception as exc:
            breaker.failure(exc)
            raise self.backend_error(exc) from exc
        except BaseException:
            breaker.abandon()
            raise
        breaker.success()

    def _redis_time(self) -> int:
        """Redis ``TIME`` in µs, the clock every score is in."""
        seconds, micros = self.client.time()
        return int(seconds) * 1_000_000 + int(micros)

    def delayed_pending(self, now: float) -> int:
        """Delayed releases this process placed that have not matured yet (best effort:
        other hosts' are not counted; by this process's monotonic clock, as it placed
        them)."""
        delayed = self._delayed
        if not delayed:
            return 0
        now = time.monotonic()
        with self._delayed_lock:
            while delayed and delayed[0] <= now:
                heapq.heappop(delayed)
            return len(delayed)

    def pending_releases(self) -> int:
        """Releases placed in this process that Redis has not confirmed yet."""
        return len(self._outbox)

    def close(self) -> None:
        """Send the releases still waiting (best effort), stop the sender, disconnect."""
        outbox = self._outbox
        for connection in list(self._connections):
            self._repost(connection)  # written, not confirmed: sent again (idempotent)
        try:
            if len(outbox):
                self._breaker.probe_now()
                outbox.flush()
        except BackendError:
            logger.warning(
                "gatekeeper: %d releases could not reach redis at %s before close; "
                "their leases expire after max_hold",
                len(outbox),
                self.location,
            )
        outbox.close()
        _BACKENDS.discard(self)  # tried once: not again at the process's exit
        for connection in list(self._connections):
            connection.disconnect()
        self.client.close()


#: redis-py's URL options it converts with float() / int(): both take what would fail
#: every request later (NaN, infinities, negative numbers), so they are checked first
_SECONDS_OPTIONS = ("socket_timeout", "socket_connect_timeout", "timeout")
_WHOLE_OPTIONS = ("socket_read_size", "max_connections", "health_check_interval")


def _check_options(url: str, query: list[tuple[str, str]]) -> None:
    """ConfigError for an option given twice (one value would win unseen) or for a number
    option of redis-py's that it would take and then fail on (see _SECONDS_OPTIONS)."""
    seen: set[str] = set()
    for name, value in query:
        if name in seen:
            raise ConfigError(
                "backend", f"{name}: given twice in {mask_url(url)[:200]!r}; give it once"
            )
        seen.add(name)
        if name in _SECONDS_OPTIONS:
            _seconds(url, name, {name: value}, 0.0)
        elif name == "encoding" or name == "encoding_errors":
            # Looked up when the first command is encoded (at start-up, a LookupError).
            try:
                (codecs.lookup if name == "encoding" else codecs.lookup_error)(value)
            except LookupError:
                raise ConfigError(
                    "backend",
                    f"{name}: unknown to Python, got {value[:40]!r} in {mask_url(url)[:200]!r}",
                ) from None
        elif name == "client_name" and not (
            value.isascii() and value.isprintable() and " " not in value
        ):
            # Redis refuses it on every connection (CLIENT SETNAME), failing open for good.
            raise ConfigError(
                "backend",
                f"client_name: expected printable ASCII without spaces (Redis refuses any "
                f"other), got {value[:40]!r} in {mask_url(url)[:200]!r}",
            )
        elif name in _WHOLE_OPTIONS and not (
            value.isascii() and value.isdigit() and len(value) < 10
        ):
            raise ConfigError(
                "backend",
                f"{name}: expected a whole number >= 0, got {value[:40]!r} in "
                f"{mask_url(url)[:200]!r}",
            )


def _seconds(
    url: str, name: str, options: dict[str, str], default: float, *, zero: bool = False
) -> float:
    text = options.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if zero else value > 0) or not value < float("inf"):
        bound = ">= 0" if zero else "> 0"
        raise ConfigError(
            "backend",
            f"{name}: expected seconds {bound}, got {text[:40]!r} in {mask_url(url)[:200]!r}",
        )
    return value


_LABELS = {logging.WARNING: "WARNING", logging.INFO: "note", logging.DEBUG: "ok"}


def check_report(url: str, config: Config | None = None) -> str:
    """The line ``gatekeeper check`` prints about a Redis backend: whether its
    ``maxmemory-policy`` can evict limit keys (``WARNING: …``), cannot be told
    (``note: …``) or is ``noeviction`` (``ok: …``)."""
    backend = RedisBackend.from_url(url, config, check=False)
    try:
        level, message = backend.eviction_check()
    finally:
        backend.close()
    return f"{_LABELS[level]}: {message}"


def _policies(reply: object) -> Iterator[str]:
    """The maxmemory-policy values in a CONFIG GET answer: a mapping of one server, or, from
    a Cluster, mappings per node."""
    if isinstance(reply, dict):
        for name, value in reply.items():
            if _text(name) == "maxmemory-policy" and isinstance(value, (bytes, str)):
                yield _text(value)
            else:
                yield from _policies(value)
    elif isinstance(reply, (list, tuple)):
        for item in reply:
            yield from _policies(item)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _raw(value: bytes | str) -> bytes:
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value


#: what each member of a totals set is split at: <lease>|<path>
_BARS = itertools.repeat(b"|")
#: one set a status read read: its name, its leases per key, its keys with a live window
_SetRead = tuple[str, "Counter[bytes]", int]
#: what a status read looks up for one limit: its leases per key, the keys it shows, and
#: per totals set whether it reads the set's live windows (else its keys' scores)
_TotalsPlan = tuple["Counter[bytes]", list[tuple[bytes, int]], list[tuple[bool, "Counter[bytes]"]]]


def _busiest(held: Counter[bytes], top: int) -> list[tuple[bytes, int]]:
    """The ``top`` keys of ``held`` with the most in flight, ties by key, in that order
    (:func:`~gatekeeper_wsgi.backends.base.busiest`)."""
    chosen = busiest(list(held), list(held.values()), top, lambda keys: keys)
    return sorted(((key, held[key]) for key in chosen), key=lambda item: (-item[1], item[0]))
