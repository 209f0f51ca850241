"""Configuration files are inputs too (SPEC §4.10): only regular files of at most 16 MiB are
read, anything malformed is a ConfigError with file and line, a failed reload keeps the
running configuration (logged, counted, retried on the next change) and never blocks or
breaks a request, and a file rewritten in place is not swapped in half-written."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import GateKeeper
from gatekeeper_wsgi.config import MAX_SECONDS, build_config
from gatekeeper_wsgi.errors import ConfigError, Rejected
from gatekeeper_wsgi.fileformats import (
    MAX_FILE_BYTES,
    MAX_KEY_PARTS,
    MAX_TOML_NODES,
    load_file,
    open_for_writing,
)
from tests.conftest import FakeClock, replace_file

GOOD = "project = shop\nlimits.shop.concurrency = 1\n"
CHANGED = "project = shop\nlimits.shop.concurrency = 2\n"


def replace_with(path: Path, make: Callable[[Path], None]) -> None:
    """Replace ``path`` atomically by whatever ``make`` creates at a temporary name."""
    temporary = path.with_name("new-" + path.name)
    make(temporary)
    if temporary.is_dir():
        path.unlink()  # rename cannot put a directory over a file
    os.replace(temporary, path)


def finishes(action: Callable[[], Any]) -> Any:
    """Run ``action`` in a thread and return its result; fails if it does not finish
    (a guard against a hang, not a synchronization)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(("ok", action()))
        except BaseException as exc:
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "blocked"
    kind, value = outcome[0]
    if kind == "raised":
        raise value
    return value


def reloading(path: Path, clock: FakeClock) -> GateKeeper:
    return GateKeeper(
        {"project": "shop", "reload": {"file": str(path), "every_requests": 1}}, clock=clock
    )


