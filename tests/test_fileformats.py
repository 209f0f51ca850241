"""Loading .properties and .toml configuration files (gatekeeper_wsgi.fileformats)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper_wsgi.config import load_config
from gatekeeper_wsgi.errors import ConfigError
from gatekeeper_wsgi.fileformats import load_file

SPEC_PROPERTIES = """\
project = shop
caller.header = X-Caller-Id
reload.every_seconds = 5
limits.shop.concurrency = 100
limits.shop.delay = 2.0
limits.shop.timeout_status = 504
limits.shop/checkout.concurrency = 10
limits.shop/checkout/crm.concurrency = 2
limits.shop/login/*.rate = 5/minute
limits.shop/checkout.queue = 20, 1.5
"""

SPEC_SETTINGS = {
    "project": "shop",
    "caller": {"header": "X-Caller-Id"},
    "reload": {"every_seconds": "5"},
    "limits": {
        "shop": {"concurrency": "100", "delay": "2.0", "timeout_status": "504"},
        "shop/checkout": {"concurrency": "10", "queue": "20, 1.5"},
        "shop/checkout/crm": {"concurrency": "2"},
        "shop/login/*": {"rate": "5/minute"},
    },
}

TOML_SETTINGS = {
    "project": "shop",
    "caller": {"header": "X-Caller-Id"},
    "reload": {"every_seconds": 5},
    "limits": {
        "shop": {"concurrency": 100, "delay": 2.0, "timeout_status": [504]},
        "shop/checkout": {"concurrency": 10, "queue": {"size": 20, "wait": 1.5}},
        "shop/checkout/crm": {"concurrency": 2},
        "shop/login/*": {"rate": "5/minute"},
    },
}

# Line numbers matter to the tests below: keep this text as it is.
SPEC_TOML = """\
# operators' limits
[gatekeeper]
project = "shop"

[gatekeeper.caller]
header = "X-Caller-Id"

[gatekeeper.reload]
every_seconds = 5

[gatekeeper.limits]
shop = { concurrency = 100, delay = 2.0, timeout_status = [504] }
"shop/checkout" = { concurrency = 10, queue = { size = 20, wait = 1.5 } }

[gatekeeper.limits."shop/checkout/crm"]
concurrency = 2

[gatekeeper.limits."shop/login/*"]
rate = "5/minute"
"""


def write(tmp_path: Path, text: str, name: str = "gatekeeper.properties") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return path


def load_properties(tmp_path: Path, text: str) -> dict[str, Any]:
    settings, _ = load_file(write(tmp_path, text))
    return settings


def load_error(tmp_path: Path, text: str, name: str = "gatekeeper.properties") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_file(write(tmp_path, text, name))
    return info.value


# ------------------------------------------------------------------------ whole files


def test_spec_properties_example_loads_to_nested_settings(tmp_path: Path) -> None:
    """The SPEC §3 properties example loads to the nested dict, every value kept a string."""
    settings, _ = load_file(write(tmp_path, SPEC_PROPERTIES))
    assert settings == SPEC_SETTINGS


def test_spec_properties_lines_point_at_each_key(tmp_path: Path) -> None:
    """Every key, limit and parent table of a properties file maps to its line."""
    _, lines = load_file(write(tmp_path, SPEC_PROPERTIES))
    assert lines["project"] == 1
    assert lines["caller"] == 2
    assert lines["caller.header"] == 2
    assert lines["reload.every_seconds"] == 3
    assert lines["limits"] == 4
    assert lines["limits.shop"] == 4
    assert lines["limits.shop.timeout_status"] == 6
    assert lines["limits.shop/checkout"] == 7
    assert lines["limits.shop/checkout.concurrency"] == 7
    assert lines["limits.shop/checkout.queue"] == 10
    assert lines["limits.shop/login/*.rate"] == 9


def test_toml_gatekeeper_table_loads_to_same_model(tmp_path: Path) -> None:
    """A TOML file with a [gatekeeper] table loads to the same model, with TOML's types."""
    settings, _ = load_file(write(tmp_path, SPEC_TOML, "gatekeeper.toml"))
    assert settings == TOML_SETTINGS


def test_toml_top_level_form_loads_to_same_model(tmp_path: Path) -> None:
    """A TOML file without a [gatekeeper] table is read as the settings themselves."""
    top_level = SPEC_TOML.replace("[gatekeeper]\n", "").replace("[gatekeeper.", "[")
    settings, lines = load_file(write(tmp_path, top_level, "gatekeeper.toml"))
    assert settings == TOML_SETTINGS
    assert lines["limits.shop/checkout/crm.concurrency"] == 15


def test_toml_lines_for_tables_and_inline_tables(tmp_path: Path) -> None:
    """Keys under [gatekeeper.x] headers, quoted headers and inline tables get their lines."""
    _, lines = load_file(write(tmp_path, SPEC_TOML, "gatekeeper.toml"))
    assert lines["project"] == 3
    assert lines["caller"] == 5
    assert lines["caller.header"] == 6
    assert lines["reload.every_seconds"] == 9
    assert lines["limits"] == 11
    assert lines["limits.shop"] == 12
    assert lines["limits.shop.delay"] == 12
    assert lines["limits.shop/checkout.queue.wait"] == 13
    assert lines["limits.shop/checkout/crm"] == 15
    assert lines["limits.shop/checkout/crm.concurrency"] == 16
    assert lines["limits.shop/login/*.rate"] == 19
    assert "gatekeeper" not in lines


def test_toml_lines_for_dotted_keys(tmp_path: Path) -> None:
    """Dotted keys, with quoted and spaced parts, are located like tables."""
    text = textwrap.dedent("""\
        [gatekeeper]
        caller.header = "X-Caller-Id"
        limits . "shop/login/*" . rate = "5/minute"
        limits.'shop'.concurrency = 3
        routes."/feed.xml" = "feed"
        """)
    settings, lines = load_file(write(tmp_path, text, "g.toml"))
    assert settings["limits"]["shop/login/*"]["rate"] == "5/minute"
    assert lines["caller.header"] == 2
    assert lines["limits"] == 3
    assert lines["limits.shop/login/*.rate"] == 3
    assert lines["limits.shop.concurrency"] == 4
    assert lines["routes./feed.xml"] == 5


def test_toml_lines_not_fooled_by_strings_arrays_and_comments(tmp_path: Path) -> None:
    """Text inside multi-line strings, arrays and comments is never taken for a key."""
    text = textwrap.dedent('''\
        [gatekeeper]
        project = "shop" # project = "nope"
        request_id_header = """
        mode = "shadow"
        [gatekeeper.fault]
        """
        backend = \'\'\'
        fault = 1\'\'\'
        [gatekeeper.limits.shop]
        timeout_status = [
          504, # concurrency = 1
          503,
        ]
        delay = 2.0
        [other]
        mode = "x"
        ''')
    settings, lines = load_file(write(tmp_path, text, "g.toml"))
    assert set(settings) == {"project", "request_id_header", "backend", "limits"}
    assert lines["project"] == 2
    assert lines["request_id_header"] == 3
    assert lines["backend"] == 7
    assert "mode" not in lines
    assert "fault" not in lines
    assert "limits.shop.concurrency" not in lines
    assert lines["limits.shop.timeout_status"] == 10
    assert lines["limits.shop.delay"] == 14


def test_toml_syntax_error_reports_its_line(tmp_path: Path) -> None:
    """A TOML syntax error names the file and the line of the mistake."""
    path = write(tmp_path, '[gatekeeper]\nproject = "shop"\n\nmode = shadow\n', "g.toml")
    with pytest.raises(ConfigError) as info:
        load_file(path)
    assert info.value.line == 4
    assert info.value.file == str(path)
    assert f"{path}:4:" in str(info.value)
    assert "invalid TOML" in str(info.value)


def test_toml_error_at_end_of_file_reports_last_line(tmp_path: Path) -> None:
    """An unclosed array or string is reported at the last line that has text."""
    error = load_error(tmp_path, '[gatekeeper]\nroutes = { "/a" = "a",\n\n', "g.toml")
    assert error.line == 2
    error = load_error(tmp_path, "[gatekeeper.limits.shop]\ntimeout_status = [504,\n\n", "g.toml")
    assert error.line == 2
    assert "end of file" in error.problem


def test_toml_gatekeeper_not_a_table_is_an_error(tmp_path: Path) -> None:
    """`gatekeeper = ...` that is not a table is reported with its line."""
    error = load_error(tmp_path, '# settings\ngatekeeper = "shop"\n', "g.toml")
    assert error.key == "gatekeeper"
    assert error.line == 2


# ----------------------------------------------------------------- properties syntax


@pytest.mark.parametrize(
    ("line", "key", "value"),
    [
        ("k=v", "k", "v"),
        ("k:v", "k", "v"),
        ("k v", "k", "v"),
        ("k\tv", "k", "v"),
        ("k\fv", "k", "v"),
        ("k = v", "k", "v"),
        ("k  :  v", "k", "v"),
        ("k\t=\tv", "k", "v"),
        ("k =v", "k", "v"),
        ("k= =v", "k", "=v"),
        ("k::v", "k", ":v"),
        ("k v=w", "k", "v=w"),
        ("k = a = b : c", "k", "a = b : c"),
        ("k", "k", ""),
        ("k =", "k", ""),
        ("k:", "k", ""),
        ("   \t k = v", "k", "v"),
        ("k = v  ", "k", "v  "),
        ("k = http://h:80/x", "k", "http://h:80/x"),
    ],
)
def test_separators_follow_java_rules(tmp_path: Path, line: str, key: str, value: str) -> None:
    """Key and value split at the first '=', ':' or white space, as Java's Properties.load."""
    assert load_properties(tmp_path, line + "\n") == {key: value}


@pytest.mark.parametrize(
    ("escaped", "meaning"),
    [
        ("\\t", "\t"),
        ("\\n", "\n"),
        ("\\r", "\r"),
        ("\\f", "\f"),
        ("\\\\", "\\"),
        ("\\=", "="),
        ("\\:", ":"),
        ("\\#", "#"),
        ("\\!", "!"),
        ("\\ ", " "),
        ("\\u0041", "A"),
        ("\\u00e9", "é"),
        ("\\u20AC", "€"),
        ("\\ud83d\\ude00", "😀"),
        ("\\b", "b"),
        ("\\q", "q"),
        ('\\"', '"'),
    ],
)
def test_escapes_in_keys_and_values(tmp_path: Path, escaped: str, meaning: str) -> None:
    """Java escapes decode the same in keys and values; unknown ones just drop the backslash."""
    text = f"k{escaped}k = v{escaped}v\n"
    assert load_properties(tmp_path, text) == {f"k{meaning}k": f"v{meaning}v"}


def test_escaped_separator_and_space_belong_to_key(tmp_path: Path) -> None:
    """An escaped '=', ':' or space is part of the key, not the separator."""
    text = "a\\=b\\:c\\ d = e\n\\ lead = x\n"
    assert load_properties(tmp_path, text) == {"a=b:c d": "e", " lead": "x"}


def test_escaped_leading_space_of_value_is_kept(tmp_path: Path) -> None:
    """A value that must start with a space escapes it, as Java writes it."""
    assert load_properties(tmp_path, "k = \\  v\n") == {"k": "  v"}


def test_comments_and_blank_lines_are_ignored(tmp_path: Path) -> None:
    """'#' and '!' lines, indented or not, and blank lines carry no settings."""
    text = "# c1\n! c2\n   # indented\n\t! tabbed\n\n  \t \nproject = shop # not a comment\n"
    settings, lines = load_file(write(tmp_path, text))
    assert settings == {"project": "shop # not a comment"}
    assert lines == {"project": 7}


def test_line_continuation_joins_lines(tmp_path: Path) -> None:
    """A trailing backslash joins the next line, without that line's leading white space."""
    text = "routes./a = first, \\\n      second, \\\n\t\fthird\nproject = shop\n"
    settings, lines = load_file(write(tmp_path, text))
    assert settings == {"routes": {"/a": "first, second, third"}, "project": "shop"}
    assert lines["routes./a"] == 1
    assert lines["project"] == 4


def test_continuation_inside_key_and_before_separator(tmp_path: Path) -> None:
    """A continuation may split a key or fall right before the separator."""
    text = "proj\\\n  ect\\\n  = shop\n"
    assert load_properties(tmp_path, text) == {"project": "shop"}


def test_even_backslashes_do_not_continue(tmp_path: Path) -> None:
    """An escaped backslash at the end of a line is a literal backslash, not a continuation."""
    text = "a = C:\\\\dir\\\\\nb = \\\\\\\n  x\n"
    assert load_properties(tmp_path, text) == {"a": "C:\\dir\\", "b": "\\x"}


def test_comment_lines_do_not_continue(tmp_path: Path) -> None:
    """A comment ending in a backslash does not swallow the next line."""
    text = "# comment \\\nproject = shop\n"
    assert load_properties(tmp_path, text) == {"project": "shop"}


def test_continued_line_starting_with_hash_is_content(tmp_path: Path) -> None:
    """A continuation line that starts with '#' is part of the value, not a comment."""
    text = "k = a\\\n  # b\n"
    assert load_properties(tmp_path, text) == {"k": "a# b"}


def test_lone_backslash_line_is_nothing(tmp_path: Path) -> None:
    """A line holding just a backslash continues into nothing, as in Java."""
    text = "\\\n# comment\n\\\n\nk = v\n"
    settings, lines = load_file(write(tmp_path, text))
    assert settings == {"k": "v"}
    assert lines["k"] == 5


@pytest.mark.parametrize("newline", ["\r\n", "\r", "\n"])
def test_all_line_terminators(tmp_path: Path, newline: str) -> None:
    """CRLF, CR and LF files load alike, continuations included, with the same line numbers."""
    text = newline.join(["# c", "a = 1", "b = x\\", "  y", "c = 3", ""])
    settings, lines = load_file(write(tmp_path, text))
    assert settings == {"a": "1", "b": "xy", "c": "3"}
    assert lines == {"a": 2, "b": 3, "c": 5}


def test_other_unicode_line_breaks_are_content(tmp_path: Path) -> None:
    """Only CR and LF end lines: vertical tab, NEL and U+2028 stay inside the value."""
    text = "k = a\x0bb\x85c\u2028d\n"
    assert load_properties(tmp_path, text) == {"k": "a\x0bb\x85c\u2028d"}


def test_utf8_and_byte_order_mark(tmp_path: Path) -> None:
    """Files are UTF-8; a leading byte order mark is not part of the first key."""
    path = tmp_path / "g.properties"
    path.write_bytes("\ufeffproject = café\n".encode())
    assert load_file(path)[0] == {"project": "café"}


# ------------------------------------------------------------------ properties mapping


def test_routes_rule_keeps_its_dots(tmp_path: Path) -> None:
    """Everything after 'routes.' is the werkzeug rule, dots and colons included."""
    text = "routes./feed.xml = feed\nroutes./orders/<int\\:id> = order\n"
    settings, lines = load_file(write(tmp_path, text))
    assert settings == {"routes": {"/feed.xml": "feed", "/orders/<int:id>": "order"}}
    assert lines["routes./orders/<int:id>"] == 2


def test_limit_path_ends_at_last_dot(tmp_path: Path) -> None:
    """A limit's path is what lies between 'limits.' and the last dot."""
    text = "limits.*/*/batch.concurrency = 1\nlimits.shop.queue = 20, 1.5\n"
    assert load_properties(tmp_path, text) == {
        "limits": {"*/*/batch": {"concurrency": "1"}, "shop": {"queue": "20, 1.5"}}
    }


