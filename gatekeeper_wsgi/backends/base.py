"""The interface every counter backend implements, and the values it trades in.

A backend keeps, per concrete limit path (``shop/login/alice``), the number of requests in
flight and the rolling window of a rate limit. The engine hands it the *slots* of one
request — one per applicable limit — and the backend admits on all of them or on none,
atomically (SPEC §4.1). Each admission is a *lease*: releasing deletes it, a delayed
decrease moves its expiry, and a crashed holder's lease is reclaimed (shared, Redis).

The whole contract is :class:`Backend`: how the registry builds one (:meth:`Backend.from_url`),
what every backend must answer (``acquire``, ``release``, ``inflight``), and the optional
extras with their defaults, so that callers never probe for an attribute: per-limit
totals (:meth:`Backend.totals`, so a status read or scrape costs O(limits), not O(tracked
keys)), adaptive limits, :meth:`Backend.census`, :meth:`Backend.usage`. The value types
a backend counts (``Slot``, ``Limit``) come from the leaf :mod:`gatekeeper_wsgi.values`.

Errors are wrapped once, here: every contract method a backend defines is guarded when
its class is created (``Backend.__init_subclass__``, as limits' storage base does), so
whatever goes wrong inside a backend leaves it as a
:class:`~gatekeeper_wsgi.errors.BackendError` naming the store (:attr:`Backend.label`),
secrets masked, and the engine applies ``on_backend_error`` instead of answering 500.
A backend that must tidy up first (the shared table rolls its journal back) does so in its
own ``except`` and re-raises; code that needs the wrapped error before the method returns
(Redis's release sender) builds it with :meth:`Backend.backend_error`. The engine's hot
path alone calls ``acquire`` and ``release`` past their guards (:func:`unguarded`, a frame
less on every admission and release) and wraps by the same rule where it catches.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import inspect
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from gatekeeper_wsgi.adaptive import AdaptiveReport
from gatekeeper_wsgi.errors import BackendError, CapacityError, escape_controls
from gatekeeper_wsgi.monitor import Stage
from gatekeeper_wsgi.redact import mask_text
from gatekeeper_wsgi.values import Limit, LimitKind, Slot

if TYPE_CHECKING:
    from gatekeeper_wsgi.config import Config

__all__ = [
    "NO_WATCH",
    "TOP_KEYS",
    "Backend",
    "Census",
    "Denial",
    "Grant",
    "KeyUsage",
    "LimitTotals",
    "Slot",
    "WaitingLine",
    "busiest",
    "unguarded",
]

#: Concrete keys :meth:`Backend.totals` details per limit by default (the busiest).
TOP_KEYS = 50

#: No keys to watch (the default of :meth:`Backend.totals`).
NO_WATCH: Mapping[str, Collection[str]] = MappingProxyType({})

_Item = TypeVar("_Item")


def busiest(
    items: list[_Item], counts: list[int], top: int, keys_of: Callable[[list[_Item]], Sequence[Any]]
) -> list[_Item]:
    """The ``top`` of ``items`` with the highest ``counts`` (one per item), ties by key, in
    no order (the caller sorts the few it shows). Without a Python step per item for a
    key function, and reading the keys (``keys_of``: those of a list of items, in order)
    only of the items tied at the cut: with 100 000 keys in flight at one request each, a
    status read picks its ``top`` without an object per key."""
    if top <= 0:
        return []
    if len(items) <= top:
        return list(items)
    cut = heapq.nlargest(top, counts)[-1]
    chosen = [item for item, count in zip(items, counts, strict=True) if count > cut]
    tied = [item for item, count in zip(items, counts, strict=True) if count == cut]
    keys = keys_of(tied)
    least = heapq.nsmallest(top - len(chosen), range(len(tied)), key=keys.__getitem__)
    return chosen + [tied[index] for index in least]


#: The methods of the contract whose failures leave a backend as a BackendError. Not
#: ``from_url`` / ``check_url``: refusing a URL is a ConfigError, and they run at start-up.
GUARDED = (
    "acquire",
    "release",
    "peek",
    "inflight",
    "totals",
    "observe",
    "adaptive",
    "adaptive_limit",
    "census",
    "usage",
    "next_due",
    "delayed_pending",
    "multiprocess",
    "close",
)

#: What leaves a backend unwrapped: its own verdicts, already in the contract's terms.
PASSING = (BackendError, CapacityError)

_Method = TypeVar("_Method", bound=Callable[..., Any])

# The guard of a method whose parameters are all plain positional ones has that very
# signature: calling it costs one frame (~30 ns), where ``*args, **kwargs`` would pack and
# unpack the arguments on every admission and release (~250 ns, measured on 3.11).
_FIXED_GUARD = """\
def {name}(self, {params}):
    try:
        return method(self, {params})
    except PASSING:
        raise
    except Exception as exc:
        raise self.backend_error(exc) from exc
