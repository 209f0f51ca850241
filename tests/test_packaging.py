"""The distribution as a user installs it: the wheel built from this checkout, installed
into isolated virtualenvs (no system site packages; dependencies from the package index),
with no extra and then with each extra; and at the floor versions pyproject.toml declares.

"Declared = imported": every module of the package that needs no extra imports after a
plain install (a new module is checked without being listed here), each extra's modules
import once that extra is installed, and the declared floors really work (the floor venv
admits and refuses against a real redis-server). On failure the installer's or the
interpreter's own output is shown, not a ``CalledProcessError``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import redis_binary
from tests.servers import RedisServer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 CI
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: The module prefixes that need an extra, by extra; every other module needs none.
NEEDS_EXTRA = {
    "redis": ("gatekeeper_wsgi.backends.redis",),
    "prometheus": ("gatekeeper_wsgi.prometheus",),
    "django": ("gatekeeper_wsgi.contrib.django",),
    "flask": ("gatekeeper_wsgi.contrib.flask",),
}
#: What the Django modules need before they import: settings and the app registry (the
#: views import django.contrib.auth's).
DJANGO_SETUP = (
    "import django.conf, django\n"
    "django.conf.settings.configure(INSTALLED_APPS=['django.contrib.contenttypes',"
    " 'django.contrib.auth', 'gatekeeper_wsgi.contrib.django'])\n"
    "django.setup()\n"
)


def run(command: list[str], what: str, cwd: Path | None = None) -> str:
    """Run ``command``; on failure, fail the test with its own output."""
    __tracebackhide__ = True
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=600)
    if done.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {done.returncode}): {' '.join(command)}\n"
            f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-4000:]}",
            pytrace=False,
        )
    return done.stdout


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from this checkout, once per session."""
    dist = tmp_path_factory.mktemp("dist")
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        "building the wheel",
    )
    (built,) = dist.glob("gatekeeper_wsgi-*.whl")
    return built


def isolated_venv(where: Path) -> Path:
    """A fresh virtualenv that sees nothing of this interpreter's packages; its python.
    It gets no pip of its own: :func:`pip_install` installs into it with this one's."""
    venv.create(where, system_site_packages=False, with_pip=False, clear=True)
    return where / "bin" / "python"


def pip_install(python: Path, *args: str) -> None:
    """``pip install`` into the venv of ``python`` (skipping bytecode: it is what makes a
    Django install slow, and imports compile what they need)."""
    __tracebackhide__ = True
    command = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
    run([*command, "--no-compile", *args], f"pip install {' '.join(args)}")


def modules_of(wheel: Path) -> list[str]:
    """Every module the wheel ships, by dotted name."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    modules = []
    for name in names:
        if name.endswith(".py") and name.startswith("gatekeeper_wsgi/"):
            dotted = name[: -len(".py")].replace("/", ".")
            modules.append(dotted.removesuffix(".__init__"))
    return sorted(modules)


def extra_of(module: str) -> str | None:
    for extra, prefixes in NEEDS_EXTRA.items():
        if module.startswith(prefixes):
            return extra
    return None


def import_probe(modules: list[str], django: bool = False) -> str:
    """A script importing ``modules`` one by one, printing each name it imported."""
    lines = [DJANGO_SETUP] if django else []
    lines += [f"import {module}; print({module!r})\n" for module in modules]
    return "".join(lines)


@pytest.fixture(scope="session")
def plain(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An isolated venv with the wheel installed without extras; its python."""
    python = isolated_venv(tmp_path_factory.mktemp("plain") / "venv")
    pip_install(python, str(wheel))
    return python


@pytest.mark.slow
def test_wheel_without_extras_imports_every_module_that_needs_none(
    plain: Path, wheel: Path, tmp_path: Path
) -> None:
    """After `pip install <wheel>` (no extra) every module that needs no extra imports,
    `gatekeeper_wsgi.frs` included; no extra's library came along; data files ship."""
    modules = [module for module in modules_of(wheel) if extra_of(module) is None]
    assert "gatekeeper_wsgi.frs" in modules
    out = run([str(plain), "-c", import_probe(modules)], "importing without extras", tmp_path)
    assert out.split() == modules
    probe = (
        "import importlib.util as u, gatekeeper_wsgi\n"
        "from importlib.resources import files\n"
        "print(gatekeeper_wsgi.__file__)\n"
        "print(files('gatekeeper_wsgi').joinpath('py.typed').is_file())\n"
        "print([n for n in ('redis', 'django', 'flask', 'prometheus_client') if u.find_spec(n)])\n"
    )
    location, typed, extras = run([str(plain), "-c", probe], "probing", tmp_path).splitlines()
    assert location.startswith(str(plain.parent.parent)), "imported from outside the venv"
    assert typed == "True"
    assert extras == "[]"
    assert "usage" in run([str(plain.parent / "gatekeeper"), "--help"], "gatekeeper --help")