def test_other_keys_nest_on_every_dot(tmp_path: Path) -> None:
    """Other dotted keys become nested tables."""
    text = "fault.format = xml\nrejected_log.body_bytes = 1024\nreload.file = /etc/g.properties\n"
    assert load_properties(tmp_path, text) == {
        "fault": {"format": "xml"},
        "rejected_log": {"body_bytes": "1024"},
        "reload": {"file": "/etc/g.properties"},
    }


@pytest.mark.parametrize("key", ["limits.shop", "limits.shop.", "limits..concurrency"])
def test_limit_without_field_is_an_error(tmp_path: Path, key: str) -> None:
    """A limits key needs both a path and a field; the error says so with the line."""
    error = load_error(tmp_path, f"project = shop\n{key} = 1\n")
    assert error.key == key
    assert error.line == 2
    assert "limits.<path>.<field>" in error.problem


@pytest.mark.parametrize("key", ["caller..header", "caller.", ".project"])
def test_empty_part_of_dotted_key_is_an_error(tmp_path: Path, key: str) -> None:
    """A dotted key with an empty part is rejected with its line."""
    error = load_error(tmp_path, f"{key} = x\n")
    assert error.key == key
    assert error.line == 1


@pytest.mark.parametrize("line", ["= value", ": value", "  = value"])
def test_empty_key_is_an_error(tmp_path: Path, line: str) -> None:
    """A line with a separator but no key is an error with its line number."""
    error = load_error(tmp_path, f"# head\n{line}\n")
    assert error.line == 2
    assert "empty key" in error.problem


