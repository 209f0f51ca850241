"""The ``gatekeeper`` console script (SPEC §7): ``check`` prints the effective limit tree or
file:line errors, ``status`` reads a shared/Redis backend from another process, ``replay``
sends logged rejected requests again, faithfully, to a real server."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from werkzeug.serving import make_server
from werkzeug.test import Client

from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware, Rejected
from gatekeeper_wsgi.cli import main, parse_rate, run_check, run_replay, run_status
from gatekeeper_wsgi.rejectlog import flush
from tests.conftest import BACKENDS, new_backend_url
from tests.servers import free_port

PROPERTIES = """\
project = shop
caller.header = X-Caller-Id
limits.shop.concurrency = 100
limits.shop.delay = 2.0
limits.shop.timeout_status = 504
limits.shop/checkout.concurrency = 10
limits.shop/checkout.queue = 20, 1.5
limits.shop/checkout.timeout_header = X-Fault-Code: TIMEOUT
limits.shop/checkout/crm.concurrency = 2
limits.shop/checkout/crm.delay = 5
limits.shop/login/*.rate = 5/minute
limits.shop/login/*.key = ip
limits.shop/login/*.count = 401, 403
limits.*/*/batch.concurrency = 1
"""


def gatekeeper_script() -> str:
    """The installed console script next to this interpreter."""
    script = Path(sys.executable).with_name("gatekeeper")
    found = str(script) if script.exists() else shutil.which("gatekeeper")
    assert found, "the gatekeeper console script is not installed (pip install -e .)"
    return found


@pytest.fixture
def properties(tmp_path: Path) -> Path:
    """A valid operators' .properties file."""
    path = tmp_path / "gatekeeper.properties"
    path.write_text(PROPERTIES, encoding="utf-8")
    return path


# --- check ------------------------------------------------------------------------------


