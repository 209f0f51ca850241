"""The distribution: a built wheel installs and both contrib import paths work."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_with_contrib_packages_and_data(tmp_path: Path) -> None:
    """A wheel built from the checkout imports core, Django and Flask plugins, ships data."""
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = dist.glob("gatekeeper_wsgi-*.whl")
    env_dir = tmp_path / "venv"
    # System site-packages provide the dependencies; the wheel itself must come first.
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        check=True,
    )
    probe = (
        "import gatekeeper_wsgi, gatekeeper_wsgi.contrib.django, gatekeeper_wsgi.contrib.flask;"
        "from importlib.resources import files;"
        "print(gatekeeper_wsgi.__file__);"
        "print(gatekeeper_wsgi.contrib.django.__file__);"
        "print(files('gatekeeper_wsgi').joinpath('py.typed').is_file())"
    )
    out = subprocess.run(
        [str(python), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path
    ).stdout.split()
    assert out[0].startswith(str(env_dir)), out
    assert out[1].startswith(str(env_dir)) and out[1].endswith("contrib/django/__init__.py")
    assert out[2] == "True"


def test_source_checkout_imports_contrib_packages() -> None:
    """From the (editable) checkout both plugin packages import under gatekeeper_wsgi.contrib."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gatekeeper_wsgi.contrib.django as d, gatekeeper_wsgi.contrib.flask as f;"
            "print(d.__name__, f.__name__)",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.split()
    assert out == ["gatekeeper_wsgi.contrib.django", "gatekeeper_wsgi.contrib.flask"]