"""


def guard(method: _Method) -> _Method:
    """``method`` of a backend, raising :meth:`Backend.backend_error` for whatever it
    raises that is not a :data:`PASSING` error (``KeyboardInterrupt`` and the like pass
    too: they are not failures of the store)."""
    if getattr(method, "__gatekeeper_guarded__", False):
        return method
    parameters = list(inspect.signature(method).parameters.values())[1:]
    if parameters and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty for p in parameters
    ):
        namespace: dict[str, Any] = {"method": method, "PASSING": PASSING}
        source = _FIXED_GUARD.format(
            name=method.__name__, params=", ".join(p.name for p in parameters)
        )
        # A template filled with parameter names only, as dataclasses builds __init__.
        exec(source, namespace)
        guarded = namespace[method.__name__]
    else:

        def guarded(self: Backend, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except PASSING:
                raise
            except Exception as exc:
                raise self.backend_error(exc) from exc

    functools.update_wrapper(guarded, method)
    guarded.__gatekeeper_guarded__ = True
    return guarded  # type: ignore[no-any-return]


def unguarded(backend: Backend, name: str) -> Callable[..., Any]:
    """``backend``'s method ``name`` as its class wrote it, bound, without the guard: for a
    caller that wraps what it raises itself, as the guard would (a :data:`PASSING` error
    as it is, anything else by :meth:`Backend.backend_error`)."""
    method = getattr(type(backend), name)
    return types.MethodType(getattr(method, "__wrapped__", method), backend)


class Denial(NamedTuple):
    """Why ``acquire`` refused: the first enforcing slot that did not fit."""

    at: int  #: position of the refusing slot in the slots given
    kind: LimitKind  #: ``"concurrency"`` or ``"rate"``
    retry_after: float  #: seconds until a retry may succeed (>= 0)


class KeyUsage(NamedTuple):
    """What one concrete key of a limit holds now."""

    key: str  #: the concrete path, e.g. ``shop/login/10.0.0.7``
    inflight: int  #: requests in flight (delayed releases included)
    #: admissions inside its rate window now; None when the limit has no rate
    used: int | None
    #: seconds until the oldest of those leaves the window (0 when ``used`` is 0 or None)
    resets_in: float


class LimitTotals(NamedTuple):
    """One configured limit's state summed over its concrete keys."""

    inflight: int  #: requests in flight, summed over its keys
    keys: int  #: concrete keys tracked (1 for a limit without ``*`` once it was used)
    busy: int  #: keys with requests in flight
    #: details of its busiest keys (most in flight first), then of the watched ones
    top: tuple[KeyUsage, ...]


class Census(NamedTuple):
    """Who holds slots right now, across every process the backend spans."""

    #: admitted requests not released yet, each counted once whatever its number of levels
    requests: int
    #: faulty responses released with a delay whose slots are still held
    delayed: int


class Grant:
    """What a backend returns for an admission; release it exactly once.

    ``shadowed`` lists the indexes of shadow slots that were over their limit;
    ``adaptive`` is True when a slot's limit is adaptive, so the engine reports the
    request's latency through :meth:`Backend.observe`. Backends subclass it to carry their
    lease, and begin ``release`` with ``if not grant.claim(): return``, so a second release
    does nothing.
    """

    __slots__ = ("_unclaimed", "adaptive", "shadowed", "slots")

    def __init__(self, slots: Sequence[Slot], shadowed: tuple[int, ...] = ()) -> None:
        self.slots = slots
        self.shadowed = shadowed
        self.adaptive = False
        self._unclaimed = [True]

    def claim(self) -> bool:
        """True for the first caller only, however many threads race: taking the one item
        of a list is a single step, under the GIL as under the list's own lock on a
        free-threaded build, where a check of a flag then a store could both pass."""
        try:
            self._unclaimed.pop()
        except IndexError:
            return False
        return True


TicketT = TypeVar("TicketT")


