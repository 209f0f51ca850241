"""``gatekeeper check``: validate a configuration and print its effective limit tree."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from gatekeeper_wsgi.backends import check_backend_url
from gatekeeper_wsgi.config import (
    DEFAULT_MAX_KEYS,
    Config,
    Limit,
    config_file,
    load_config,
    located,
)
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.limitindex import counts, inherit
from gatekeeper_wsgi.redact import mask_text
from gatekeeper_wsgi.status import public_backend_url

__all__ = ["ConfigInput", "limit_tree", "run_check"]

#: What the commands read a configuration from: a settings dict or a file path.
ConfigInput = Mapping[str, Any] | str | os.PathLike[str]


def _number(value: float) -> str:
    return f"{value:g}"


def _sort_key(segments: tuple[str, ...]) -> tuple[tuple[bool, str], ...]:
    # Exact names first, then the '*' that covers every other value.
    return tuple((segment == "*", segment) for segment in segments)


def _governing(config: Config, segments: tuple[str, ...]) -> Limit | None:
    """The limit of this exact level that applies to the node ``segments`` (the engine's
    own lookup, so what is printed is what is enforced)."""
    return config.limit_index.most_specific(segments)


def _own(limit: Limit | None) -> list[str]:
    if limit is None or not counts(limit):
        return ["no limit of its own"]
    parts = []
    adaptive = limit.adaptive
    if adaptive is not None:
        parts.append(
            f"concurrency auto ({adaptive.algorithm}, {adaptive.min}..{adaptive.max}, "
            f"starting at {adaptive.initial})"
        )
    elif limit.concurrency is not None:
        parts.append(
            "concurrency 0 (blocked)"
            if limit.concurrency == 0
            else f"concurrency {limit.concurrency}"
        )
    if limit.rate is not None:
        parts.append(f"rate {limit.rate.text}")
        if limit.count is not None:
            parts.append("counting " + ",".join(str(s) for s in sorted(limit.count)))
    if limit.wildcard:
        names = ["project", "service", limit.key]
        counted = [names[i] for i, segment in enumerate(limit.segments) if segment == "*"]
        parts.append("one counter per " + " and ".join(counted))
    elif limit.level == "caller" and limit.key != "caller":
        parts.append(f"key {limit.key}")
    if limit.queue is not None:
        parts.append(f"queue {limit.queue.size} waiting up to {_number(limit.queue.wait)}s")
    if limit.wildcard and limit.max_keys != DEFAULT_MAX_KEYS:
        parts.append(f"max_keys {limit.max_keys}")
    if limit.mode is not None:
        parts.append(f"mode {limit.mode}")
    return parts


def _inherited(config: Config, segments: tuple[str, ...]) -> list[str]:
    """Effective delay and timeout markers at a node, by the engine's own rule
    (:func:`~gatekeeper_wsgi.limitindex.inherit`), each with the limit it comes from."""
    inherited = inherit(config.limit_index.chain(segments))
    here = "/".join(segments)
    parts = []

    def source(limit: Limit) -> str:
        return "" if limit.path == here else f" (from {limit.path})"

    delay, status, header, body, _ = inherited
    if delay is not None and inherited.delay_seconds:
        parts.append(f"delay {_number(inherited.delay_seconds)}s{source(delay)}")
    if status is not None and status.timeout_status:
        codes = ",".join(str(s) for s in sorted(status.timeout_status))
        parts.append(f"timeout_status {codes}{source(status)}")
    if header is not None and header.timeout_header is not None:
        parts.append(f"timeout_header {header.timeout_header.text!r}{source(header)}")
    if body is not None and body.timeout_body is not None:
        pattern = body.timeout_body.pattern.decode("utf-8", "replace")
        parts.append(f"timeout_body /{pattern}/{source(body)}")
    if not inherited.delay_seconds and any((status, header, body)):
        parts.append("delay 0s")
    return parts


def limit_tree(config: Config, paths: Iterable[str] = ()) -> list[str]:
    """The effective limit tree, one line per path: the configured paths and their
    parents, plus the concrete ``paths`` given (``shop/checkout/crm``: what a request of
    that project, service and caller is counted under, and what it inherits)."""
    nodes: set[tuple[str, ...]] = set()
    for segments in [limit.segments for limit in config.limits.values()] + [
        tuple(path.split("/")) for path in paths
    ]:
        for depth in range(1, len(segments) + 1):
            nodes.add(segments[:depth])
    ordered = sorted(nodes, key=_sort_key)
    last_child: dict[tuple[str, ...], tuple[str, ...]] = {}
    for node in ordered:
        last_child[node[:-1]] = node  # sorted, so the last one seen is the last sibling
    labels = []
    for node in ordered:
        prefix = "".join(
            "   " if last_child[node[: level - 1]] == node[:level] else "│  "
            for level in range(2, len(node))
        )
        if len(node) > 1:
            prefix += "└─ " if last_child[node[:-1]] == node else "├─ "
        labels.append(prefix + "/".join(node))
    width = max(len(label) for label in labels)
    lines = []
    for node, label in zip(ordered, labels, strict=True):
        path = "/".join(node)
        governing = _governing(config, node)
        if governing is None or governing.path == path:
            details = _own(governing)
        else:
            details = [f"counted under {governing.path}: " + ", ".join(_own(governing))]
        details += _inherited(config, node)
        lines.append(f"{label.ljust(width)}  " + "; ".join(details))
    return lines


#: what stands for the tree's and the summary's glyphs where the output cannot show them
_ASCII_GLYPHS = str.maketrans({"·": "-", "│": "|", "└": "`", "├": "|", "─": "-"})


def _say(text: str, stream: TextIO) -> None:
    """Print ``text`` as ``stream`` can write it: on a terminal or pipe whose encoding
    lacks the glyphs (``LC_ALL=C``, ``PYTHONIOENCODING=ascii``), ASCII ones instead, and
    anything else it cannot encode (a non-ASCII marker pattern) escaped."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.translate(_ASCII_GLYPHS).encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:  # an encoding Python does not know: the stream says what it can
        pass
    print(text, file=stream)