@pytest.mark.slow
def test_each_extra_imports_its_modules(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """In an isolated venv, `pip install "<wheel>[extra]"` for one extra after another:
    each time, that extra's modules import (before the next extra is installed)."""
    python = isolated_venv(tmp_path_factory.mktemp("extras") / "venv")
    for extra in NEEDS_EXTRA:
        pip_install(python, f"{wheel}[{extra}]")
        modules = [module for module in modules_of(wheel) if extra_of(module) == extra]
        assert modules, f"no module needs [{extra}]"
        probe = import_probe(modules, django=extra == "django")
        out = run([str(python), "-c", probe], f"importing the [{extra}] modules", tmp_path)
        assert out.split() == modules


def floors() -> list[str]:
    """Every declared dependency of the runtime and its extras pinned to its floor
    (``name>=X`` -> ``name==X``), for this interpreter's markers."""
    declared = list(PYPROJECT["project"]["dependencies"])
    for extra in NEEDS_EXTRA:
        declared += PYPROJECT["project"]["optional-dependencies"][extra]
    pins = []
    for requirement in declared:
        spec, _, marker = requirement.partition(";")
        if marker.strip() and sys.version_info >= (3, 11) and "python_version < '3.11'" in marker:
            continue
        found = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)\s*", spec)
        assert found, f"{requirement!r}: a floor is declared as name>=version"
        pins.append(f"{found[1]}=={found[2]}")
    return pins


@pytest.fixture
def floor_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("floor-redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


FLOOR_PROBE = """
import sys
from flask import Flask
from gatekeeper_wsgi import GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi.contrib.flask import GateKeeper as FlaskGateKeeper
from gatekeeper_wsgi.errors import Rejected
import gatekeeper_wsgi.prometheus
import django.conf, django
django.conf.settings.configure()
django.setup()
import gatekeeper_wsgi.contrib.django.middleware

gk = GateKeeper({"project": "shop", "backend": sys.argv[1], "on_backend_error": "reject",
                 "limits": {"shop": {"concurrency": 1}, "shop/x": {"rate": "2/minute"}}})
held = gk.admit("shop", "x", "c")
try:
    gk.admit("shop", "x", "c")
    raise SystemExit("admitted past concurrency 1")
except Rejected as refused:
    assert refused.code == "GK-CONCURRENCY-LIMIT", refused.code
held.release(200)
gk.admit("shop", "x", "c").release(200)
try:
    gk.admit("shop", "x", "c")
    raise SystemExit("admitted past 2/minute")
except Rejected as refused:
    assert refused.code == "GK-RATE-LIMIT", refused.code
gk.close()

app = Flask("floor")
FlaskGateKeeper(app, {"project": "shop", "limits": {"shop": {"concurrency": 1}}})
app.get("/")(lambda: "ok")
assert [app.test_client().get("/").status_code for _ in range(3)] == [200] * 3
routed = GateKeeperMiddleware(lambda e, s: s("200 OK", []) or [b"ok"],
                              {"project": "shop", "routes": {"/orders/<int:id>": "order"}})
print("floors work")
"""


@pytest.mark.slow
def test_declared_floors_work(wheel: Path, tmp_path: Path, floor_redis: str) -> None:
    """With every dependency at its declared floor (redis-py, Django, Flask, werkzeug,
    prometheus-client) the package imports, admits and refuses on a real redis-server,
    and serves Flask requests: the floors are what the code needs."""
    pins = floors()
    constraints = tmp_path / "floors.txt"
    constraints.write_text("\n".join(pins) + "\n")
    python = isolated_venv(tmp_path / "venv")
    pip_install(python, "-c", str(constraints), f"{wheel}[{','.join(NEEDS_EXTRA)}]")
    out = run([str(python), "-c", FLOOR_PROBE, floor_redis], "the floor probe", tmp_path)
    assert out.strip().endswith("floors work")


def contrib_imported(cwd: Path, *flags: str, prelude: str = "") -> list[str]:
    """Where a fresh interpreter (``flags``, ``prelude`` code first) finds both plugin
    packages: their names and files, and whether the editable install's finder ran."""
    code = (
        prelude + "import gatekeeper_wsgi.contrib.django as d, gatekeeper_wsgi.contrib.flask as f;"
        "print(d.__name__, f.__name__, d.__file__, f.__file__, "
        "'__editable__' in str(sys.meta_path))"
    )
    done = subprocess.run(
        [sys.executable, *flags, "-c", code], check=True, capture_output=True, text=True, cwd=cwd
    )
    return done.stdout.split()


def test_an_uninstalled_checkout_imports_contrib_packages(tmp_path: Path) -> None:
    """``PYTHONPATH=<checkout>`` without any install: the plugins import under
    gatekeeper_wsgi.contrib from the checkout's top-level ``contrib/``. (``-S`` with the
    site-packages directories put on the path by hand: their ``.pth`` files, the editable
    install's among them, are not run.)"""
    import site

    paths = [str(ROOT), *site.getsitepackages()]
    out = contrib_imported(tmp_path, "-S", prelude=f"import sys; sys.path[:0] = {paths!r};")
    assert out[2:] == [
        str(ROOT / "contrib" / "django" / "__init__.py"),
        str(ROOT / "contrib" / "flask" / "__init__.py"),
        "False",
    ]


def test_source_checkout_imports_contrib_packages() -> None:
    """From the (editable) checkout both plugin packages import under gatekeeper_wsgi.contrib."""
    out = contrib_imported(ROOT, prelude="import sys;")
    assert out[:2] == ["gatekeeper_wsgi.contrib.django", "gatekeeper_wsgi.contrib.flask"]
