"""``concurrency = "auto"`` and its ``adaptive`` table: settings, TOML, .properties, check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatekeeper_wsgi import ConfigError
from gatekeeper_wsgi.adaptive import AdaptiveSpec
from gatekeeper_wsgi.cli import main
from gatekeeper_wsgi.config import build_config, load_config


def limit_of(spec: dict[str, Any], path: str = "shop") -> Any:
    return build_config({"project": "shop", "limits": {path: spec}}).limits[path]


@pytest.mark.parametrize("path", ["shop", "shop/checkout", "shop/checkout/crm", "*/*/*"])
def test_auto_on_every_level_and_wildcards(path: str) -> None:
    """The value "auto" is accepted on all three levels and on wildcard paths, with the defaults."""
    limit = limit_of({"concurrency": "auto"}, path)
    assert limit.adaptive == AdaptiveSpec("gradient", 1, 1000, 10)
    assert limit.concurrency == 1000  # the bound any static reader sees


def test_adaptive_table_is_read() -> None:
    """Every key of the adaptive table lands in the spec."""
    limit = limit_of(
        {
            "concurrency": "auto",
            "adaptive": {"algorithm": "vegas", "min": 2, "max": 50, "initial": 5},
        }
    )
    assert limit.adaptive == AdaptiveSpec("vegas", 2, 50, 5)


def test_default_initial_moves_into_the_given_bounds() -> None:
    """max 5 without initial starts at 5, min 20 without initial starts at 20."""
    assert limit_of({"concurrency": "auto", "adaptive": {"max": 5}}).adaptive.initial == 5
    assert limit_of({"concurrency": "auto", "adaptive": {"min": 20}}).adaptive.initial == 20


@pytest.mark.parametrize(
    ("spec", "key", "words"),
    [
        ({"concurrency": 5, "adaptive": {}}, "limits.shop.adaptive", 'concurrency = "auto"'),
        ({"rate": "5/minute", "adaptive": {}}, "limits.shop.adaptive", 'concurrency = "auto"'),
        ({"concurrency": "automatic"}, "limits.shop.concurrency", '"auto"'),
        (
            {"concurrency": "auto", "adaptive": {"algorithm": "bbr"}},
            "limits.shop.adaptive.algorithm",
            "'gradient' or 'aimd' or 'vegas'",
        ),
        (
            {"concurrency": "auto", "adaptive": {"min": 5, "max": 3}},
            "limits.shop.adaptive.max",
            ">= min (5)",
        ),
        (
            {"concurrency": "auto", "adaptive": {"min": 5, "max": 9, "initial": 10}},
            "limits.shop.adaptive.initial",
            "min <= initial <= max (5..9)",
        ),
        (
            {"concurrency": "auto", "adaptive": {"min": 5, "max": 9, "initial": 4}},
            "limits.shop.adaptive.initial",
            "min <= initial <= max",
        ),
        ({"concurrency": "auto", "adaptive": {"min": 0}}, "limits.shop.adaptive.min", ">= 1"),
        ({"concurrency": "auto", "adaptive": {"mni": 2}}, "limits.shop.adaptive.mni", "'min'"),
        ({"concurrency": "auto", "adaptive": [1, 2]}, "limits.shop.adaptive", "table"),
        (
            {"concurrency": "auto", "adaptive": {"max": 10**5000}},
            "limits.shop.adaptive.max",
            "<= 1000000",
        ),
        ({"concurrency": "auto", "adaptive": {"min": True}}, "limits.shop.adaptive.min", ">= 1"),
        (
            {"concurrency": "auto", "adaptive": {"min": 2000000}},
            "limits.shop.adaptive.min",
            "expected an integer >= 1 and <= 1000000, got 2000000",
        ),
    ],
)
def test_invalid_adaptive_settings_name_key_and_expectation(
    spec: dict[str, Any], key: str, words: str
) -> None:
    """Each mistake is a ConfigError naming the key and what was expected."""
    with pytest.raises(ConfigError) as info:
        limit_of(spec)
    assert info.value.key == key
    assert words in str(info.value)


def test_toml_file(tmp_path: Path) -> None:
    """A TOML file sets auto and its table."""
    file = tmp_path / "gk.toml"
    file.write_text(
        '[gatekeeper]\nproject = "shop"\n[gatekeeper.limits."shop/checkout"]\n'
        'concurrency = "auto"\nadaptive = { algorithm = "aimd", min = 2, max = 40 }\n'
    )
    limit = load_config(str(file)).limits["shop/checkout"]
    assert limit.adaptive == AdaptiveSpec("aimd", 2, 40, 10)


def test_properties_file(tmp_path: Path) -> None:
    """A .properties file writes the table as 'algorithm, name=value, ...'."""
    file = tmp_path / "gk.properties"
    file.write_text(
        "project = shop\nlimits.shop/*/*.concurrency = auto\n"
        "limits.shop/*/*.adaptive = vegas, min=2, max=50, initial=4\n"
    )
    limit = load_config(str(file)).limits["shop/*/*"]
    assert limit.adaptive == AdaptiveSpec("vegas", 2, 50, 4)


def test_properties_error_names_file_and_line(tmp_path: Path) -> None:
    """An invalid table in a .properties file points to its line."""
    file = tmp_path / "gk.properties"
    file.write_text(
        "project = shop\nlimits.shop.concurrency = auto\nlimits.shop.adaptive = min=9, max=3\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(file))
    assert info.value.line == 3
    assert "gk.properties" in str(info.value)


@pytest.mark.parametrize(
    ("value", "key", "words"),
    [
        ("vegas, min=2, min=50, algorithm=aimd", "limits.shop.adaptive.min", "'min=2', 'min=50'"),
        ("vegas, max=50, max=60", "limits.shop.adaptive.max", "'max=50', 'max=60'"),
        ("initial=4, initial = 5", "limits.shop.adaptive.initial", "'initial=4', 'initial = 5'"),
        ("vegas, gradient", "limits.shop.adaptive.algorithm", "'vegas', 'gradient'"),
        ("vegas, min=2, algorithm=aimd", "limits.shop.adaptive.algorithm", "'vegas', 'algorithm"),
        ("algorithm=aimd, vegas", "limits.shop.adaptive.algorithm", "'algorithm=aimd', 'vegas'"),
    ],
)
def test_properties_repeated_part_is_an_error(
    tmp_path: Path, value: str, key: str, words: str
) -> None:
    """A part given twice in a .properties adaptive table is an error, not 'last wins'."""
    file = tmp_path / "gk.properties"
    file.write_text(
        f"project = shop\nlimits.shop.concurrency = auto\nlimits.shop.adaptive = {value}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(file))
    assert (info.value.key, info.value.file, info.value.line) == (key, str(file), 3)
    assert "given twice" in str(info.value)
    assert words in str(info.value)


def test_changed_adaptive_table_is_a_changed_config() -> None:
    """A reload that only changes the adaptive table is seen as a change."""
    one = build_config({"limits": {"shop": {"concurrency": "auto"}}})
    two = build_config({"limits": {"shop": {"concurrency": "auto", "adaptive": {"max": 9}}}})
    assert one != two
    assert one == build_config({"limits": {"shop": {"concurrency": "auto"}}})


def test_gatekeeper_check_prints_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gatekeeper check` shows the algorithm and its bounds in the limit tree."""
    file = tmp_path / "gk.properties"
    file.write_text(
        "project = shop\nlimits.shop.concurrency = auto\nlimits.shop.adaptive = aimd, max=40\n"
    )
    assert main(["check", str(file)]) == 0
    assert "concurrency auto (aimd, 1..40, starting at 10)" in capsys.readouterr().out
