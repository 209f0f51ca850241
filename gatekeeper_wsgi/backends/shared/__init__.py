"""The host-wide backend: every counter, lease and rate window of all worker processes of
one host in one memory-mapped file, guarded by an open-file-description lock.

``backend = "shared:///run/gatekeeper/shop.shm"``. The package, along the seams of the
table:

- :mod:`.layout`: the byte layout (its table is that module's docstring), its constants
  and struct formats, the sizes derived from a configuration, the header checks;
- :mod:`.files`: opening the file safely (private mode, no symlinks, no planted files);
- :mod:`.liveness`: whether a lease's owner process is gone, this boot's id;
- :mod:`.backend`: :class:`SharedBackend`, the journal, key table, windows, leases, delay
  heap, adaptive gauges and reclaim on top.
"""

from __future__ import annotations

from gatekeeper_wsgi.backends.shared.backend import LayoutMismatch, SharedBackend
from gatekeeper_wsgi.backends.shared.layout import (
    DEFAULT_KEYS_CAP,
    DEFAULT_LEASES_CAP,
    HEADER,
    MIN_LEASES,
    NODE_HEAD,
    VERSION,
)

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