@pytest.mark.parametrize(
    "text",
    ["caller = x\ncaller.header = y\n", "caller.header = y\ncaller = x\n"],
    ids=["value-first", "table-first"],
)
def test_value_and_table_conflict(tmp_path: Path, text: str) -> None:
    """A key cannot be both a value and a table; the second line is reported, naming the first."""
    error = load_error(tmp_path, text)
    assert error.line == 2
    assert "line 1" in error.problem
    assert "both a value and a table" in error.problem


def test_limits_value_and_limit_conflict(tmp_path: Path) -> None:
    """`limits = x` next to a `limits.<path>.<field>` line is a conflict too."""
    error = load_error(tmp_path, "limits.shop.concurrency = 1\n\nlimits = 5\n")
    assert error.key == "limits"
    assert error.line == 3


def test_duplicate_key_names_both_lines(tmp_path: Path) -> None:
    """A key set twice is an error naming the first line and reporting the second."""
    path = write(tmp_path, "project = a\nmode = enforce\n\\u0070roject = b\n")
    with pytest.raises(ConfigError) as info:
        load_file(path)
    assert info.value.key == "project"
    assert info.value.line == 3
    assert "line 1" in info.value.problem
    assert str(info.value).startswith(f"{path}:3: project: duplicate key")


# Each text and what java.util.Properties.load reads from it (checked with a JDK 17).
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("a = 1\nb = x\\", "x"),
        ("a = 1\nb = x\\\n", "x"),
        ("a = 1\nb = x\\\r\n", "x"),
        ("a = 1\nb = x\\\n\\\n", "x"),
        ("a = 1\nb = x\\\n   ", "x"),
        ("a = 1\nb = x\\\n# c", "x# c"),
        ("a = 1\nb = x\\\\", "x\\"),
        ("a = 1\nb = x\\\\\\", "x\\"),
    ],
    ids=["eof", "newline", "crlf", "lone-backslash", "blank", "hash", "escaped", "odd"],
)
def test_continuation_at_end_of_file_continues_into_nothing(
    tmp_path: Path, text: str, value: str
) -> None:
    """A continuation backslash on the last line is dropped and ends the value, as in
    Java's Properties.load; an escaped backslash there is a literal one."""
    settings, lines = load_file(write(tmp_path, text))
    assert settings == {"a": "1", "b": value}
    assert lines["b"] == 2


