"""The ``shared://`` URL of a shared table: the file's path and the options that override
what the configuration derives or the default: ``size`` (keys), ``leases``, ``procs``
(process slots) and ``windows`` (rate window chunks), the sizes
:meth:`.layout.Layout.derive` otherwise derives, and ``mode`` (octal), the file's mode
(:func:`.files.check_mode`).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

from gatekeeper_wsgi.backends.shared.files import check_mode
from gatekeeper_wsgi.errors import ConfigError

__all__ = ["parse_url"]

_DECIMAL = re.compile(r"[0-9]{1,11}")
_OCTAL = re.compile(r"[0-7]{1,11}")


def parse_url(url: str) -> tuple[str, dict[str, int]]:
    """The file path and options of a ``shared://`` URL; ConfigError if invalid."""
    parts = urlsplit(url)
    path = parts.netloc + parts.path
    if not path:
        raise ConfigError(
            "backend", f"expected 'shared:///path/to/file', got {url!r} (no file path)"
        )
    options: dict[str, int] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in ("size", "leases", "procs", "windows", "mode"):
            raise ConfigError(
                "backend",
                f"unknown option {name!r} in {url!r}; expected size, leases, procs, windows, mode",
            )
        if name in options:
            raise ConfigError(
                "backend", f"option {name!r} given twice in {url[:200]!r}; give it once"
            )
        # ASCII digits only, as every other number of the configuration (int() would also
        # take "1_000" and non-ASCII digits: SPEC 4.10); at most 11, which bounds int().
        digits = _OCTAL if name == "mode" else _DECIMAL
        number = int(value, 8 if name == "mode" else 10) if digits.fullmatch(value) else 0
        if number < 1 or number >= 1 << 31:
            expected = "an octal mode such as 0660" if name == "mode" else "a positive integer"
            raise ConfigError(
                "backend", f"option {name}={value[:40]!r} in {url[:200]!r}: expected {expected}"
            )
        options[name] = number
    if "mode" in options:
        check_mode(path, options["mode"])
    return path, options
