"""What the status page, Prometheus and ``gatekeeper status`` read from a shared table:
the requests in flight per key, the totals of each limit, the adaptive reports, how full
the table is.

Functions of the structures of one map, called under the table's lock (the backend's
``_observed``, once due delays are applied and dead processes' leases reclaimed); they
change nothing. The totals come from the wildcard registry's key counts and the keys in
flight: those of the leases in use while they are few (O(limits + leases in use + watched
keys), nothing per key tracked), else a pass over the table's node columns in C; no object
is made per key in flight but for the few shown.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Mapping, Sequence
from itertools import compress
from typing import Any

from gatekeeper_wsgi.adaptive import AdaptiveReport
from gatekeeper_wsgi.backends.base import KeyUsage, LimitTotals, busiest
from gatekeeper_wsgi.backends.shared.faults import NoRoom
from gatekeeper_wsgi.backends.shared.gauges import Gauges
from gatekeeper_wsgi.backends.shared.keys import KeyTable, path_digest
from gatekeeper_wsgi.backends.shared.layout import H_LIVE, H_WAITING, U32, Layout, NodeView
from gatekeeper_wsgi.backends.shared.leases import Leases
from gatekeeper_wsgi.backends.shared.liveness import Processes
from gatekeeper_wsgi.backends.shared.windows import Windows
from gatekeeper_wsgi.config import Limit

__all__ = ["read_adaptive", "read_inflight", "read_totals", "read_usage"]

#: a key the totals show: (key, node, its fields)
_Held = tuple[str, int, NodeView]
#: what reading the nodes of one lease in use costs, in nodes of the table read by
#: columns (measured with 1 000 to 100 000 leases in a table of 600 000 nodes: 1.2 to
#: 1.5 µs a lease against 0.11 µs a node)
LEASE_READ = 12


def read_inflight(keys: KeyTable) -> dict[str, int]:
    """Requests in flight of every key the table holds."""
    nodes, counts, _ = keys.held(idle=True)
    texts = (raw.decode("utf-8", "surrogateescape") for raw in keys.raw_keys(nodes))
    return dict(zip(texts, counts, strict=True))


def read_totals(
    keys: KeyTable,
    leases: Leases,
    windows: Windows,
    limits: Sequence[Limit],
    now: float,
    top: int,
    watch: Mapping[str, Collection[str]],
) -> dict[str, LimitTotals]:
    """Per limit: requests in flight, keys tracked, keys busy, and the ``top`` busiest
    keys with the ``watch`` ones (see ``Backend.totals``)."""
    # registry entry -> keys it tracks, and digest -> entry
    tracked: dict[int, int] = {}
    entry_of: dict[int, int] = {}
    for index, digest, count in keys.registries():
        tracked[index] = count
        entry_of[digest] = index
    # registry entry -> its keys in flight: their nodes and counts, two lists of ints
    # picked in C (no object per key: see KeyTable.held). The nodes of the leases in use
    # when they are few (a status read costs nothing per key tracked), else a pass over
    # the table's columns, a fraction of a microsecond per node.
    among = leases.held_nodes() if leases.counted() * LEASE_READ < keys.capacity else None
    nodes, counts, registries = keys.held(among)
    busy: dict[int, tuple[list[int], list[int]]] = {}
    for registry in set(registries) - {0}:
        chosen = [each == registry for each in registries]
        busy[registry - 1] = (list(compress(nodes, chosen)), list(compress(counts, chosen)))
    found_totals = {}
    for limit in limits:
        path = limit.path
        entry = entry_of.get(path_digest(path)) if limit.wildcard else None
        if limit.wildcard:
            key_nodes, key_counts = busy.get(entry, ([], [])) if entry is not None else ([], [])
            shown = _busiest(keys, key_nodes, key_counts, top)
            count = tracked.get(entry, 0) if entry is not None else 0
            inflight, keys_busy = sum(key_counts), len(key_counts)
        else:
            found = _lookup(keys, path)
            shown = [] if found is None else [found]
            count = len(shown)
            inflight = found[2].inflight if found is not None else 0
            keys_busy = 1 if inflight else 0
        seen = {key for key, _, _ in shown}
        for key in watch.get(path, ()):
            found = _lookup(keys, key) if key not in seen else None
            if found is not None and (entry is None or found[2].registry == entry + 1):
                seen.add(key)
                shown.append(found)
        found_totals[path] = LimitTotals(
            inflight=inflight,
            keys=count,
            busy=keys_busy,
            top=tuple(_key_usage(windows, held, limit, now) for held in shown),
        )
    return found_totals


def _busiest(keys: KeyTable, nodes: list[int], counts: list[int], top: int) -> list[_Held]:
    """The ``top`` keys of ``nodes`` with the most in flight (``counts``), ties by key, in
    that order (:func:`~gatekeeper_wsgi.backends.base.busiest`; ties at the cut compared
    as the table holds the keys, UTF-8 bytes: the order of their text)."""
    chosen = busiest(nodes, counts, top, keys.raw_keys)
    found = [(*keys.view(node), node) for node in chosen]
    found.sort(key=lambda item: (-item[0].inflight, item[1]))
    return [(key, node, view) for view, key, node in found]


def read_adaptive(
    keys: KeyTable, gauges: Gauges, wanted: Collection[str] | None = None
) -> dict[str, AdaptiveReport]:
    """The report of every gauge in use, found through the key table's tags (of the keys
    ``wanted`` only, each looked up, when given): the limit, latency and baseline (under
    the table the state was last made with)."""
    reports = {}
    if wanted is not None:
        for key in wanted:
            found = _lookup(keys, key)
            report = None if found is None else gauges.report(found[1])
            if report is not None:
                reports[key] = report
        return reports
    for node in keys.in_use():
        report = gauges.report(node)
        if report is not None:
            reports[keys.view(node)[1]] = report
    return reports


def read_usage(path: str, mm: mmap.mmap, layout: Layout, procs: Processes) -> dict[str, Any]:
    """How full the table is: keys, leases, delayed releases, queue waiters (of every
    line), processes, file size."""
    live, _, _, heap_len, _, _, nodes_used = struct.unpack_from("<7I", mm, H_LIVE)
    return {
        "path": path,
        "keys": nodes_used,
        "key_capacity": layout.nodes,
        "leases": live,
        "lease_capacity": layout.leases,
        "delayed": heap_len,
        "waiting": U32.unpack_from(mm, H_WAITING)[0],
        "waiter_capacity": layout.waiters,
        "processes": sorted(procs.pids()),
        "bytes": layout.total,
    }


def _lookup(keys: KeyTable, key: str) -> _Held | None:
    """(key, node, its fields) of a key the table holds, else None."""
    try:
        node = keys.find(keys.key(key))
    except NoRoom:  # longer than any key the table can hold
        return None
    return None if node < 0 else (key, node, keys.view(node)[0])


def _key_usage(windows: Windows, held: _Held, limit: Limit, now: float) -> KeyUsage:
    """A key's requests in flight and its window's use now, read without changing it."""
    key, node, view = held
    rate = limit.rate
    if rate is None:
        return KeyUsage(key, view.inflight, None, 0.0)
    left, until = windows.usage(node, now - rate.seconds)
    return KeyUsage(key, view.inflight, left, until)