@pytest.mark.parametrize("escape", ["\\u12", "\\u12G4", "\\u", "\\u+123", "\\u 123"])
def test_malformed_unicode_escape(tmp_path: Path, escape: str) -> None:
    """A \\u escape without four hex digits is an error with its line."""
    error = load_error(tmp_path, f"project = shop\nk = a{escape}\n")
    assert error.line == 2
    assert "malformed \\uHHHH escape" in error.problem


def test_unpaired_surrogate_escape(tmp_path: Path) -> None:
    """A \\u escape that is half of a UTF-16 pair on its own is an error."""
    error = load_error(tmp_path, "k = \\ud83d!\n")
    assert error.line == 1
    assert "surrogate" in error.problem


def test_invalid_utf8_reports_line(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 are reported with the line they are on."""
    path = tmp_path / "g.properties"
    path.write_bytes(b"project = shop\r\nmode = caf\xe9\r\n")
    with pytest.raises(ConfigError) as info:
        load_file(path)
    assert info.value.line == 2
    assert "UTF-8" in info.value.problem


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("name", ["gatekeeper.yaml", "gatekeeper", "gatekeeper.ini"])
def test_unknown_suffix(tmp_path: Path, name: str) -> None:
    """A file that is neither .toml nor .properties is refused, saying what is expected."""
    error = load_error(tmp_path, "project = shop\n", name)
    assert ".toml or .properties" in error.problem
    assert error.file == str(tmp_path / name)


def test_suffix_is_case_insensitive(tmp_path: Path) -> None:
    """GATEKEEPER.PROPERTIES and .TOML are read like their lower-case names."""
    assert load_file(write(tmp_path, "project = a\n", "G.PROPERTIES"))[0] == {"project": "a"}
    assert load_file(write(tmp_path, 'project = "b"\n', "G.TOML"))[0] == {"project": "b"}


def test_missing_file(tmp_path: Path) -> None:
    """A missing file is a ConfigError naming the file, not an OSError."""
    path = tmp_path / "absent.properties"
    with pytest.raises(ConfigError) as info:
        load_file(path)
    assert info.value.key == ""
    assert info.value.file == str(path)
    assert str(path) in str(info.value)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    """A directory where the file should be is reported as unreadable."""
    (tmp_path / "conf.toml").mkdir()
    with pytest.raises(ConfigError, match="cannot read file"):
        load_file(str(tmp_path / "conf.toml"))


def test_empty_files_load_empty(tmp_path: Path) -> None:
    """Empty files are valid and configure nothing."""
    assert load_file(write(tmp_path, "", "a.properties")) == ({}, {})
    assert load_file(write(tmp_path, "", "a.toml")) == ({}, {})


# -------------------------------------------------------------------------- property


def java_escape(text: str, *, is_key: bool, unicode_escapes: bool) -> list[str]:
    """Escape like Properties.store, returning one token per character."""
    tokens = []
    for index, char in enumerate(text):
        if char == " ":
            tokens.append("\\ " if is_key or index == 0 else " ")
        elif char in "\t\n\r\f":
            tokens.append("\\" + {"\t": "t", "\n": "n", "\r": "r", "\f": "f"}[char])
        elif char in "=:#!\\":
            tokens.append("\\" + char)
        elif unicode_escapes and not (" " < char < "\x7f"):
            units = char.encode("utf-16-be")
            tokens.append(
                "".join(
                    f"\\u{int.from_bytes(units[i : i + 2], 'big'):04x}"
                    for i in range(0, len(units), 2)
                )
            )
        else:
            tokens.append(char)
    return tokens


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=150)
@given(
    entries=st.dictionaries(st.text(min_size=1), st.text(), max_size=6),
    separator=st.sampled_from(["=", ":", " = ", " ", "\t:\t", " \f"]),
    unicode_escapes=st.booleans(),
    breaks=st.lists(st.integers(min_value=0), max_size=3),
)
def test_escaped_entries_round_trip(
    tmp_path: Path,
    entries: dict[str, str],
    separator: str,
    unicode_escapes: bool,
    breaks: list[int],
) -> None:
    """Any rule and value written with Java's escaping reads back exactly, continuations too."""
    lines = []
    for rule, value in entries.items():
        tokens = [
            *java_escape("routes." + rule, is_key=True, unicode_escapes=unicode_escapes),
            separator,
            *java_escape(value, is_key=False, unicode_escapes=unicode_escapes),
        ]
        for position in breaks:
            position %= len(tokens)
            # Continuation lines lose leading white space, so only break before other text.
            if tokens[position][:1] not in (" ", "\t", "\f"):
                tokens.insert(position, "\\\n    ")
        lines.append("".join(tokens))
    settings_read, _ = load_file(write(tmp_path, "\n".join(lines) + "\n"))
    assert settings_read == ({"routes": entries} if entries else {})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("0.1234567890123", 0.1234567890123),
        ("-0", 0.0),
        ("-0.0", 0.0),
        ("1234567890123e-7", 123456.7890123),
        ("+2.5", 2.5),
        ("007.50", 7.5),
    ],
)
def test_properties_seconds_read_as_toml_and_a_dict_read_them(
    tmp_path: Path, text: str, seconds: float
) -> None:
    """A number of seconds a dict and TOML take is taken from .properties too, with the
    same value (one model, SPEC §3)."""
    properties = tmp_path / "gk.properties"
    properties.write_text(f"limits.shop.concurrency = 1\nlimits.shop.delay = {text}\n")
    toml = tmp_path / "gk.toml"
    toml.write_text(f"[gatekeeper.limits.shop]\nconcurrency = 1\ndelay = {float(text)!r}\n")
    assert load_config(str(properties)).limits["shop"].delay == seconds
    assert load_config(str(toml)).limits["shop"].delay == seconds


