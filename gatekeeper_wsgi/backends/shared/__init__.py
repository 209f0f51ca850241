"""The host-wide backend: every counter, lease and rate window of all worker processes of
one host in one memory-mapped file, guarded by an open-file-description lock.

``backend = "shared:///run/gatekeeper/shop.shm"``. The package, along the seams of the
table:

- :mod:`.layout`: the byte layout (its table is that module's docstring), its constants
  and struct formats, the sizes derived from a configuration, the header checks;
- :mod:`.files`: opening the file safely (private mode, no symlinks, no planted files);
- :mod:`.filelock`: the file lock and the size check every update makes, without letting
  go of the GIL where they cannot block;
- :mod:`.turns`: the thread lock in front of the file lock, never handed to a thread
  still waiting for the GIL (no line of threads forms on it);
- :mod:`.faults`: what the structures raise (no room for a request, a damaged table);
- :mod:`.journal`: the undo journal (save, commit, rollback, recover) and the one
  transaction context manager every update runs in;
- :mod:`.keys`: the two-choice hash table of keys, the wildcard registry, the LRU lists
  and eviction of idle keys;
- :mod:`.windows`: the rate windows, an exact sliding log per key in chained chunks;
- :mod:`.leases`: the lease table and the binary delay heap of delayed releases;
- :mod:`.gauges`: the adaptive controller of each key of an adaptive limit;
- :mod:`.liveness`: the process slots, whether a lease's owner process is gone, this
  boot's id;
- :mod:`.tickets`: the queues' lines, FIFO across the processes of the host, and their
  wake-ups;
- :mod:`.plans`: the per-request path: an admission (and its release) of slots admitted
  before, by the node offsets found then, while no key has left the table since;
- :mod:`.table`: :class:`~.table.Table`: the file, its map and its locks, attaching,
  initialising, damage and re-creation, a deleted or replaced file followed, fork
  handling, the structures of the current map;
- :mod:`.url`: the ``shared://`` URL and its options;
- :mod:`.reads`: the status reads (in flight, totals, adaptive reports, usage);
- :mod:`.backend`: :class:`SharedBackend`, on the table: the backend contract, admission
  and release composed of the structures above (each works on the map, the layout and
  the journal it is given).
"""

from __future__ import annotations

from gatekeeper_wsgi.backends.shared.backend import SharedBackend
from gatekeeper_wsgi.backends.shared.layout import (
    DEFAULT_KEYS_CAP,
    DEFAULT_LEASES_CAP,
    HEADER,
    MIN_LEASES,
    NODE_HEAD,
    VERSION,
)
from gatekeeper_wsgi.backends.shared.table import LayoutMismatch

__all__ = [
    "DEFAULT_KEYS_CAP",
    "DEFAULT_LEASES_CAP",
    "HEADER",
    "MIN_LEASES",
    "NODE_HEAD",
    "VERSION",
    "LayoutMismatch",
    "SharedBackend",
]
