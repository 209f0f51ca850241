"""The host-wide backend: every counter, lease and rate window of all worker processes of
one host in one memory-mapped file, guarded by one ``flock`` file lock.

``backend = "shared:///run/gatekeeper/shop.shm"``. Linux only (``/proc``). The
table is sized from the configuration when the file is created; ``?size=``, ``?leases=``,
``?procs=`` and ``?windows=`` in the URL override the derived sizes, ``?mode=0660`` lets the
processes of one group share it (:mod:`.url`).

:class:`SharedBackend` is the backend contract composed of the structures of the table:
admission and release here, each a few calls to the key table, the windows, the leases,
the gauges and the lines; the file, map and locks under them are :class:`.table.Table`'s,
the status reads :mod:`.reads`'.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from gatekeeper_wsgi.adaptive import AdaptiveReport
from gatekeeper_wsgi.backends.base import (
    NO_WATCH,
    TOP_KEYS,
    Census,
    Denial,
    Grant,
    LimitTotals,
    Slot,
)
from gatekeeper_wsgi.backends.shared.faults import Damaged, NoRoom
from gatekeeper_wsgi.backends.shared.files import DEFAULT_MODE, check_file
from gatekeeper_wsgi.backends.shared.journal import HEADER_BLOCK
from gatekeeper_wsgi.backends.shared.layout import (
    H_HEAP_LEN,
    H_WAITING,
    MAGIC,
    MAGIC_INIT,
    MAX_REFS,
    NODE_HEAD,
    U32,
)
from gatekeeper_wsgi.backends.shared.plans import Plan
from gatekeeper_wsgi.backends.shared.reads import (
    read_adaptive,
    read_inflight,
    read_totals,
    read_usage,
)
from gatekeeper_wsgi.backends.shared.table import Recreated, Table
from gatekeeper_wsgi.backends.shared.tickets import Lines, Place, SharedLine
from gatekeeper_wsgi.backends.shared.url import parse_url
from gatekeeper_wsgi.config import Config, Limit
from gatekeeper_wsgi.errors import BackendError, CapacityError

__all__ = ["SharedBackend"]

_T = TypeVar("_T")


class _Untracked(Exception):
    """A key could not be tracked, found before anything was counted: what the request
    changed so far (keys found, created or touched, windows purged, busy keys moved down
    the LRU list) is what a Denial keeps too, so it is committed, not rolled back."""

    def __init__(self, error: CapacityError) -> None:
        super().__init__(error.what)
        self.error = error


def _lease_slot(slots: Sequence[Slot]) -> int:
    """The slot a request is refused by when the host-wide lease (or process) table is
    full, which no single limit owns: the most specific enforced concurrency limit (the
    request would hold a slot there), else the most specific enforced limit, else 0."""
    concurrency = enforced = 0
    for index, slot in enumerate(slots):
        if slot.enforce:
            enforced = index
            if slot.limit.concurrency is not None:
                concurrency = index
    if slots and slots[concurrency].enforce and slots[concurrency].limit.concurrency is not None:
        return concurrency
    return enforced


class _SharedGrant(Grant):
    """An admission on the shared table: the lease it holds (index, owner pid, serial, in
    the table of ``epoch``), what its release gives back (nodes, window stamps) and the
    plan it was admitted by, if any."""

    __slots__ = ("admitted", "epoch", "lease", "nodes", "pid", "plan", "sample", "serial", "stamps")

    def __init__(
        self,
        slots: Sequence[Slot],
        shadowed: tuple[int, ...],
        epoch: int,
        pid: int,
        lease: int,
        serial: int,
        nodes: list[int],
        stamps: list[float | None],
    ) -> None:
        Grant.__init__(self, slots, shadowed)  # not super(): ~800 instructions less a grant
        self.epoch = epoch
        self.pid = pid
        self.lease = lease
        self.serial = serial
        self.nodes = nodes
        #: per slot: the window entry reserved at admission (None: no rate / not recorded)
        self.stamps = stamps
        #: when it was admitted (an adaptive limit's latency runs from here)
        self.admitted = 0.0
        #: (faulty, now) of :meth:`SharedBackend.observe`: fed to the adaptive limits by
        #: the release, under the lock that release takes anyway
        self.sample: tuple[bool, float] | None = None
        #: the plan it was admitted by (its release goes by it too); None: not by one
        self.plan: Plan | None = None


class SharedBackend(Table):
    """Counters of all worker processes of a host in one memory-mapped file.

    Use it where a WSGI server runs several worker processes (gunicorn, uWSGI): the limits
    hold for the host, not per process::

        gk = GateKeeper({"backend": "shared:///run/gatekeeper/shop.shm",
                         "limits": {"shop": {"concurrency": 100}}})

    Put the file on a tmpfs, in a directory only the application's user may write
    (``/run/<app>/``, ``$XDG_RUNTIME_DIR``): it is scratch state, and on a disk filesystem
    the kernel would keep writing its pages back. Every process must count time
    by the same clock (the engine's default, ``time.monotonic``, is system-wide on Linux).
    Call :meth:`close` when done (``GateKeeper.close()`` does).

    **Semantics** are those of :class:`~gatekeeper_wsgi.backends.memory.MemoryBackend`:
    all-or-nothing admission, exact concurrency, an exact sliding log per rate key, ``count``
    reservations confirmed or given back at release, shadow slots, delayed decreases,
    ``max_keys`` evicting only idle keys (nothing in flight, nothing left in the rate
    window), looked for among the ``LRU_SCAN`` least recently used.

    **Capacity** is never an outage: when the table cannot track what a request needs (a
    key: both buckets or ``max_keys`` full of keys that are not idle; a lease; a window
    entry; a process slot) ``acquire`` raises :class:`~gatekeeper_wsgi.errors.CapacityError`
    for the slot that could not be tracked, having rolled the request back, and the engine
    refuses it by that limit. The lease and process tables belong to no limit: the most
    specific enforced concurrency slot is blamed (else the most specific enforced slot).

    **Locking, privacy, damage and crash safety** are the table's (:class:`.table.Table`):
    one ``flock`` file lock plus a thread lock around every call, a private file, a damaged
    table re-created, every update an undo-journaled transaction.

    **Leases and reclaim.** Each admission holds a lease: (owner pid, serial, expiry, node
    references). Release deletes it; a delayed decrease makes it ownerless with an expiry
    (a min-heap by expiry matures them during later calls). Leases of processes that died
    are reclaimed whenever a request would be rejected (it is then decided again) and on
    ``inflight()``. *Reclaim time*: none once the dead process is reaped (``kill(pid, 0)``
    fails) - a SIGKILLed gunicorn worker's slots come back before any request is refused
    for lack of them; at most ``DEEP_CHECK_EVERY`` (10 ms) while it is an unreaped zombie,
    or when its pid was reused by a newer process (both are read from ``/proc``, at most
    that often per backend on the rejection path).

    **Totals** for the status page and Prometheus (:meth:`totals`) are read from the live
    leases (each request in flight, held or delayed, holds one) and the wildcard registry's
    key counts: O(limits + leases in use), never a pass over the key table (:mod:`.reads`).

    **Adaptive limits** (``concurrency = "auto"``): one ``adaptive.Controller`` per key,
    kept in the key's gauge next to its counters, so every process of the host feeds one
    window and enforces one limit. An admission reads the limit in force under the lock
    that counts the key (in flight never exceeds it; when it drops, nothing admitted is
    cut off). :meth:`observe` only notes the sample on the grant; :meth:`release` feeds it
    under the lock it takes anyway: in place while no window is due (the window's sums),
    through the whole controller (``Controller.restore``/``state``) when one is.

    **Queues** are FIFO across the processes of the host: one line per concrete limit
    path in the table (``queue.size`` bounds it host-wide), a newcomer refused while the
    line has waiters, only the first waiter admitted; waiters are woken by the release
    that frees their slot, not by polling (:mod:`.tickets`).

    **Layout**: the byte table is :mod:`gatekeeper_wsgi.backends.shared.layout`'s docstring.
    """

    local = False
    delayed_per_process = False
    adaptive_limits = True
    #: a damaged table re-created, a replaced one followed (Table counts them)
    recovers = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config | None = None,
        *,
        size: int | None = None,
        leases: int | None = None,
        procs: int | None = None,
        windows: int | None = None,
        mode: int = DEFAULT_MODE,
    ) -> None:
        self._line = SharedLine(self)
        super().__init__(
            path,
            config,
            size=size,
            leases=leases,
            procs=procs,
            windows=windows,
            mode=mode,
            bell=self._line.bell,
        )

    @classmethod
    def from_url(cls, url: str, config: Config | None = None) -> SharedBackend:
        """``shared:///absolute/path/file`` (or ``shared://relative/path``), with optional
        ``?size=<keys>&leases=<n>&procs=<n>&windows=<chunks>`` overriding the sizes derived
        from ``config`` (a chunk holds 7 rate window entries), and ``?mode=0660`` (octal)
        for a table shared by the processes of one group."""
        path, options = parse_url(url)
        return cls(path, config, **options)

    @classmethod
    def check_url(cls, url: str) -> None:
        """ConfigError for what start-up would refuse, the file too when there is one (a
        symbolic link, a file another user owns or can write, not a table); nothing is
        created."""
        path, options = parse_url(url)
        check_file(path, options.get("mode", DEFAULT_MODE), (MAGIC, MAGIC_INIT))

    # --- public operations ----------------------------------------------------------------

    def acquire(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        return self.acquire_turn(slots, now, None)

    def acquire_turn(self, slots: Sequence[Slot], now: float, turn: Place | None) -> Grant | Denial:
        """:meth:`acquire` for ``turn``, the place of the first waiter of a line
        (:mod:`.tickets`), which lines do not bar: a grant takes it out of its line. Errors
        leave as BackendError, as the transaction wraps them."""
        plans = self._plans
        plan = plans.find(slots) if plans is not None and turn is None else None
        planned = None
        if plan is not None:
            # Made before the lock is taken, under which only its lease is filled in.
            stamps: list[float | None] = [*plan.blank]
            for index in plan.stamped:
                stamps[index] = now
            planned = _SharedGrant(slots, (), 0, self._pid, 0, 0, plan.nodes, stamps)
            planned.plan = plan
        try:
            result, owners = self._locked(slots, now, True, turn, planned)
        except Recreated:  # decided again on the new table
            result, owners = self._locked(slots, now, True)
        if owners and isinstance(result, Denial) and self._reap(owners):
            result, _ = self._locked(slots, now, True, turn)
        return result

    def waiting_line(self) -> SharedLine:
        return self._line

    @contextlib.contextmanager
    def lines(self) -> Iterator[tuple[Lines, int]]:
        """The queues' lines and the table's epoch, under the lock, for
        :class:`.tickets.SharedLine`; what it changed is committed at the end."""
        with self._transaction:
            yield self._lines, self._epoch
            self._journal.commit()

    def waiters(self, path: str) -> list[tuple[int, int]]:
        """(pid, ticket) of the waiters in the line of concrete path ``path``, first first:
        the host's queue of that path."""
        with self.lines() as (lines, _):
            return lines.places(path)

    def peek(self, slots: Sequence[Slot], now: float) -> Denial | None:
        """Whether ``acquire`` would admit now, read atomically: the admission is worked
        out under the lock and rolled back."""
        try:
            result, owners = self._locked(slots, now, False)
        except Recreated:
            result, owners = self._locked(slots, now, False)
        if owners and isinstance(result, Denial) and self._reap(owners):
            result, _ = self._locked(slots, now, False)
        return result if isinstance(result, Denial) else None

    def _locked(
        self,
        slots: Sequence[Slot],
        now: float,
        keep: bool,
        turn: Place | None = None,
        planned: _SharedGrant | None = None,
    ) -> tuple[Grant | Denial, list[tuple[int, int, int]]]:
        """Admit (``keep``) or peek under the lock: (the grant or the denial, the other
        registered processes after a denial, for :meth:`_reap`). ``planned``: the grant
        of an admission by its plan (:mod:`.plans`), tried first, its lease to fill in."""
        found = plans = None
        with self._transaction as mm:
            if planned is not None:
                plans = self._plans
                assert plans is not None and planned.plan is not None
                taken = plans.admit(planned.plan, now, self._pid, self._procs.slot_at)
                if taken is not None:
                    planned.lease, planned.serial = taken
                    planned.epoch = self._epoch
                    self._held += 1
                    return planned, []
            self._mature(mm, now)
            if keep:
                try:
                    self._procs.register()
                except NoRoom as exc:
                    raise self._capacity(_lease_slot(slots), exc) from None
                self._journal.commit()
                if turn is None and U32.unpack_from(mm, H_WAITING)[0]:
                    barred = self._lines.barred(slots)
                    if barred is not None:
                        return barred, []  # a newcomer joins the line instead
            try:
                result = self._admit(slots, now)
            except _Untracked as untracked:
                if keep:
                    self._journal.commit()
                else:
                    self._rollback()
                raise untracked.error from None
            owners = self._procs.owners() if isinstance(result, Denial) else []
            if keep:
                if turn is not None:
                    self._lines.settle(turn, slots, result)
                self._journal.commit()
                if isinstance(result, _SharedGrant):
                    self._held += 1
                    # The next admission of these very slots may go by plan: what it
                    # counts on is read now, the plan is made once the lock is let go.
                    plans = self._plans
                    assert plans is not None
                    found = plans.look(slots, result.nodes)
            else:
                self._rollback()
        if found is not None:
            assert isinstance(result, _SharedGrant) and plans is not None
            result.plan = plans.remember(slots, found)
        return result, owners

    def release(self, grant: Grant, status: int | None, delay: float, now: float) -> None:
        assert isinstance(grant, _SharedGrant)
        if not grant.claim():
            return
        plan = grant.plan
        if plan is not None and (not plan.plain or delay > 0 or grant.sample is not None):
            plan = None  # a window entry to give back, a delay, a sample: the general way
        try:
            with self._transaction as mm:
                if grant.epoch == self._epoch:
                    if plan is not None:
                        # The same epoch is the same table and layout: the plan's offsets
                        # hold. It answers whether delays or waiters are pending.
                        plans = self._plans
                        assert plans is not None
                        pending = plans.release(plan, grant.lease, grant.pid, grant.serial)
                    else:
                        self._release(grant, status, delay, now)
                        self._journal.commit()
                        pending = True
                    if self._held:
                        self._held -= 1
                else:
                    pending = True
                if pending:
                    self._mature(mm, now)
                    if U32.unpack_from(mm, H_WAITING)[0]:
                        self._lines.announce(grant.slots)
        except Recreated:
            pass  # the new table does not hold the grant

    def inflight(self, now: float) -> dict[str, int]:
        return self._observed(now, lambda: read_inflight(self._keys))

    def totals(
        self,
        limits: Sequence[Limit],
        now: float,
        *,
        top: int = TOP_KEYS,
        watch: Mapping[str, Collection[str]] = NO_WATCH,
    ) -> dict[str, LimitTotals]:
        """Per limit, from the wildcard registry's key counts and the keys in flight
        (:func:`.reads.read_totals`): nothing per key tracked, and no object per key in
        flight but for the ones shown."""
        return self._observed(
            now,
            lambda: read_totals(self._keys, self._leases, self._windows, limits, now, top, watch),
        )

    def _observed(self, now: float, read: Callable[[], _T]) -> _T:
        """``read()`` under the lock, once due delays are applied and the leases of dead
        processes reclaimed (again on a table that had to be re-created)."""
        try:
            return self._observe(now, read)
        except Recreated:
            return self._observe(now, read)

    def _observe(self, now: float, read: Callable[[], _T]) -> _T:
        with self._transaction as mm:
            self._mature(mm, now)
            owners = self._procs.owners()
        self._reap(owners, deep=True)
        with self._transaction:
            return read()

    def next_due(self) -> float | None:
        try:
            with self._reading:
                return self._leases.next_due()
        except BackendError:
            return None  # the table cannot be reached: nothing is known to be due

    def delayed_pending(self, now: float) -> int:
        try:
            # A lambda, not the bound method: the transaction may map the table again
            # (another process re-created it), and the read must be of the new map's
            # leases - the old ones' map is closed, which read as damage and re-created
            # the table under every process's counts.
            return self._observed(now, lambda: self._leases.pending())
        except BackendError:
            return 0

    def census(self, now: float) -> Census:
        self.inflight(now)  # matures due delays and reclaims dead processes' leases first
        usage = self.usage()
        # A live lease is a request in flight or a delayed release still holding its slots.
        return Census(usage["leases"] - usage["delayed"], usage["delayed"])

    def usage(self) -> dict[str, Any]:
        """How full the table is: keys, leases, delayed releases, queue waiters (of every
        line), processes, file size."""
        with self._transaction as mm:
            layout = self._layout
            assert layout is not None
            return read_usage(self.path, mm, layout, self._procs)

    # --- admission ------------------------------------------------------------------------

    def _admit(self, slots: Sequence[Slot], now: float) -> Grant | Denial:
        mm = self._mm
        assert mm is not None
        nodes_off = self._nodes_off
        node_size = self._node_size
        nodes: list[int] = []
        shadowed: list[int] = []
        rate_full: list[int] = []
        adaptive = False
        keys = self._keys
        for index, (key, limit, enforce) in enumerate(slots):
            try:
                entry = keys.key(key)
                node = keys.find(entry)
                if node < 0:
                    node = keys.create(entry, limit, now, nodes)
                elif limit.wildcard:
                    keys.touch(node, limit, now, nodes)
            except NoRoom as exc:
                raise _Untracked(self._capacity(index, exc)) from None
            offset = nodes_off + node * node_size
            concurrency: float | None = limit.concurrency
            if limit.adaptive is not None:
                # Read under the lock that counts the key: the limit in force, one for all
                # processes (it may have dropped below what is in flight: nothing is cut
                # off, nothing more is admitted until it is below).
                concurrency = self._gauges.limit(node, key, limit.adaptive, now)
                adaptive = True
            if (
                concurrency is not None
                and (inflight := U32.unpack_from(mm, offset)[0]) >= concurrency
            ):
                held = self._leases.counted()
                if inflight > held:
                    # Every request in flight holds a lease: a key counting more than the
                    # table holds is garbage no process writes, which would refuse its limit
                    # forever (SPEC 4.6: a damaged table is re-created). Looked at only when
                    # a limit is full, off the path that admits.
                    raise Damaged(
                        f"key {key[:200]!r} counts {inflight} requests in flight, more than "
                        f"the {held} leases held"
                    )
                if enforce:
                    return Denial(index, "concurrency", self._leases.soonest(node, now))
                shadowed.append(index)
            rate = limit.rate
            if rate is not None:
                cutoff = now - rate.seconds
                length, oldest = self._windows.purge(node, cutoff)
                if length >= rate.limit:
                    if enforce:
                        return Denial(index, "rate", oldest - cutoff)
                    if index not in shadowed:
                        shadowed.append(index)
                    rate_full.append(index)
            nodes.append(node)
        if len(nodes) > MAX_REFS:
            raise BackendError(f"a request may hold at most {MAX_REFS} slots, got {len(nodes)}")
        pid = self._pid
        stamps: list[float | None] = []
        # Every admission raises its nodes' counts and takes a lease (header counters).
        ranges = [(nodes_off + node * node_size, NODE_HEAD) for node in nodes]
        ranges.append(HEADER_BLOCK)
        self._journal.save_all(ranges)
        for index, node in enumerate(nodes):
            offset = nodes_off + node * node_size
            U32.pack_into(mm, offset, U32.unpack_from(mm, offset)[0] + 1)
            rate = slots[index].limit.rate
            # Shadow over concurrency still counts in the window; only a full window is
            # not extended (as enforce mode would not have admitted).
            if rate is not None and index not in rate_full:
                try:
                    self._windows.append(node, now, rate.seconds)
                except NoRoom as exc:
                    raise self._capacity(index, exc) from None
                stamps.append(now)
            else:
                stamps.append(None)
        try:
            lease, serial = self._leases.new(pid, nodes)
        except NoRoom as exc:
            raise self._capacity(_lease_slot(slots), exc) from None
        grant = _SharedGrant(slots, tuple(shadowed), self._epoch, pid, lease, serial, nodes, stamps)
        if adaptive:
            grant.adaptive = True
            grant.admitted = now
        return grant

    def _capacity(self, index: int, exc: NoRoom) -> CapacityError:
        """The CapacityError for slot ``index`` (the caller rolls the update back)."""
        return CapacityError(
            index,
            f"shared table {self.path}: {exc.what}",
            retry_after=1.0 if exc.retry_after is None else max(exc.retry_after, 0.001),
            kind=exc.kind,
        )

    # --- adaptive limits: one controller per key, in its node's gauge ---------------------

    def observe(self, grant: Grant, faulty: bool, now: float) -> None:
        """Keep the sample on the grant: its release, which follows, feeds it under the
        lock it takes anyway (one lock round trip per release, not two)."""
        assert isinstance(grant, _SharedGrant)
        grant.sample = (faulty, now)

    def adaptive(self, keys: Collection[str] | None = None) -> dict[str, AdaptiveReport]:
        return self._observed(0.0, lambda: read_adaptive(self._keys, self._gauges, keys))

    def adaptive_limit(self, key: str, limit: Limit) -> int:
        spec = limit.adaptive
        assert spec is not None
        try:
            with self._reading:
                node = self._keys.find(self._keys.key(key))
                current = None if node < 0 else self._gauges.current(node, key, spec)
        except (BackendError, NoRoom, Damaged):
            return spec.initial
        return spec.initial if current is None else current

    # --- leases ---------------------------------------------------------------------------

    def _release(self, grant: _SharedGrant, status: int | None, delay: float, now: float) -> None:
        leases = self._leases
        if not leases.holds(grant.lease, grant.pid, grant.serial):
            return  # reclaimed meanwhile (its owner was taken for dead)
        sample = grant.sample
        if sample is not None:
            gauges = self._gauges
            # The lease still holds its nodes: none was evicted or reused meanwhile.
            for index, slot in enumerate(grant.slots):
                spec = slot.limit.adaptive
                if spec is not None:
                    gauges.sample(grant.nodes[index], slot.key, spec, grant.admitted, *sample)
        for index, stamp in enumerate(grant.stamps):
            if stamp is None:
                continue
            limit = grant.slots[index].limit
            if limit.count is not None and status not in limit.count and limit.rate is not None:
                self._windows.give_back(grant.nodes[index], stamp, limit.rate.seconds)
        if delay > 0:
            leases.delay(grant.lease, grant.serial, now + delay)
        else:
            leases.free(grant.lease)

    def _mature(self, mm: mmap.mmap, now: float) -> None:
        """Apply the delayed releases that are due; each one is its own transaction."""
        # On every admission and release: the heap's length read here, at its offset in
        # the header, saves a call while nothing is delayed (the common case).
        if not U32.unpack_from(mm, H_HEAP_LEN)[0]:
            return
        leases = self._leases
        if not leases.due(now):
            return
        started = time.perf_counter()
        leases.mature(now)
        if self.delay_stage is not None:
            self.delay_stage.record(time.perf_counter() - started)