def test_a_negative_properties_delay_names_the_bound(tmp_path: Path) -> None:
    """-1 is a number: the message says what bound it breaks, as for a dict or TOML."""
    properties = tmp_path / "gk.properties"
    properties.write_text("limits.shop.concurrency = 1\nlimits.shop.delay = -1\n")
    with pytest.raises(ConfigError, match=r"gk.properties:2: limits.shop.delay: expected >= 0"):
        load_config(str(properties))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[gatekeeper]\nproject = "a"\nproject = "b"\n', "project"),
        ("[gatekeeper.limits.shop]\nconcurrency = 1\nconcurrency = 2\n", "limits.shop.concurrency"),
        (
            '[gatekeeper.limits."shop/x"]\nconcurrency = 1\nconcurrency = 2\n',
            "limits.shop/x.concurrency",
        ),
        (
            "[gatekeeper]\nlimits.shop.concurrency = 1\nlimits.shop.concurrency = 2\n",
            "limits.shop.concurrency",
        ),
        (
            "[gatekeeper.limits.shop]\nconcurrency = 1\n[gatekeeper.limits.shop]\nrate = '1/s'\n",
            "limits.shop",
        ),
    ],
)
def test_a_toml_duplicate_names_its_key_and_line(tmp_path: Path, text: str, key: str) -> None:
    """A key or table set twice in TOML is a ConfigError naming the key, as the same
    mistake in .properties is (tomllib's own message says only where)."""
    path = tmp_path / "gk.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_config(str(path))
    assert raised.value.key == key
    assert str(raised.value).startswith(f"{path}:3: {key}: invalid TOML")