def swapped_in(tmp_path: Path, clock: FakeClock, text: str) -> tuple[Path, GateKeeper]:
    """A GateKeeper started from GOOD, its file then replaced by ``text`` (not read yet)."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    gk = reloading(path, clock)
    replace_file(path, text)
    return path, gk


def concurrency(gk: GateKeeper) -> int | None:
    return gk.config.limits["shop"].concurrency


def request(gk: GateKeeper) -> None:
    """One request through the engine; it must never raise anything but a refusal."""
    with contextlib.suppress(Rejected):
        gk.admit("shop", "svc", "crm").release(200)


# --- what is read at all ---------------------------------------------------------------------


def test_a_fifo_as_the_config_file_fails_start_up_at_once(tmp_path: Path) -> None:
    """A FIFO is refused (not opened for a blocking read) with a ConfigError naming it."""
    fifo = tmp_path / "gatekeeper.properties"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="a FIFO, not a regular file") as info:
        finishes(lambda: GateKeeper(str(fifo)))
    assert info.value.file == str(fifo)


def test_a_symlink_to_dev_zero_is_not_read(tmp_path: Path) -> None:
    """A symlink to /dev/zero is refused as a character device, not read without bound."""
    link = tmp_path / "gatekeeper.toml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="a character device"):
        finishes(lambda: load_file(link))


def test_a_file_over_16_mib_is_refused(tmp_path: Path) -> None:
    """A (sparse) 17 MiB file is refused by its size, before it is read."""
    big = tmp_path / "gatekeeper.properties"
    with open(big, "wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match="larger than 16 MiB"):
        load_file(big)


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    """A symlink to a regular file is fine: what counts is what the descriptor opened."""
    real = tmp_path / "real.properties"
    real.write_text(GOOD, encoding="utf-8")
    link = tmp_path / "gatekeeper.properties"
    link.symlink_to(real)
    assert load_file(link)[0] == {"project": "shop", "limits": {"shop": {"concurrency": "1"}}}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(os.mkfifo, id="fifo"),
        pytest.param(lambda path: path.symlink_to("/dev/zero"), id="dev-zero"),
        pytest.param(lambda path: path.mkdir(), id="directory"),
    ],
)
def test_a_special_file_swapped_in_fails_the_reload_and_never_blocks(
    tmp_path: Path,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    make: Callable[[Path], None],
) -> None:
    """A FIFO, /dev/zero or a directory renamed over the file: the request that checks
    it goes on, reload() returns, the failure is logged once and counted, the old
    configuration stays, and a good file later is picked up."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    gk = reloading(path, clock)
    replace_with(path, make)
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        finishes(lambda: request(gk))
        assert finishes(gk.reload) is False
        finishes(lambda: request(gk))
    assert concurrency(gk) == 1
    errors = [r for r in caplog.records if "reload of" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    assert "not a regular file" in errors[0].getMessage()
    assert gk.stats()["counters"]["reload_failed"] == 1
    if path.is_dir():
        path.rmdir()  # a file cannot be renamed over a directory
        path.write_text(CHANGED, encoding="utf-8")
        age(path, 1)
    else:
        replace_file(path, CHANGED)
    request(gk)
    assert concurrency(gk) == 2


# --- malformed content --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "line"),
    [
        ("huge.toml", "[limits.shop]\nconcurrency = " + "9" * 5000 + "\n", 2),
        ("huge.properties", "project = shop\nlimits.shop.concurrency = " + "9" * 5000 + "\n", 2),
        ("arabic.properties", "limits.shop.concurrency = \u0663\n", 1),
        ("fullwidth.properties", "limits.shop.delay = \uff11\n", 1),
        ("delay.toml", "[limits.shop]\nconcurrency = 1\ndelay = 1e308\n", 3),
        ("inf.toml", "[limits.shop]\nconcurrency = 1\ndelay = inf\n", 3),
        ("wait.properties", "limits.shop.concurrency = 1\nlimits.shop.queue = 5, 1e300\n", 2),
        ("rate.properties", "limits.shop.rate = " + "9" * 5000 + "/second\n", 1),
        ("window.properties", "limits.shop.rate = 5/99999999999d\n", 1),
        (
            "keys.properties",
            "limits.shop/*/*.concurrency = 1\nlimits.shop/*/*.max_keys = 10000000000\n",
            2,
        ),
    ],
)
def test_malformed_numbers_are_config_errors_with_file_and_line(
    tmp_path: Path, name: str, text: str, line: int
) -> None:
    """Thousands of digits, non-ASCII digits, 1e308 or inf seconds: a ConfigError naming
    file and line (never ValueError), with a short message."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GateKeeper(str(path))
    assert info.value.file == str(path)
    assert info.value.line == line
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    ("name", "text", "key", "line"),
    [
        (
            "repeat.toml",
            '[gatekeeper.limits.shop]\nconcurrency = 1\ntimeout_body = "x{99999999999}"\n',
            "limits.shop.timeout_body",
            3,
        ),
        (
            "repeat.properties",
            "limits.shop.concurrency = 1\nlimits.shop.timeout_body = x{99999999999}\n",
            "limits.shop.timeout_body",
            2,
        ),
        (
            "header.properties",
            "limits.shop.concurrency = 1\nlimits.shop.timeout_header = X-A: x{4294967296}\n",
            "limits.shop.timeout_header",
            2,
        ),
        (
            "nested.toml",
            '[limits.shop]\nconcurrency = 1\ntimeout_body = "' + "(" * 5000 + ")" * 5000 + '"\n',
            "limits.shop.timeout_body",
            3,
        ),
        (
            "nested.properties",
            "project = shop\nlimits.shop.timeout_body = " + "(" * 5000 + ")" * 5000 + "\n",
            "limits.shop.timeout_body",
            2,
        ),
    ],
)
def test_regexes_the_engine_cannot_compile_are_config_errors_with_file_and_line(
    tmp_path: Path, name: str, text: str, key: str, line: int
) -> None:
    """A repeat count over the regex engine's maximum or thousands of nested groups: a
    ConfigError naming file, line and key (never OverflowError or RecursionError)."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GateKeeper(str(path))
    assert (info.value.file, info.value.line, info.value.key) == (str(path), line, key)
    assert "expected a valid regular expression" in info.value.problem
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("where", ["backend", "reload.file", "config path", "toml backend"])
def test_a_nul_byte_in_a_file_name_is_a_config_error(tmp_path: Path, where: str) -> None:
    """A path or URL holding a NUL byte names no file: ConfigError naming the key (or the
    file, and its line), not the ValueError the OS call would raise."""
    source: Any
    if where == "backend":
        source = {"project": "shop", "backend": "shared:///tmp/a\x00b.shm"}
    elif where == "reload.file":
        source = {"project": "shop", "reload": {"file": "/tmp/a\x00b.toml"}}
    elif where == "config path":
        source = "/tmp/a\x00b.toml"
    else:
        source = tmp_path / "gk.toml"
        source.write_text('project = "shop"\nbackend = "shared:///tmp/a\\u0000b.shm"\n')
    with pytest.raises(ConfigError) as info:
        GateKeeper(source)
    message = str(info.value)
    assert "NUL" in message
    if where in ("backend", "toml backend"):
        assert "backend" in message
    if where == "toml backend":
        assert f"{source}:2" in message


