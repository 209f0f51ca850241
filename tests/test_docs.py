"""The documentation stays true to the code: every snippet in README.md and docs/ runs.

Code blocks are read from the markdown itself, so editing a doc edits its test:

- ``python`` blocks are executed; a block that leaves a ``GATEKEEPER`` settings dict behind
  has it validated and, unless it names a Redis server, an engine built from it;
- ``properties`` and ``toml`` blocks are written to a file and pass ``gatekeeper check``;
- ``json`` and ``xml`` blocks parse;
- shell, console, ini and unlabelled (output) blocks are shown, not run.

An HTML comment on the line before a block says more (it is invisible on GitHub):

- ``<!-- doctest: fragment (why) -->``: a part of something larger, not run;
- ``<!-- doctest: same -->``: a configuration that must equal the one of the previous
  configuration block of that page (the README's "the same in TOML / .properties");
- ``<!-- doctest: flask-quickstart -->``, ``django-settings``, ``django-urls``: the README's
  quick starts, run as an app by their own tests below.

Snippets run in a temporary working directory, where the absolute paths the docs use
(``/run/gatekeeper/…``, ``/etc/…``) are redirected, with :data:`GIVEN_ENVIRONMENT` set, and
may use the names in :data:`GIVENS` without defining them (``app``: the user's WSGI app).
"""

from __future__ import annotations

import io
import json
import re
import sys
import types
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from defusedxml.ElementTree import fromstring
from django.test import Client
from django.test.utils import override_settings

from gatekeeper_wsgi import cli
from gatekeeper_wsgi.config import LIMIT_FIELDS, SECTIONS, TOP_LEVEL, Config, load_config
from gatekeeper_wsgi.engine import GateKeeper
from tests.django_project import configure

configure()  # the dashboard's Django examples build URL patterns

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_MARK = re.compile(r"<!--\s*doctest:\s*([\w-]+)[^>]*-->\s*$")
#: languages shown, never run
_SHOWN = {"", "bash", "console", "ini", "text", "sh"}
_MARKS = {"fragment", "same", "flask-quickstart", "django-settings", "django-urls"}
#: absolute paths in the docs -> where they are while the snippets run
_REDIRECTED = ("/run/gatekeeper/", "/etc/")