class WaitingLine(ABC, Generic[TicketT]):
    """The waiters of the limits with a ``queue``, one line per concrete limit path, in the
    order they came (SPEC §4.4): only the first of a line may take the slots it waits for.

    The engine keeps a line per process unless its backend offers one that spans the
    backend's processes (:meth:`Backend.waiting_line`: the shared file keeps the line of
    the host). A ticket is a waiter's place; the engine's wait loop is::

        ticket = line.join(key, size)          # None: the line is full
        try:
            while (result := line.admit(ticket, slots, now)) is not a Grant:
                line.sleep(ticket, timeout)    # a release, the waiter ahead left, a timeout
        finally:
            line.leave(ticket)
    """

    @abstractmethod
    def join(self, key: str, size: int) -> TicketT | None:
        """A place at the end of the line of concrete path ``key``; None when ``size``
        waiters hold one already (or the line has no room for another waiter)."""

    @abstractmethod
    def admit(self, ticket: TicketT, slots: Sequence[Slot], now: float) -> Grant | Denial | None:
        """Acquire ``slots`` (as :meth:`Backend.acquire`, CapacityError included) if
        ``ticket`` is first in its line: a grant takes it out of the line. None while it
        is not its turn."""

    @abstractmethod
    def sleep(self, ticket: TicketT, timeout: float) -> None:
        """Block until the turn of ``ticket`` may have come (a release, a waiter ahead
        left or died), at most ``timeout`` seconds."""

    @abstractmethod
    def leave(self, ticket: TicketT) -> None:
        """Give the place up (admitted, timed out, refused); nothing if it was left."""

    def wake(self) -> None:
        """Told after a release while this process has waiters."""

    def nudge(self) -> None:
        """Told, while this process has waiters, that a response was collected unclosed:
        its release is left for them to make (the engine's wait loop looks
        before each try). Called by the garbage collector, perhaps inside a lock: never
        waits for one. A line whose waiters look again by themselves now and then (a
        backend that is not local) may leave it to them, as this does."""