def test_huge_numbers_in_settings_are_config_errors() -> None:
    """A 5 000-digit int or a 1e308 delay in a settings dict is a ConfigError too."""
    with pytest.raises(ConfigError, match="concurrency"):
        build_config({"limits": {"shop": {"concurrency": 10**5000}}})
    with pytest.raises(ConfigError, match="delay"):
        build_config({"limits": {"shop": {"concurrency": 1, "delay": 10**400}}})
    with pytest.raises(ConfigError, match="delay"):
        build_config({"limits": {"shop": {"concurrency": 1, "delay": 1e308}}})


def test_delays_up_to_a_week_are_accepted() -> None:
    """The bound on delays and waits is a week: a day's delay is fine."""
    config = build_config(
        {"limits": {"shop": {"concurrency": 1, "delay": 86400, "queue": {"size": 1, "wait": 3600}}}}
    )
    assert config.limits["shop"].delay == 86400
    with pytest.raises(ConfigError, match="<= 604800"):
        build_config({"limits": {"shop": {"concurrency": 1, "delay": MAX_SECONDS + 1}}})


@pytest.mark.parametrize(
    "text",
    [
        "a = " + "[" * 5000 + "]" * 5000 + "\n",
        "a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n",
        "a = " + "[" * 1000 + "]" * 1000 + "\n",
    ],
    ids=["arrays", "inline-tables", "a thousand arrays"],
)
def test_deep_toml_nesting_is_a_config_error(tmp_path: Path, text: str) -> None:
    """Thousands of nested arrays or tables: a ConfigError naming the file and the line
    where the nesting is, not a RecursionError (brackets in strings and comments before it
    do not count)."""
    path = tmp_path / "deep.toml"
    head = '[gatekeeper]\nproject = "shop"  # [[[ a comment\nnote = "[[[{{{"\n'
    path.write_text(head + text, encoding="utf-8")
    with pytest.raises(ConfigError, match="nested too deeply") as info:
        load_file(path)
    assert info.value.file == str(path)
    assert info.value.line == 4
    assert str(info.value).startswith(f"{path}:4: ")


def dotted(parts: int, part: str = "a", dot: str = ".") -> str:
    return dot.join([part] * parts)


@pytest.mark.parametrize(
    "text",
    [
        dotted(20_000) + " = 1\n",
        "[" + dotted(20_000) + "]\n",
        dotted(20_000, '"a"') + " = 1\n",
        "x = {" + dotted(20_000, dot=" . ") + " = 1}\n",
        dotted(MAX_KEY_PARTS + 1) + " = 1\n",
    ],
    ids=["key", "table", "quoted parts", "inline table with blanks", "one part too many"],
)
def test_a_toml_key_of_thousands_of_parts_is_a_config_error(tmp_path: Path, text: str) -> None:
    """tomllib's time grows with the square of a dotted key's parts (20 000 parts: seconds,
    in the request that checks for a reload): a key of more than MAX_KEY_PARTS parts is a
    ConfigError naming its file and line, found before tomllib reads it. Dots in strings,
    comments and numbers are no key's."""
    path = tmp_path / "long.toml"
    head = '[gatekeeper]\nproject = "shop"  # ' + dotted(40) + "\nnote = '" + dotted(40)
    path.write_text(head + "'\nratio = 1.5\n" + text, encoding="utf-8")
    with pytest.raises(ConfigError, match="more than 32 dotted parts") as info:
        load_file(path)
    assert info.value.file == str(path)
    assert info.value.line == 5