def hello(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """The user's WSGI app of the snippets."""
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hello"]


#: names a snippet may use without defining them
GIVENS: dict[str, Any] = {
    "app": hello,
    "config": {"limits": {"frs/login/*": {"rate": "5/minute"}}},
    "token": "s3cret-frs-token",
    "body": b"<request><cmd_type>query</cmd_type><key>alice</key><biz_id>login</biz_id></request>",
}
#: environment variables the snippets read, as a deployment would set them
GIVEN_ENVIRONMENT = {"FRS_TOKEN": "s3cret-frs-token"}
#: files the snippets name, as they would exist on a deployed host
GIVEN_FILES = {
    "/etc/gatekeeper.toml": '[gatekeeper]\nproject = "shop"\n\n[gatekeeper.limits]\n'
    '"frs/login/*" = { rate = "5/minute" }\n',
    "/etc/shop/gatekeeper.properties": "limits.shop.concurrency = 100\n",
}


@dataclass(frozen=True)
class Snippet:
    """One fenced code block of a page."""

    page: Path
    line: int
    language: str
    code: str
    mark: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_snippets(page: Path) -> list[Snippet]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        found.append(
            Snippet(page, line, match.group(1).lower(), match.group(2), mark and mark.group(1))
        )
    return found


SNIPPETS = [snippet for page in PAGES for snippet in read_snippets(page)]


def runnable(*languages: str) -> list[Any]:
    return [
        pytest.param(snippet, id=snippet.where)
        for snippet in SNIPPETS
        if snippet.language in languages
        and snippet.mark not in ("fragment",)
        and not (snippet.mark or "").startswith(("django-", "flask-"))
    ]


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary working directory standing in for the host the docs deploy on."""
    for name, content in GIVEN_FILES.items():
        target = tmp_path / name.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
    (tmp_path / "run" / "gatekeeper").mkdir(parents=True, exist_ok=True)
    for name, value in GIVEN_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def on_host(code: str, host: Path) -> str:
    for prefix in _REDIRECTED:
        code = code.replace(prefix, f"{host}{prefix}")
    return code


def run_python(snippet: Snippet, host: Path) -> dict[str, Any]:
    """Execute a python block the way a reader would paste it; its namespace."""
    namespace: dict[str, Any] = {"__name__": f"doc_{snippet.line}", **GIVENS}
    code = compile(on_host(snippet.code, host), snippet.where, "exec")
    exec(code, namespace)
    return namespace


def construct(settings: dict[str, Any]) -> Config:
    """What start-up does with a settings dict: validate it, check the backend URL, and
    (unless it names a Redis server, which is not here) build the engine."""
    config = load_config(settings)
    assert cli.run_check(settings, io.StringIO()) == 0
    if not config.backend.startswith(("redis", "rediss", "valkey", "unix")):
        GateKeeper(settings).close()
    return config


def check_file(snippet: Snippet, host: Path) -> Config:
    """``gatekeeper check`` on the block written as a file; the configuration it holds."""
    path = host / f"doc-{snippet.line}.{snippet.language}"
    path.write_text(on_host(snippet.code, host), encoding="utf-8")
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli.main(["check", str(path)])
    assert status == 0, out.getvalue()
    assert f"{path}: OK" in out.getvalue()
    return load_config(path)


def previous_config(snippet: Snippet, host: Path) -> Config:
    """The configuration of the last config block before ``snippet`` on its page."""
    earlier = [
        s
        for s in SNIPPETS
        if s.page == snippet.page
        and s.line < snippet.line
        and s.mark in (None, "same")
        and (s.language in ("toml", "properties") or "GATEKEEPER" in s.code)
    ]
    assert earlier, f"{snippet.where}: 'same' but no configuration before it"
    last = earlier[-1]
    if last.language == "python":
        return load_config(run_python(last, host)["GATEKEEPER"])
    return check_file(last, host)


def test_the_docs_have_snippets_of_every_kind() -> None:
    """The extraction finds the blocks (a broken fence pattern would test nothing)."""
    languages = {snippet.language for snippet in SNIPPETS}
    assert {"python", "properties", "toml"} <= languages
    assert {s.mark for s in SNIPPETS} - {None} <= _MARKS
    assert len(runnable("python")) >= 10


def test_every_code_block_has_a_known_language() -> None:
    """Each block is run, checked, or explicitly shown-only: none is silently skipped."""
    known = _SHOWN | {"python", "properties", "toml", "json", "xml"}
    unknown = [s.where for s in SNIPPETS if s.language not in known]
    assert unknown == []


@pytest.mark.parametrize("snippet", runnable("python"))
def test_python_snippet_runs(snippet: Snippet, host: Path) -> None:
    """Every Python example that is meant to run does; its settings dict is valid."""
    namespace = run_python(snippet, host)
    settings = namespace.get("GATEKEEPER")
    if isinstance(settings, dict):
        config = construct(settings)
        if snippet.mark == "same":
            assert config == previous_config(snippet, host)


@pytest.mark.parametrize("snippet", runnable("properties", "toml"))
def test_configuration_file_snippet_passes_check(snippet: Snippet, host: Path) -> None:
    """Every .properties and TOML example passes `gatekeeper check`; "the same" is the same."""
    config = check_file(snippet, host)
    if snippet.mark == "same":
        assert config == previous_config(snippet, host)


@pytest.mark.parametrize("snippet", runnable("json", "xml"))
def test_json_and_xml_snippets_parse(snippet: Snippet) -> None:
    """JSON and XML examples are well formed."""
    if snippet.language == "json":
        json.loads(snippet.code)
    else:
        fromstring(snippet.code.encode("utf-8"))


# --- the README's quick starts ----------------------------------------------------------


def quickstart(mark: str) -> Snippet:
    (snippet,) = [s for s in SNIPPETS if s.mark == mark and s.page.name == "README.md"]
    return snippet


@pytest.mark.parametrize("mark", ["flask-quickstart", "django-settings", "django-urls"])
def test_quick_starts_are_at_most_ten_lines(mark: str) -> None:
    """Each README quick start fits in ten lines of code (blank lines aside)."""
    assert len([line for line in quickstart(mark).code.splitlines() if line.strip()]) <= 10


def test_flask_quick_start_limits_and_serves_the_dashboard(host: Path) -> None:
    """The Flask quick start as written: 5 logins per minute per client, then 429; its
    dashboard answers with the token and refuses without."""
    namespace = run_python(quickstart("flask-quickstart"), host)
    app = namespace["app"]
    token = app.config["GATEKEEPER"]["dashboard"]["token"]
    client = app.test_client()
    for address, expected in (("10.0.0.1", [200] * 5 + [429]), ("10.0.0.2", [200])):
        codes = []
        for _ in expected:
            with client.post("/login", environ_base={"REMOTE_ADDR": address}) as response:
                codes.append(response.status_code)
        assert codes == expected
    with client.get("/gatekeeper/status.json") as response:
        assert response.status_code in (401, 403)
    headers = {"Authorization": f"Bearer {token}"}
    with client.get("/gatekeeper/status.json", headers=headers) as response:
        assert response.status_code == 200
        assert "login" in json.dumps(response.get_json())
    with client.get("/gatekeeper/", headers=headers) as response:
        assert response.status_code == 200
        assert b"<html" in response.data.lower()


def django_quick_start(host: Path) -> tuple[dict[str, Any], types.ModuleType]:
    """The Django quick start's settings (laid over a project's usual ones) and URLs."""
    from django.conf import settings as django_settings

    project = {
        "INSTALLED_APPS": [
            name for name in django_settings.INSTALLED_APPS if "gatekeeper" not in name
        ],
        "MIDDLEWARE": [
            name for name in django_settings.MIDDLEWARE if "gatekeeper" not in name.lower()
        ],
    }
    exec(compile(quickstart("django-settings").code, "README.md settings", "exec"), project)
    urls = types.ModuleType("readme_quickstart_urls")
    urls.__dict__.update({"urlpatterns": [django_path("login/", login_view, name="login")]})
    exec(compile(quickstart("django-urls").code, "README.md urls", "exec"), urls.__dict__)
    settings = {name: value for name, value in project.items() if name.isupper()}
    return settings, urls


def login_view(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("welcome")


def django_path(*args: Any, **kwargs: Any) -> Any:
    from django.urls import path

    return path(*args, **kwargs)


def test_django_quick_start_limits_and_serves_the_dashboard(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Django quick start as written: the middleware first, 5 logins per minute per
    client address, then 429; the dashboard URLs answer a token holder."""
    settings, urls = django_quick_start(host)
    assert settings["MIDDLEWARE"][0] == "gatekeeper_wsgi.contrib.django.GateKeeperMiddleware"
    assert "gatekeeper_wsgi.contrib.django" in settings["INSTALLED_APPS"]
    monkeypatch.setitem(sys.modules, urls.__name__, urls)
    token = settings["GATEKEEPER"]["dashboard"]["token"]
    with override_settings(ROOT_URLCONF=urls.__name__, **settings):
        for address, expected in (("10.0.0.1", [200] * 5 + [429]), ("10.0.0.2", [200])):
            client = Client(REMOTE_ADDR=address)
            assert [client.post("/login/").status_code for _ in expected] == expected
        client = Client()
        assert client.get("/gatekeeper/status.json").status_code in (401, 403)
        bearer = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
        assert client.get("/gatekeeper/status.json", **bearer).status_code == 200
        assert client.get("/gatekeeper/", **bearer).status_code == 200


# --- the configuration reference --------------------------------------------------------


def documented_keys() -> set[str]:
    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    return set(re.findall(r"^\| `([a-z_0-9]+)` \|", text, flags=re.MULTILINE))


def model_keys() -> set[str]:
    keys = set(TOP_LEVEL) | set(LIMIT_FIELDS)
    for fields in SECTIONS.values():
        keys |= set(fields)
    return keys


def test_every_configuration_key_is_documented() -> None:
    """Every key the configuration model accepts has a row in docs/configuration.md."""
    assert model_keys() - documented_keys() == set()


def test_no_documented_key_is_unknown_to_the_model() -> None:
    """docs/configuration.md documents no key the model would reject."""
    assert documented_keys() - model_keys() == set()