class Backend(ABC):
    """A counter store. Methods raise :class:`~gatekeeper_wsgi.errors.BackendError` when
    the store fails; the engine then applies ``on_backend_error``."""

    #: True when every contender lives in this process, so a local release is the only
    #: event that frees a slot and waiters need no polling.
    local = True
    #: Seconds between retries of a queued request when ``local`` is False.
    poll_interval = 0.005
    #: Where the engine wants the time spent maturing delayed releases recorded.
    delay_stage: Stage | None = None
    #: True when :meth:`delayed_pending` counts only the delayed releases this process
    #: placed (a multiprocess Prometheus exporter then adds the workers up), False when
    #: every process reads the one count of the whole store (the shared file).
    delayed_per_process = True
    #: True when the backend enforces an adaptive limit's current value (``observe``,
    #: ``adaptive``); a backend without it enforces ``adaptive.max`` (the engine warns).
    adaptive_limits = False
    #: Failures the backend met and recovered from by itself, having logged an ERROR (a
    #: damaged shared table re-created, a replaced one followed): the engine counts each
    #: in ``backend_errors`` and applies ``on_backend_error`` to the admission that sees
    #: it (SPEC 4.6). Only looked at when ``recovers`` says the backend has any.
    incidents = 0
    recovers = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Guard the contract methods the subclass defines (see :func:`guard`)."""
        super().__init_subclass__(**kwargs)
        for name in GUARDED:
            method = cls.__dict__.get(name)
            if callable(method):
                setattr(cls, name, guard(method))

    @property
    def label(self) -> str:
        """What names this store in an error message (``shared table '/run/gk.shm'``,
        ``redis at 10.0.0.5:6379``): its kind by default."""
        return type(self).__name__

    def backend_error(self, exc: Exception) -> BackendError:
        """The one wrapping of a failure inside this backend: a :class:`BackendError`
        naming the store and what went wrong, with URL passwords and ``password=`` values
        masked and control characters escaped (library messages quote URLs and data)."""
        what = type(exc).__name__
        said = escape_controls(mask_text(str(exc)))
        error = BackendError(f"{self.label}: {what}: {said}" if said else f"{self.label}: {what}")
        error.__cause__ = exc
        return error

    @classmethod
    def from_url(cls, url: str, config: Config | None = None) -> Backend:
        """The backend a URL of its scheme names (the registry calls this). ``config``, when
        given, lets it size itself before the first request (``max_keys``, rate limits:
        the shared table's size). The default takes no address and no options (memory)."""
        return cls()

    @abstractmethod
    def acquire(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        """Take a slot at every limit, or at none and say which refused."""

    @abstractmethod
    def release(self, grant: Grant, status: int | None, delay: float, now: float) -> None:
        """Give the slots back, after ``delay`` seconds when > 0. Rate reservations of
        limits with ``count`` statuses are confirmed when ``status`` is listed, else
        returned at once."""

    def peek(self, slots: Sequence[Slot], now: float) -> Denial | None:
        """Whether :meth:`acquire` would admit ``slots`` now: None if so, else the Denial
        it would give. Leaves no trace in the counts.

        This default acquires and gives back at once, with every rate reservation returned
        (``count`` set to no status at all, so no ``release`` status confirms it). The
        answer is exact, but for that instant the probe holds its slots, so a concurrent
        ``acquire`` may be refused because of it. Backends that can read their counts
        atomically override it.
        """
        probe = [
            slot
            if slot.limit.rate is None
            else slot._replace(limit=dataclasses.replace(slot.limit, count=frozenset()))
            for slot in slots
        ]
        result = self.acquire(probe, now)
        if isinstance(result, Denial):
            return result
        self.release(result, None, 0.0, now)
        return None

    @abstractmethod
    def inflight(self, now: float) -> dict[str, int]:
        """Requests in flight per concrete path (due delayed releases applied first)."""

    def totals(
        self,
        limits: Sequence[Limit],
        now: float,
        *,
        top: int = TOP_KEYS,
        watch: Mapping[str, Collection[str]] = NO_WATCH,
    ) -> dict[str, LimitTotals] | None:
        """Per path of ``limits`` (those with a concurrency or rate): its totals, and the
        :class:`KeyUsage` of up to ``top`` of its busiest keys plus the keys listed in
        ``watch[path]`` that it tracks (e.g. keys refused lately, locked out by a rate
        limit with nothing in flight). Due delayed releases are applied first.

        Backends that keep the totals as they count (memory, shared, Redis) answer in
        O(limits + keys in flight + watched keys), however many keys they track, so a
        status read or a scrape cannot stall admissions. This default returns None: the
        caller then derives what it can from :meth:`inflight` (O(tracked keys)).
        """
        return None

    def observe(self, grant: Grant, faulty: bool, now: float) -> None:  # noqa: B027
        """Feed the adaptive limits of a grant (``grant.adaptive``) the request's latency,
        just before its :meth:`release`. Only backends that set ``adaptive`` are asked."""

    def adaptive(self, keys: Collection[str] | None = None) -> dict[str, AdaptiveReport]:
        """``{concrete path: {"limit", "latency_ms", "min_latency_ms"}}`` of the adaptive
        limits in use (``gk.stats()["adaptive"]``); with ``keys``, of those concrete paths
        only, at a cost of O(keys asked) (a status read: not one report per key tracked)."""
        return {}

    def adaptive_limit(self, key: str, limit: Limit) -> int:
        """The current value of an adaptive ``limit`` at concrete path ``key`` (the value
        in its faults); ``initial`` until the backend has learned one."""
        assert limit.adaptive is not None
        return limit.adaptive.initial

    def adaptive_reports(self, wanted: Mapping[str, Limit]) -> dict[str, AdaptiveReport]:
        """Reports of the adaptive limits at the concrete paths of ``wanted`` (each with
        the limit governing it) that :meth:`adaptive` does not report (a path this process
        never admitted on, whose limit other hosts may have moved): by default each one's
        :meth:`adaptive_limit`, without latencies. A backend that stores the controller's
        state reads the latencies too."""
        return {
            path: {
                "limit": self.adaptive_limit(path, limit),
                "latency_ms": 0.0,
                "min_latency_ms": 0.0,
            }
            for path, limit in wanted.items()
        }

    def census(self, now: float) -> Census | None:
        """Requests in flight and delayed releases of the whole backend (every process and
        host it spans), for ``gatekeeper status``; None when it cannot tell. Not on the
        request path: it may cost O(leases)."""
        return None

    def usage(self) -> dict[str, Any] | None:
        """How full the backend's own capacity is (keys, leases, window entries... and
        their capacities, for ``gatekeeper status`` and capacity planning); None when it
        has no fixed capacity to report. Not on the request path."""
        return None

    @classmethod
    def check_url(cls, url: str) -> None:
        """Raise :class:`~gatekeeper_wsgi.errors.ConfigError` for a URL this backend would
        refuse at start-up, by the same parsing, without creating or connecting to
        anything (``gatekeeper check``). The default accepts every URL of its scheme."""
        return None

    def waiting_line(self) -> WaitingLine[Any] | None:
        """The line of the queues across every process this backend spans, or None (the
        default): the engine then keeps one line per process, FIFO among its waiters."""
        return None

    def next_due(self) -> float | None:
        """When the next delayed release matures (engine clock), if known."""
        return None

    def delayed_pending(self, now: float) -> int:
        """How many delayed releases have not matured by ``now`` (the engine's clock): due
        ones are applied first, or left out of the count."""
        return 0

    def reconfigure(self, config: Config) -> None:  # noqa: B027 - most follow by themselves
        """Told when a reloaded ``config`` is swapped in (under no lock of the backend's):
        a backend that keeps per-limit state of its own keeps it in step (the memory
        backend's wildcard key tables)."""

    def multiprocess(self) -> None:  # noqa: B027 - only per-process backends care
        """Told once that the server runs the app in several processes (PEP 3333
        ``wsgi.multiprocess``). Per-process backends warn that limits are per process."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release resources (files, connections)."""