def test_check_prints_the_tree_with_inherited_delay_and_markers(
    properties: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gatekeeper check` shows each path's own limit and what it inherits, and from where."""
    assert main(["check", str(properties)]) == 0
    output = capsys.readouterr().out
    assert f"{properties}: OK" in output
    crm = next(line for line in output.splitlines() if "shop/checkout/crm " in line)
    assert "concurrency 2" in crm
    assert "delay 5s" in crm and "delay 5s (from" not in crm
    assert "timeout_status 504 (from shop)" in crm
    assert "timeout_header 'X-Fault-Code: TIMEOUT' (from shop/checkout)" in crm
    checkout = next(line for line in output.splitlines() if "shop/checkout " in line)
    assert "queue 20 waiting up to 1.5s" in checkout
    assert "delay 2s (from shop)" in checkout
    login = next(line for line in output.splitlines() if "shop/login/* " in line)
    assert "rate 5/minute" in login and "counting 401,403" in login
    assert "one counter per ip" in login
    batch = next(line for line in output.splitlines() if "*/*/batch" in line)
    assert "one counter per project and service" in batch
    assert "└─ shop/checkout/crm" in output


def test_check_reports_file_and_line_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An invalid file exits 1 with file:line, key and what was expected on stderr."""
    bad = tmp_path / "bad.properties"
    bad.write_text("project = shop\n# comment\nlimits.shop.concurrency = -1\n", encoding="utf-8")
    assert main(["check", str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:3: limits.shop.concurrency: expected an integer >= 0" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "huge_repeat.toml",
            '[gatekeeper.limits.shop]\nconcurrency = 1\ntimeout_body = "x{99999999999}"\n',
        ),
        ("huge_repeat.properties", "project = shop\n\nlimits.shop.timeout_body = x{99999999999}\n"),
    ],
    ids=["toml", "properties"],
)
def test_check_reports_an_uncompilable_regex_with_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    """A timeout_body the regex engine refuses (repeat count too large) exits 1 with
    file:line and key on stderr, not a traceback."""
    bad = tmp_path / name
    bad.write_text(text, encoding="utf-8")
    assert main(["check", str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:3: limits.shop.timeout_body: expected a valid regular expression" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_check_toml_and_a_settings_dict_with_a_file_laid_over(tmp_path: Path) -> None:
    """Settings plus reload.file are checked merged, as the engine would run them."""
    toml = tmp_path / "limits.toml"
    toml.write_text('[gatekeeper.limits."shop/checkout"]\nconcurrency = 3\n', encoding="utf-8")
    out = io.StringIO()
    settings = {
        "project": "shop",
        "reload": {"file": str(toml)},
        "limits": {"shop": {"concurrency": 9}},
    }
    assert run_check(settings, out) == 0
    text = out.getvalue()
    assert "settings: OK" in text
    assert "shop/checkout" in text and "concurrency 3" in text
    assert "concurrency 9" in text
    assert run_check(toml, io.StringIO()) == 0


def test_check_finds_what_only_a_running_gatekeeper_would() -> None:
    """Unimportable resolvers and unknown backends fail the check, not the first request."""
    out = io.StringIO()
    assert run_check({"caller": {"resolver": "no_such_module.resolve"}}, out) == 1
    assert "caller.resolver" in out.getvalue()
    out = io.StringIO()
    assert run_check({"backend": "mongodb://x"}, out) == 1
    assert "unknown backend 'mongodb://x'" in out.getvalue()


def test_check_of_no_limits_says_everything_is_admitted() -> None:
    """A config without limits is valid and says what that means."""
    out = io.StringIO()
    assert run_check({"project": "shop"}, out) == 0
    assert "no limits: every request is admitted" in out.getvalue()


def test_console_script_check(properties: Path, tmp_path: Path) -> None:
    """The installed `gatekeeper check` exits 0 on a good file and 1 on a bad one."""
    good = subprocess.run(
        [gatekeeper_script(), "check", str(properties)], capture_output=True, text=True, check=False
    )
    assert good.returncode == 0, good.stderr
    assert "shop/checkout/crm" in good.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[gatekeeper]\nproject = 'shop'\nmode = 'loud'\n", encoding="utf-8")
    failed = subprocess.run(
        [gatekeeper_script(), "check", str(bad)], capture_output=True, text=True, check=False
    )
    assert failed.returncode == 1
    assert f"{bad}:3: mode:" in failed.stderr


def test_console_script_check_on_an_ascii_terminal(tmp_path: Path) -> None:
    """Where stdout cannot show the tree's glyphs (``LC_ALL=C``, ``PYTHONIOENCODING=ascii``)
    `gatekeeper check` prints ASCII ones, and escapes other text it cannot encode; a reader
    that goes away (``| head``) ends it without a traceback."""
    config = tmp_path / "gatekeeper.toml"
    config.write_text(
        '[gatekeeper]\nproject = "shop"\n[gatekeeper.limits.shop]\nconcurrency = 10\n'
        'timeout_header = "X-Fault: d\u00e9lai"\n[gatekeeper.limits."shop/login/*"]\n'
        'rate = "5/minute"\n',
        encoding="utf-8",
    )
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    shown = subprocess.run(
        [gatekeeper_script(), "check", str(config)], capture_output=True, env=env, check=False
    )
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode("ascii")
    assert "project shop - backend memory - mode enforce" in text
    assert "`- shop/login" in text and "   `- shop/login/*  rate 5/minute" in text
    assert "X-Fault: d\\xe9lai" in text
    with subprocess.Popen(
        [gatekeeper_script(), "check", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as cut:
        assert cut.stdout is not None and cut.stderr is not None
        cut.stdout.close()  # the reader went away before anything was written
        assert cut.stderr.read() == b""
        assert cut.wait(60) == 1


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """Missing arguments are usage errors (exit 2), as argparse does."""
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "log.jsonl"])
    assert exit_info.value.code == 2
    assert main(["status"]) == 2
    assert "--backend" in capsys.readouterr().err


# --- status -----------------------------------------------------------------------------


def test_status_of_the_memory_backend_explains_it_is_per_process() -> None:
    """The memory backend cannot be read from outside: the command says why (exit 2)."""
    out = io.StringIO()
    assert run_status("memory", as_json=False, out=out) == 2
    assert "counts inside each process" in out.getvalue()
    out = io.StringIO()
    assert run_status("memory", as_json=True, out=out) == 2
    assert "inside each process" in json.loads(out.getvalue())["error"]


def test_status_errors_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gatekeeper status`'s errors are written to stderr, as `check`'s are; exit codes
    unchanged."""
    cases = [
        (["--backend", "memory"], 2),
        (["--backend", f"shared://{tmp_path / 'nope.shm'}"], 1),
        (["--backend", "redis://:hunter2@[::1/0"], 2),
    ]
    for argv, code in cases:
        assert main(["status", *argv]) == code
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("error: ")
        assert "hunter2" not in err


def test_status_of_a_missing_shared_file_fails_without_creating_it(tmp_path: Path) -> None:
    """A shared backend file that does not exist is reported, not created."""
    missing = tmp_path / "nope.shm"
    out = io.StringIO()
    assert run_status(f"shared://{missing}", as_json=False, out=out) == 1
    assert "no such backend file" in out.getvalue()
    assert not missing.exists()


def test_status_reads_a_relative_shared_url_as_the_engine_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shared://rel/t.shm`` (two slashes) names a path relative to the working
    directory for the engine; the command reads that same file, not ``/t.shm``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    url = "shared://rel/t.shm"
    gk = GateKeeper({"project": "p", "backend": url, "limits": {"p": {"concurrency": 5}}})
    admission = gk.admit("p", "s", "c")
    try:
        out = io.StringIO()
        assert run_status(url, as_json=True, out=out) == 0
        assert json.loads(out.getvalue())["inflight"] == {"p": 1}
    finally:
        admission.release(200)
        gk.close()


def test_status_with_a_bigger_configuration_leaves_the_live_table_alone(tmp_path: Path) -> None:
    """`gatekeeper status --config` with a configuration that needs a bigger shared table
    (a limit added to the file the server reloaded) reads the table as it is: it does not
    re-create it, so a caller that used its window stays refused (SPEC 4.1)."""
    url = f"shared://{tmp_path / 'live.shm'}"
    small = {"project": "shop", "backend": url, "limits": {"shop/login/*": {"rate": "2/minute"}}}
    server = GateKeeper(small)
    for _ in range(2):
        server.admit("shop", "login", "alice").release(200)
    file = tmp_path / "ops.toml"
    file.write_text(
        f'[gatekeeper]\nproject = "shop"\nbackend = "{url}"\n'
        '[gatekeeper.limits."shop/login/*"]\nrate = "2/minute"\n'
        '[gatekeeper.limits."shop/api/*"]\nconcurrency = 5\nmax_keys = 300000\n'
    )
    out = io.StringIO()
    assert run_status(None, as_json=True, out=out, config=str(file)) == 0
    assert json.loads(out.getvalue())["requests"] == 0
    with pytest.raises(Rejected):
        server.admit("shop", "login", "alice")
    server.close()


def test_status_of_an_unreachable_redis_fails_cleanly() -> None:
    """A Redis that does not answer gives exit 1 and a message, no traceback."""
    out = io.StringIO()
    assert run_status(f"redis://127.0.0.1:{free_port()}/0", as_json=True, out=out) == 1
    assert "backend failed" in json.loads(out.getvalue())["error"]


def test_status_of_a_malformed_backend_url_is_a_clear_error() -> None:
    """A URL urlsplit refuses gives a message naming the backend (password masked), no
    traceback."""
    out = io.StringIO()
    assert run_status("redis://:hunter2@[::1/0", as_json=False, out=out) == 2
    assert out.getvalue().startswith("error: backend: malformed backend URL")
    assert "hunter2" not in out.getvalue() and "Traceback" not in out.getvalue()


@pytest.fixture(params=[param for param in BACKENDS if param.id != "memory"])
def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A backend URL that other processes can read: shared file or Redis."""
    return new_backend_url(request, tmp_path)


def status_json(url: str) -> dict[str, Any]:
    """`gatekeeper status --json`, run as its own process."""
    done = subprocess.run(
        [gatekeeper_script(), "status", "--backend", url, "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def test_status_reads_live_counts_from_another_process(shared_backend: str) -> None:
    """`gatekeeper status` in another process sees the requests held here, per path."""
    settings = {
        "project": "shop",
        "backend": shared_backend,
        "limits": {"shop/checkout": {"concurrency": 5}, "shop/login/*": {"concurrency": 2}},
    }
    keeper = GateKeeper(settings)
    held = [
        keeper.admit("shop", "checkout", "crm"),
        keeper.admit("shop", "checkout", "erp"),
        keeper.admit("shop", "login", "alice"),
    ]
    try:
        document = status_json(shared_backend)
        assert document["inflight"]["shop/checkout"] == 2
        assert document["inflight"]["shop/login/alice"] == 1
        out = io.StringIO()
        assert run_status(shared_backend, as_json=False, out=out, config=settings) == 0
        text = out.getvalue()
        assert "3 in flight" in text
        line = next(line for line in text.splitlines() if "shop/login/alice" in line)
        assert "1 / 2" in line and "(shop/login/*)" in line
    finally:
        for admission in held:
            admission.release(200)
        keeper.close()
    out = io.StringIO()
    assert run_status(shared_backend, as_json=True, out=out) == 0
    assert all(count == 0 for count in json.loads(out.getvalue())["inflight"].values())


def test_status_counts_requests_and_delayed_releases(shared_backend: str) -> None:
    """Two requests limited on three levels are 2 in flight, not 6; a faulty response's
    delayed release shows as 1 delayed, from another process, on shared and Redis alike."""
    settings = {
        "project": "shop",
        "backend": shared_backend,
        "limits": {
            "shop": {"concurrency": 10, "delay": 600},
            "shop/checkout": {"concurrency": 10},
            "shop/checkout/*": {"concurrency": 10},
        },
    }
    keeper = GateKeeper(settings)
    try:
        first = keeper.admit("shop", "checkout", "crm")
        second = keeper.admit("shop", "checkout", "erp")
        document = status_json(shared_backend)
        assert (document["requests"], document["delayed_pending"]) == (2, 0)
        assert sum(document["inflight"].values()) == 6  # the slots, per path
        out = io.StringIO()
        assert run_status(shared_backend, as_json=False, out=out, config=settings) == 0
        assert "2 in flight" in out.getvalue()

        first.release(500, faulty=True)  # holds its slots for the 600 s delay
        assert keeper.stats()["counters"]["delayed_pending"] == 1
        document = status_json(shared_backend)
        assert (document["requests"], document["delayed_pending"]) == (1, 1)
        assert document["inflight"]["shop/checkout"] == 2
        out = io.StringIO()
        assert run_status(shared_backend, as_json=False, out=out) == 0
        assert "1 in flight" in out.getvalue()
        assert "delayed releases pending: 1" in out.getvalue()
        second.release(200)
        assert (status_json(shared_backend)["requests"]) == 0
    finally:
        keeper.close()


# --- replay -----------------------------------------------------------------------------


class Recorder:
    """A WSGI app on a real loopback server that records every request it receives."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.server = make_server("127.0.0.1", 0, self, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def __call__(self, environ: Any, start_response: Any) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        headers = {
            key[5:].replace("_", "-").title(): value
            for key, value in environ.items()
            if key.startswith("HTTP_")
        }
        if environ.get("CONTENT_TYPE"):
            headers["Content-Type"] = environ["CONTENT_TYPE"]
        self.requests.append(
            {
                "method": environ["REQUEST_METHOD"],
                "uri": environ.get("REQUEST_URI") or environ.get("RAW_URI"),
                "path": environ["PATH_INFO"],
                "query": environ["QUERY_STRING"],
                "headers": headers,
                "body": environ["wsgi.input"].read(length) if length else b"",
            }
        )
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"recorded"]

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join(30)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    """A recording server on 127.0.0.1."""
    server = Recorder()
    yield server
    server.close()


@contextmanager
def rejected_lines_to(path: Path, formatter: logging.Formatter | None = None) -> Iterator[None]:
    """The gatekeeper.rejected log written to ``path`` alone (not propagated), flushed at
    the end; the logger as it was afterwards."""
    logger = logging.getLogger("gatekeeper.rejected")
    handler = logging.FileHandler(path, encoding="utf-8")
    if formatter is not None:
        handler.setFormatter(formatter)
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield
        assert flush()
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture
def rejected_log(tmp_path: Path) -> Iterator[Path]:
    """A log file with the JSON lines of three rejected requests (and one foreign line)."""
    path = tmp_path / "rejected.log"

    def ok(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b""]

    app = GateKeeperMiddleware(
        ok,
        {
            "project": "shop",
            "rejected_log": {"redact_headers": ["X-Api-Key"]},
            "limits": {"shop": {"concurrency": 0}},
        },
    )
    client = Client(app)
    with rejected_lines_to(path, logging.Formatter("%(asctime)s %(message)s")):
        client.post(
            "/orders/7",
            query_string="expand=items&note=a%20b",
            data=b'{"item": 1}',
            headers={
                "Content-Type": "application/json",
                "Authorization": "Bearer s3cret",
                "X-Api-Key": "s3cret",
                "X-Caller-Id": "crm",
                "X-Request-Id": "orig-1",
            },
        )
        client.put(
            "/caf\u00e9/x y",
            data=b"\x00\xff\xfebinary",
            headers={"Content-Type": "application/octet-stream", "X-Request-Id": "orig-2"},
        )
        client.delete("/orders/8", headers={"X-Request-Id": "orig-3"})
    with path.open("a", encoding="utf-8") as log:
        log.write("2024-01-01 an unrelated line\n")
    yield path


def test_replay_sends_method_path_query_headers_and_body_as_logged(
    rejected_log: Path, recorder: Recorder, capsys: pytest.CaptureFixture[str]
) -> None:
    """Logged requests arrive again exactly as sent; redacted headers only when supplied."""
    code = main(
        ["replay", str(rejected_log), "--to", recorder.url, "-H", "Authorization: Bearer new"]
    )
    output = capsys.readouterr().out
    assert code == 0, output
    assert len(recorder.requests) == 3
    post, put, delete = recorder.requests
    assert post["method"] == "POST"
    assert post["path"] == "/orders/7"
    assert post["query"] == "expand=items&note=a%20b"
    assert post["body"] == b'{"item": 1}'
    assert post["headers"]["Content-Type"] == "application/json"
    assert post["headers"]["X-Caller-Id"] == "crm"
    assert post["headers"]["X-Request-Id"] == "orig-1"
    assert post["headers"]["Authorization"] == "Bearer new"
    assert "X-Api-Key" not in post["headers"]
    assert put["method"] == "PUT"
    assert put["uri"] == "/caf%C3%A9/x%20y"
    assert put["body"] == b"\x00\xff\xfebinary"
    assert delete["method"] == "DELETE" and delete["path"] == "/orders/8"
    assert "POST /orders/7?expand=items&note=a%20b -> 201 Created" in output
    assert "was GK-CONCURRENCY-LIMIT at shop, requestId orig-1" in output
    assert "X-Api-Key was redacted: not sent" in output
    assert "skipped: not a rejected-request record" in output
    assert "sent 3, failed 0, skipped 1" in output


def test_replay_sends_a_redacted_json_body_as_valid_json_in_its_encoding(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A JSON body logged with a secret redacted goes out again as the same document in
    the same encoding (escapes, raw UTF-8 and UTF-16 included), the secret alone replaced."""
    sent = {
        "utf-8": '{"name": "caf\\u00e9 \\u2028", "token": "t", "city": "Zürich"}'.encode(),
        "utf-16": '{"name": "caf\\u00e9", "token": "t"}'.encode("utf-16"),
    }
    path = tmp_path / "rejected.log"
    app = GateKeeperMiddleware(
        lambda environ, start_response: [b""],
        {"project": "shop", "limits": {"shop": {"concurrency": 0}}},
    )
    with rejected_lines_to(path):
        for body in sent.values():
            response = Client(app).post("/orders", data=body, content_type="application/json")
            assert response.status_code == 503
    out = io.StringIO()
    assert run_replay(path, recorder.url, out=out) == 0, out.getvalue()
    received = [request["body"] for request in recorder.requests]
    assert received == [
        body.decode(codec).replace('"t"', '"[redacted]"').encode(codec)
        for codec, body in sent.items()
    ]
    assert json.loads(received[0])["name"] == "caf\u00e9 \u2028"
    assert json.loads(received[1]) == {"name": "caf\u00e9", "token": "[redacted]"}


def test_replay_dry_run_sends_nothing(rejected_log: Path, recorder: Recorder) -> None:
    """--dry-run prints what would go out and sends nothing."""
    out = io.StringIO()
    assert run_replay(rejected_log, recorder.url, dry_run=True, out=out) == 0
    assert recorder.requests == []
    assert "would send 11 body bytes" in out.getvalue()
    assert "would send 3, failed 0" in out.getvalue()


def test_replay_with_a_rate_and_a_path_prefix(rejected_log: Path, recorder: Recorder) -> None:
    """--rate paces the requests (all still arrive); a path in --to prefixes theirs."""
    out = io.StringIO()
    assert run_replay(rejected_log, recorder.url + "/mirror", rate="1000/s", out=out) == 0
    assert [r["path"] for r in recorder.requests] == [
        "/mirror/orders/7",
        "/mirror/caf\xc3\xa9/x y",  # PEP 3333: UTF-8 bytes as latin-1
        "/mirror/orders/8",
    ]


def test_replay_as_a_console_script(rejected_log: Path, recorder: Recorder) -> None:
    """The installed `gatekeeper replay` re-sends the log too."""
    result = subprocess.run(
        [gatekeeper_script(), "replay", str(rejected_log), "--to", recorder.url, "--rate", "50/s"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert [r["method"] for r in recorder.requests] == ["POST", "PUT", "DELETE"]


def test_replay_reports_unreachable_targets_and_fails(rejected_log: Path) -> None:
    """Requests that cannot be sent are reported one by one and make the exit status 1."""
    out = io.StringIO()
    assert run_replay(rejected_log, f"http://127.0.0.1:{free_port()}", out=out) == 1
    assert out.getvalue().count("-> failed:") == 3


def test_replay_skips_truncated_bodies_unless_asked(tmp_path: Path, recorder: Recorder) -> None:
    """A body the log cut short is not sent as if whole, unless --send-truncated."""
    log = tmp_path / "cut.log"
    record = {"method": "POST", "path": "/x", "query": "", "headers": {}, "body": "ab"}
    log.write_text(json.dumps({**record, "body_truncated": True}) + "\n", encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out) == 0
    assert recorder.requests == []
    assert "body truncated in the log" in out.getvalue()
    assert run_replay(log, recorder.url, out=io.StringIO(), send_truncated=True) == 0
    assert recorder.requests[0]["body"] == b"ab"


def test_replay_says_why_a_body_was_not_logged(tmp_path: Path, recorder: Recorder) -> None:
    """A body the log left out (a gzip one it cannot redact) is skipped with the log's
    reason; --send-truncated sends the request without it, and without the
    Content-Encoding that would claim a body that is not there."""
    log = tmp_path / "omitted.log"
    record = {
        "method": "POST",
        "path": "/x",
        "query": "",
        "headers": {"Content-Encoding": "gzip", "X-Note": "n"},
        "body_omitted": "Content-Encoding 'gzip': its fields cannot be redacted",
        "body_truncated": True,
    }
    log.write_text(json.dumps(record) + "\n", encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out) == 0
    assert recorder.requests == []
    assert "body not logged (Content-Encoding 'gzip'" in out.getvalue()
    assert run_replay(log, recorder.url, out=io.StringIO(), send_truncated=True) == 0
    (sent,) = recorder.requests
    assert sent["body"] == b"" and "Content-Encoding" not in sent["headers"]
    assert sent["headers"]["X-Note"] == "n"


def test_replay_notes_redacted_fields_in_a_referer_and_survives_odd_lines(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A Referer whose query the log redacted is sent with the note the dry run gives for
    any redacted field; a hand-edited line with a lone surrogate in its path is sent (as
    the bytes Python gives it), not a traceback that ends the replay."""
    log = tmp_path / "odd.log"
    lines = [
        {"method": "GET", "path": "/a", "headers": {"Referer": "http://x/y?token=[redacted]&a=1"}},
        {"method": "GET", "path": "/x\ud800", "headers": {}},
        {"method": "GET", "path": "/b", "headers": {}},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out, dry_run=True) == 0
    assert "Referer holds redacted fields" in out.getvalue()
    assert run_replay(log, recorder.url, out=io.StringIO()) == 0
    assert [request["uri"] for request in recorder.requests] == ["/a", "/x%ED%A0%80", "/b"]


@pytest.mark.parametrize(
    ("cut", "named"),
    [
        ({"headers_truncated": ["X-Signature"]}, "header X-Signature truncated"),
        ({"path_truncated": True}, "path truncated"),
        ({"query_truncated": True}, "query truncated"),
    ],
)
def test_replay_skips_requests_whose_headers_path_or_query_were_cut(
    tmp_path: Path, recorder: Recorder, cut: dict[str, Any], named: str
) -> None:
    """A header value, path or query the log cut at its cap is not the original request:
    skipped and said so, as a cut body is, unless --send-truncated."""
    log = tmp_path / "cut.log"
    record = {"method": "GET", "path": "/x", "query": "a=1", "headers": {"X-Signature": "ab"}}
    log.write_text(json.dumps({**record, **cut}) + "\n", encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out) == 0
    assert recorder.requests == []
    assert named in out.getvalue()
    assert run_replay(log, recorder.url, out=io.StringIO(), send_truncated=True) == 0
    assert len(recorder.requests) == 1


def test_replay_rejects_bad_arguments(rejected_log: Path, tmp_path: Path) -> None:
    """A non-HTTP target, a bad rate or a missing log are usage errors (exit 2)."""
    assert run_replay(rejected_log, "ftp://host", out=io.StringIO()) == 2
    assert run_replay(rejected_log, "http://127.0.0.1:1", rate="fast", out=io.StringIO()) == 2
    assert run_replay(tmp_path / "none.log", "http://127.0.0.1:1", out=io.StringIO()) == 2
    for to in ("http://127.0.0.1:99999/", "http://[::1", "http://127.0.0.1:abc/"):
        errors = io.StringIO()
        assert run_replay(rejected_log, to, out=io.StringIO(), err=errors) == 2
        assert errors.getvalue() == f"error: --to must be an http:// or https:// URL, got {to!r}\n"
    for timeout in (math.inf, math.nan, -1.0, 0.0):
        assert (
            run_replay(rejected_log, "http://127.0.0.1:1", timeout=timeout, out=io.StringIO()) == 2
        )
    assert parse_rate("30/m") == 0.5
    assert parse_rate("5") == 5.0


def test_replay_errors_go_to_stderr(
    rejected_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gatekeeper replay`'s errors are written to stderr, as `check`'s are; exit 2."""
    for argv in (
        [str(rejected_log), "--to", "ftp://host"],
        [str(tmp_path / "none.log"), "--to", "http://127.0.0.1:1"],
    ):
        assert main(["replay", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == ""
        assert err.startswith("error: ")


def test_replay_of_a_special_file_says_it_is_not_a_regular_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """/dev/zero or a directory exists: it is refused as not a regular file, not as missing."""
    assert main(["replay", "/dev/zero", "--to", "http://127.0.0.1:1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "error: not a regular file: /dev/zero (a character device)\n"
    assert main(["replay", str(tmp_path), "--to", "http://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == f"error: not a regular file: {tmp_path} (a directory)\n"
    assert main(["replay", str(tmp_path / "none.log"), "--to", "http://127.0.0.1:1"]) == 2
    assert "no such log file" in capsys.readouterr().err


def test_replay_reports_requests_that_cannot_be_put_on_the_wire(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A hand-edited log line with a raw space or newline in its path fails alone."""
    log = tmp_path / "edited.log"
    lines = [
        {"method": "GET", "path": "/a b", "query": "", "headers": {}},
        {"method": "GET", "path": "/ok", "query": "", "headers": {"X-Bad": "a\nb"}},
        {"method": "GET", "path": "/fine", "query": "", "headers": {}},
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out) == 1
    assert out.getvalue().count("-> failed:") == 2
    assert [r["path"] for r in recorder.requests] == ["/fine"]


def raw_request_heads(requests: int) -> tuple[str, list[bytes], threading.Thread]:
    """A loopback server that keeps the head of each of ``requests`` requests as its bytes
    came (a WSGI server would merge or refuse repeated headers) and answers 204."""
    listener = socket.create_server(("127.0.0.1", 0))
    heads: list[bytes] = []

    def serve() -> None:
        with listener:
            for _ in range(requests):
                connection, _ = listener.accept()
                with connection:
                    head = b""
                    while b"\r\n\r\n" not in head:
                        piece = connection.recv(65536)
                        if not piece:
                            break
                        head += piece
                    heads.append(head.partition(b"\r\n\r\n")[0])
                    connection.sendall(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", heads, thread


def test_replay_sends_a_given_host_instead_of_its_own(tmp_path: Path) -> None:
    """`-H 'Host: ...'` replaces the Host the connection makes (one Host header: two are a
    400); a given Content-Length is not sent, the body's own is."""
    log = tmp_path / "rejected.log"
    record = {"method": "POST", "path": "/orders", "query": "", "headers": {}, "body": "{}"}
    log.write_text(json.dumps(record) + "\n", encoding="utf-8")
    url, heads, thread = raw_request_heads(1)
    out = io.StringIO()
    overrides = [("Host", "shop.example"), ("Content-Length", "99")]
    assert run_replay(log, url, out=out, headers=overrides) == 0, out.getvalue()
    thread.join(30)
    (head,) = heads
    lines = head.lower().split(b"\r\n")
    assert [line for line in lines if line.startswith(b"host:")] == [b"host: shop.example"]
    assert [line for line in lines if line.startswith(b"content-length:")] == [b"content-length: 2"]
    assert "Content-Length given with --header: not sent" in out.getvalue()


def test_replay_percent_encodes_a_logged_query_that_is_not_ascii(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A query logged with the raw bytes a client sent (PEP 3333's latin-1 characters)
    goes out percent-encoded as those bytes, not as a failure to encode it."""
    log = tmp_path / "rejected.log"
    record = {"method": "GET", "path": "/q", "query": "name=caf\u00e9", "headers": {}}
    log.write_text(json.dumps(record) + "\n", encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out) == 0, out.getvalue()
    (request,) = recorder.requests
    assert request["query"] == "name=caf%E9"


def test_replay_skips_a_line_nested_too_deeply_and_goes_on(
    tmp_path: Path, recorder: Recorder
) -> None:
    """A foreign line of JSON nested 5 000 deep (another logger's) is skipped like any
    other line that is no record, and the records after it are replayed."""
    log = tmp_path / "rejected.log"
    deep = "app said: " + '{"x": ' + "[" * 5000 + "]" * 5000 + "}"
    record = {"method": "GET", "path": "/after", "query": "", "headers": {}}
    log.write_text(deep + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    out = io.StringIO()
    assert run_replay(log, recorder.url, out=out) == 0, out.getvalue()
    assert "line 1: skipped: not a rejected-request record" in out.getvalue()
    assert [request["path"] for request in recorder.requests] == ["/after"]