def run_check(source: ConfigInput, out: TextIO, *, err: TextIO | None = None) -> int:
    """Validate a config file or settings dict and print its effective limit tree.

    Returns 0 when valid; 1 with the error (``file:line: key: problem``) written to
    ``err`` (default ``out``) otherwise.
    """
    errors = err if err is not None else out
    try:
        config = load_config(source)
        # The backend's own parsing, as at start-up: bad or unknown URL options fail here.
        try:
            check_backend_url(config.backend)
        except ConfigError as exc:
            raise located(exc, config_file(source)) from exc
        # What the server itself says (its maxmemory-policy, a database it lacks), before
        # anything is called OK.
        report = None
        if config.backend.split(":", 1)[0].lower() in ("redis", "rediss", "unix", "valkey"):
            from gatekeeper_wsgi.backends.redis import check_report  # redis-py only when used

            try:
                report = check_report(config.backend, config)
            except ConfigError as exc:
                raise located(exc, config_file(source)) from exc
    except ConfigError as exc:
        _say(f"error: {mask_text(str(exc))}", errors)
        return 1
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "settings"
    _say(f"{name}: OK", out)
    _say(
        f"project {config.project} · backend {public_backend_url(config.backend)} · "
        f"mode {config.mode} · on_backend_error {config.on_backend_error} · "
        f"caller header {config.caller.header}" + (" (required)" if config.caller.required else ""),
        out,
    )
    if report is not None:
        _say(report, out)
    if config.reload.file:
        _say(f"limits file: {config.reload.file}", out)
    if not config.limits:
        _say("no limits: every request is admitted", out)
        return 0
    _say("", out)
    for line in limit_tree(config):
        _say(line, out)
    return 0
