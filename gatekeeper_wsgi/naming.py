"""How the integrations name a request's project and service: one policy for all of them.

* **Names from code** (Django URL names, namespaces and view paths; Flask endpoints and
  blueprints) are used as they are when they are plain names (``[A-Za-z0-9._:@-]``, at
  most 128 characters). Otherwise every run of other characters becomes ``_`` and the
  name is cut at 128 characters (``views.<locals>.checkout`` ->
  ``views._locals_.checkout``, ``order detail`` -> ``order_detail``): readable, and what
  a limit path in the settings names. :func:`name_segment` does it.
* **Values from requests** (callers, keys, the first path segment of a bare WSGI app) are
  hostile input: one that is not a plain name is replaced by a short stable digest
  (``~3f2a…``), so a request can neither forge a path nor grow a key
  (:func:`gatekeeper_wsgi.resolve.key_segment`).
* A request that resolves to no view (404, 405, a redirect, an untrusted host) is service
  :data:`UNRESOLVED` of the ``project`` setting, in every integration, so a scan of random
  URLs shares one counter instead of making one per path.
"""

from __future__ import annotations

import re

__all__ = ["UNRESOLVED", "name_segment"]

#: The service of a request that no route or URL pattern resolves.
UNRESOLVED = "unresolved"

_NOT_SEGMENT = re.compile(r"[^A-Za-z0-9._:@-]+")
_MAX_SEGMENT = 128


def name_segment(name: str) -> str:
    """A name from code (URL name, namespace, endpoint, blueprint) as a limit path
    segment: runs of characters outside ``[A-Za-z0-9._:@-]`` become ``_``, cut at 128
    characters; an empty name is ``_``."""
    return _NOT_SEGMENT.sub("_", name)[:_MAX_SEGMENT] or "_"