@pytest.mark.parametrize(
    "hidden",
    ['x = """a\\"""\n"""\n', "x = '''a''''\n", 'x = """a""""\n'],
    ids=["escaped quote", "literal, four quotes", "basic, four quotes"],
)
def test_a_long_key_after_a_multiline_string_is_found(tmp_path: Path, hidden: str) -> None:
    """A multi-line string ends where TOML ends it: not at an escaped quote, and at the
    last three of a run of four or five quotes. Ended early, the rest of the file would
    pass for strings and a key of thousands of parts would reach tomllib unseen."""
    path = tmp_path / "long.toml"
    text = (
        '[gatekeeper]\nproject = "shop"\n[other]\n'
        + hidden
        + dotted(20_000)
        + ' = 1\nz = """q"""\n'
    )
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match="more than 32 dotted parts") as info:
        load_file(path)
    assert info.value.line == 4 + hidden.count("\n")


@pytest.mark.parametrize(
    "line", ["[t{n}.b.b.b.b.b.b.b]", "t{n} = {{a = {{a = [{{}}]}}}}"], ids=["tables", "inline"]
)
def test_a_toml_file_of_too_many_tables_is_a_config_error(tmp_path: Path, line: str) -> None:
    """A few MiB of short, deep table headers (or nested inline tables), each part a table
    tomllib builds with its bookkeeping, took gigabytes in the request that checks for a
    reload: past MAX_TOML_NODES tables, arrays and key parts the file is a ConfigError
    naming the line where it went past, found before tomllib reads it."""
    path = tmp_path / "many.toml"
    per_line = line.format(n=0).count(".") + line.count("{{") + line.count("[")
    lines = ['[gatekeeper]\nproject = "shop"'] + [
        line.format(n=n) for n in range(MAX_TOML_NODES // per_line + 10)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=f"more than {MAX_TOML_NODES} tables") as info:
        load_file(path)
    # [gatekeeper] is the first; line 3 on, per_line each
    assert info.value.line == 2 + -(-MAX_TOML_NODES // per_line)


def test_a_properties_key_of_thousands_of_parts_is_a_config_error(tmp_path: Path) -> None:
    """A .properties key of 20 000 dotted parts (each part's prefix was kept to find
    conflicts: seconds and gigabytes) is a ConfigError naming its line at once; a limit's
    path is one part however many dots its caller name has."""
    path = tmp_path / "long.properties"
    path.write_text(
        "project = shop\nlimits.shop/x/"
        + dotted(40)
        + ".concurrency = 1\n"
        + dotted(20_000)
        + " = 1\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match="more than 32 dotted parts") as info:
        load_file(path)
    assert info.value.line == 3
    path.write_text(
        "project = shop\nlimits.shop/x/" + dotted(40) + ".concurrency = 1\n", encoding="utf-8"
    )
    assert load_file(path)[0]["limits"] == {"shop/x/" + dotted(40): {"concurrency": "1"}}


def test_a_toml_key_of_the_most_parts_is_read(tmp_path: Path) -> None:
    """A key of MAX_KEY_PARTS parts (in a table the configuration does not read) loads."""
    path = tmp_path / "long.toml"
    path.write_text(
        '[gatekeeper]\nproject = "shop"\n[other]\n' + dotted(MAX_KEY_PARTS) + " = 1\n",
        encoding="utf-8",
    )
    assert load_file(path)[0]["project"] == "shop"


def test_control_characters_are_escaped_in_messages(tmp_path: Path) -> None:
    """A value and a key carrying ESC and newlines are quoted escaped, never raw."""
    path = tmp_path / "g.properties"
    path.write_text("limits.shop.concurrency = \\u001b[31mred\\nforged line\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GateKeeper(str(path))
    message = str(info.value)
    assert "\x1b" not in message and "\n" not in message
    assert "\\x1b" in message
    raw_key = tmp_path / "k.properties"
    raw_key.write_text("limits.sh\\u001bop.concurrency = 1\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GateKeeper(str(raw_key))
    assert "\x1b" not in str(info.value)


# --- failed reloads -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "broken",
    [
        "project = shop\nlimits.shop.concurrency = " + "9" * 5000 + "\n",
        "project = shop\nlimits.shop.concurrency = \u0663\n",
        "project = shop\nlimits.shop.delay = 1e308\nlimits.shop.concurrency = 1\n",
        "project = shop\nlimits.shop.concurrency = \\u001b[2J\n",
    ],
    ids=["digits", "arabic", "delay", "escape"],
)
def test_a_broken_reload_keeps_serving_and_is_retried_on_change(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture, broken: str
) -> None:
    """Inside a request: logged once at ERROR (escaped), counted, old limits kept; the
    next change to the file is tried again."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    gk = reloading(path, clock)
    replace_file(path, broken)
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        for _ in range(3):
            request(gk)
        assert gk.reload() is False
    errors = [r.getMessage() for r in caplog.records if "reload of" in r.getMessage()]
    assert len(errors) == 1
    assert str(path) in errors[0] and ":2:" in errors[0]
    assert "\x1b" not in errors[0]
    assert gk.stats()["counters"]["reload_failed"] == 1
    assert concurrency(gk) == 1
    replace_file(path, CHANGED)
    request(gk)
    assert concurrency(gk) == 2
    assert gk.stats()["counters"]["reloads"] == 1


def test_a_reload_with_an_uncompilable_regex_logs_file_line_and_key(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A timeout_body with a repeat count the regex engine refuses, swapped in: the ERROR
    names file, line and key as for any invalid value; the old limits stay."""
    path, gk = swapped_in(tmp_path, clock, GOOD + "limits.shop.timeout_body = x{99999999999}\n")
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        request(gk)
    (error,) = [r.getMessage() for r in caplog.records if "reload of" in r.getMessage()]
    assert f"{path}:3: limits.shop.timeout_body: expected a valid regular expression" in error
    assert "OverflowError" not in error
    assert gk.stats()["counters"]["reload_failed"] == 1
    assert concurrency(gk) == 1


@pytest.mark.parametrize(
    "text",
    ["a = " + "[" * 5000 + "]" * 5000 + "\n", 'project = "shop"\n' + dotted(50_000) + " = 1\n"],
    ids=["deep nesting", "a key of 50 000 parts"],
)
def test_a_hostile_toml_reload_fails_inside_a_request(
    tmp_path: Path, clock: FakeClock, text: str
) -> None:
    """Deep nesting or a key of thousands of parts swapped in: the request goes on under
    the old limits (not held while a parser chews), the reload counts as failed."""
    path = tmp_path / "gatekeeper.toml"
    path.write_text('project = "shop"\n[limits.shop]\nconcurrency = 1\n', encoding="utf-8")
    gk = reloading(path, clock)
    replace_file(path, text)
    request(gk)
    assert gk.stats()["counters"]["reload_failed"] == 1
    assert concurrency(gk) == 1


def test_a_forced_reload_judges_the_file_again(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """A file failed for something outside it (the resolver module it names was not
    deployed yet): the checks in requests do not read it again until it changes, but
    ``gk.reload()``, which forces a reload, does - and swaps it in once it is valid. A
    forced reload that fails as reported before is not logged or counted again."""
    _, gk = swapped_in(tmp_path, clock, CHANGED + "caller.resolver = gk_late_resolver:who\n")
    with caplog.at_level(logging.ERROR, logger="gatekeeper"):
        request(gk)
        assert gk.reload() is False
    assert len([r for r in caplog.records if "reload of" in r.getMessage()]) == 1
    assert gk.stats()["counters"]["reload_failed"] == 1
    (tmp_path / "gk_late_resolver.py").write_text("def who(environ):\n    return 'crm'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    request(gk)
    assert concurrency(gk) == 1  # unchanged content: not judged again by a request
    assert gk.reload() is True
    assert concurrency(gk) == 2
    assert gk.stats()["counters"]["reloads"] == 1


def _unreadable_then_fixed(directory: Path) -> None:
    """A reload file replaced by one its reader may not read, then fixed by chmod alone
    (same content, inode, size and modification time): the next check reads it."""
    path = directory / "gatekeeper.properties"
    path.write_text(GOOD + "reload.every_requests = 1\n", encoding="utf-8")
    clock = FakeClock()
    gk = GateKeeper(str(path), clock=clock)
    fresh = directory / "new.properties"
    fresh.write_text(CHANGED + "reload.every_requests = 1\n", encoding="utf-8")
    fresh.chmod(0)
    age(fresh, 10)
    os.replace(fresh, path)
    request(gk)
    assert gk.stats()["counters"]["reload_failed"] == 1
    assert concurrency(gk) == 1
    path.chmod(0o644)
    request(gk)
    assert concurrency(gk) == 2
    assert gk.stats()["counters"]["reload_failed"] == 1


def test_a_file_made_readable_is_read_at_the_next_check() -> None:
    """A mode fixed after a failed reload is seen by the next check in a request, not
    only once the file changes. Root reads any file, so as root the check runs in a
    forked child as nobody (65534)."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        directory.chmod(0o777)
        if os.getuid() != 0:
            _unreadable_then_fixed(directory)
            return
        pid = os.fork()
        if pid == 0:  # the child: report a failure by its exit code, with its traceback
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                _unreadable_then_fixed(directory)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize(
    ("backend", "fails"),
    [("redis://127.0.0.1:notaport/0", True), ("shared:///{tmp}/table.shm", False)],
)
def test_a_reload_cannot_change_the_backend(
    tmp_path: Path,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
    backend: str,
    fails: bool,
) -> None:
    """A reloaded backend URL start-up would refuse fails the reload (file and line,
    counted); a valid one is warned about and the configuration keeps reporting the
    backend in use until the restart."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    gk = reloading(path, clock)
    url = backend.format(tmp=str(tmp_path).lstrip("/"))
    replace_file(path, f"project = shop\nbackend = {url}\nlimits.shop.concurrency = 2\n")
    with caplog.at_level(logging.WARNING, logger="gatekeeper"):
        assert gk.reload() is (not fails)
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert gk.config.backend == "memory"
    if fails:
        assert f"{path}:2: backend" in messages
        assert gk.stats()["counters"]["reload_failed"] == 1 and concurrency(gk) == 1
    else:
        assert "cannot change while running" in messages
        assert gk.stats()["counters"]["reload_failed"] == 0 and concurrency(gk) == 2


# --- rewritten in place -----------------------------------------------------------------------


def age(path: Path, seconds: float) -> None:
    """Set the file's modification time ``seconds`` into the past."""
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_a_file_rewritten_in_place_is_not_swapped_in_while_fresh(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Truncated or half-written in place (same inode, just modified): requests keep the
    old limits; once the content has stood still, it is swapped in."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD + "limits.shop/a.concurrency = 1\n", encoding="utf-8")
    age(path, 10)
    gk = reloading(path, clock)
    inode = path.stat().st_ino
    with open(path, "w", encoding="utf-8") as handle:  # the writer is mid-way
        handle.write("project = shop\n")
        handle.flush()
        for _ in range(5):
            request(gk)
        assert "shop/a" in gk.config.limits and concurrency(gk) == 1
        handle.write("limits.shop.concurrency = 2\n")
    assert path.stat().st_ino == inode
    request(gk)
    assert concurrency(gk) == 1  # just written: not yet
    age(path, 1)  # it has stood still since
    request(gk)
    assert concurrency(gk) == 2 and "shop/a" not in gk.config.limits
    assert gk.stats()["counters"]["reload_failed"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read leases are Linux's")
def test_a_writer_that_pauses_keeps_its_half_written_file_out(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A writer rewriting the file in place pauses longer than any settle time (its
    modification time aged by hand) with the file still open: neither requests nor an
    explicit reload() swap the half-written content in. Once it closes the file, it is."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD + "limits.shop/a.concurrency = 1\n", encoding="utf-8")
    age(path, 10)
    gk = reloading(path, clock)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("project = shop\n")  # a valid file, but not the whole of it
        handle.flush()
        age(path, 10)
        for _ in range(5):
            request(gk)
        assert gk.reload() is False
        assert "shop/a" in gk.config.limits and concurrency(gk) == 1
        handle.write("limits.shop.concurrency = 2\n")
    age(path, 10)
    assert gk.reload() is True
    assert concurrency(gk) == 2 and "shop/a" not in gk.config.limits
    assert gk.stats()["counters"]["reload_failed"] == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read leases are Linux's")
def test_open_for_writing_sees_writers_of_any_process(tmp_path: Path) -> None:
    """The probe: True while this or another process has the file open for writing,
    False once nobody has, None for what it cannot tell (a FIFO, another inode)."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    inode = path.stat().st_ino
    assert open_for_writing(str(path), inode) is False
    with open(path, "a", encoding="utf-8"):
        assert open_for_writing(str(path), inode) is True
    assert open_for_writing(str(path), inode) is False
    child = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(path)!r}, 'a'); print('open', flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "open\n"
        assert open_for_writing(str(path), inode) is True
    finally:
        child.communicate("\n", timeout=30)
    assert open_for_writing(str(path), inode) is False
    assert open_for_writing(str(path), inode + 1) is None
    fifo = tmp_path / "fifo.properties"
    os.mkfifo(fifo)
    assert open_for_writing(str(fifo), fifo.stat().st_ino) is None


def test_an_emptied_file_is_not_swapped_in_while_fresh(tmp_path: Path, clock: FakeClock) -> None:
    """A file truncated to nothing (the first step of a rewrite) drops no limits."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    age(path, 10)
    gk = reloading(path, clock)
    path.write_text("", encoding="utf-8")
    for _ in range(5):
        request(gk)
    assert concurrency(gk) == 1


def test_an_atomic_rename_is_swapped_in_at_the_next_check(tmp_path: Path, clock: FakeClock) -> None:
    """A file renamed into place (a new inode) is complete: the next request uses it."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    gk = reloading(path, clock)
    replace_file(path, CHANGED)
    request(gk)
    assert concurrency(gk) == 2


def test_reload_waits_for_a_fresh_in_place_rewrite_to_settle(
    tmp_path: Path, clock: FakeClock
) -> None:
    """An explicit reload() after an in-place write (not a request) waits once and
    swaps the file in when it read the same twice."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    age(path, 10)
    gk = reloading(path, clock)
    path.write_text(CHANGED, encoding="utf-8")
    assert gk.reload() is True
    assert concurrency(gk) == 2


def test_many_request_threads_race_a_fifo_swapped_in(tmp_path: Path, clock: FakeClock) -> None:
    """Sixteen threads released at once on a file just replaced by a FIFO, each request
    checking the file: every request finishes with an admission or a refusal, the FIFO
    is reported once, and the limit stays exact (never more than 1 in flight)."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(GOOD, encoding="utf-8")
    gk = reloading(path, clock)
    start = threading.Barrier(17)
    errors: list[BaseException] = []
    outcomes: list[str] = []
    lock = threading.Lock()
    in_flight = [0, 0]  # now, most seen

    def worker() -> None:
        start.wait()
        for _ in range(50):
            try:
                admission = gk.admit("shop", "svc", "crm")
            except Rejected:
                with lock:
                    outcomes.append("refused")
                continue
            except BaseException as exc:  # anything else is the bug this test looks for
                errors.append(exc)
                return
            with lock:
                in_flight[0] += 1
                in_flight[1] = max(in_flight)
                outcomes.append("admitted")
            with lock:
                in_flight[0] -= 1
            admission.release(200)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(16)]
    for thread in threads:
        thread.start()
    replace_with(path, os.mkfifo)
    start.wait()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a request blocked"
    assert errors == []
    assert len(outcomes) == 16 * 50
    assert in_flight[1] <= 1
    assert gk.stats()["counters"]["reload_failed"] == 1
    assert concurrency(gk) == 1
