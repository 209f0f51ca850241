"""``key = "ip"`` counts an IPv6 client by its network (``ipv6_prefix``, default 64) and an
IPv4-mapped address as its IPv4 address, so one host cannot spray its /64 (SPEC §3)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from werkzeug.test import Client

from gatekeeper_wsgi import ConfigError, GateKeeper, GateKeeperMiddleware
from gatekeeper_wsgi.config import load_config
from gatekeeper_wsgi.errors import Rejected
from gatekeeper_wsgi.resolve import ip_segment
from tests.conftest import FakeClock, busy

LOGIN = {"shop/login/*": {"rate": "1/minute", "key": "ip"}}


def keeper(url: str = "memory", clock: FakeClock | None = None, **settings: Any) -> GateKeeper:
    config = {"project": "shop", "backend": url, "limits": LOGIN, **settings}
    return GateKeeper(config, clock=clock or FakeClock())


def admitted(gk: GateKeeper, address: object) -> bool:
    try:
        gk.admit("shop", "login", "anonymous", {"REMOTE_ADDR": address}).release(200)
    except Rejected:
        return False
    return True


@pytest.fixture
def gk(backend_url: str) -> Iterator[GateKeeper]:
    """A 1/minute per-address login limit on each backend."""
    keeper_ = keeper(backend_url)
    yield keeper_
    keeper_.close()


# ---------------------------------------------------------------------------- configuration


def test_ipv6_prefix_defaults_to_64() -> None:
    """Without the setting an IPv6 address counts by its /64."""
    assert load_config({}).ipv6_prefix == 64


@pytest.mark.parametrize("value", [1, 48, 128, "56"])
def test_ipv6_prefix_accepts_1_to_128(value: object) -> None:
    """Any prefix length from 1 to 128 is accepted (a string from a .properties file too)."""
    assert load_config({"ipv6_prefix": value}).ipv6_prefix == int(str(value))


@pytest.mark.parametrize("value", [0, 129, -64, "64 bits", 64.0, True, None, "9" * 5000])
def test_ipv6_prefix_out_of_range_is_a_config_error(value: object) -> None:
    """A prefix outside 1..128, or not an integer, is a ConfigError naming ipv6_prefix."""
    with pytest.raises(ConfigError) as info:
        load_config({"ipv6_prefix": value})
    assert info.value.key == "ipv6_prefix"


def test_ipv6_prefix_from_toml_and_properties(tmp_path: Path) -> None:
    """The top-level setting is read from TOML and .properties files alike."""
    toml = tmp_path / "gatekeeper.toml"
    toml.write_text("[gatekeeper]\nipv6_prefix = 48\n", encoding="utf-8")
    properties = tmp_path / "gatekeeper.properties"
    properties.write_text("ipv6_prefix = 56\n", encoding="utf-8")
    assert load_config(str(toml)).ipv6_prefix == 48
    assert load_config(str(properties)).ipv6_prefix == 56


# ------------------------------------------------------------------------------ the counting


def test_addresses_of_one_network_share_a_limit(gk: GateKeeper) -> None:
    """Two addresses of one /64 are one client; the next /64 is another. The key names
    the network in a safe segment form."""
    held = [gk.admit("shop", "login", "anonymous", {"REMOTE_ADDR": "2001:db8::1"})]
    assert not admitted(gk, "2001:db8::ffff:abcd:1")
    assert not admitted(gk, "2001:DB8:0:0:0:0:0:2")
    assert not admitted(gk, "[2001:db8::3]")  # as a proxy may write it, in brackets
    held.append(gk.admit("shop", "login", "anonymous", {"REMOTE_ADDR": "2001:db8:0:1::1"}))
    assert busy(gk) == {"shop/login/2001:db8::-64": 1, "shop/login/2001:db8:0:1::-64": 1}
    for admission in held:
        admission.release(200)


def test_ipv4_mapped_address_counts_as_its_ipv4_address(gk: GateKeeper) -> None:
    """::ffff:10.0.0.7 is the IPv4 client 10.0.0.7, under one key."""
    held = gk.admit("shop", "login", "anonymous", {"REMOTE_ADDR": "::ffff:10.0.0.7"})
    assert busy(gk) == {"shop/login/10.0.0.7": 1}
    held.release(200)
    assert not admitted(gk, "10.0.0.7")
    assert admitted(gk, "10.0.0.8")


def test_a_spray_of_a_whole_64_counts_once() -> None:
    """5 000 random addresses of one /64 get one admission between them, and one key."""
    gk = keeper()
    network = int(ipaddress.IPv6Address("2001:db8:1234:5678::"))
    addresses = [str(ipaddress.IPv6Address(network + (index * 0x9E3779B97F4A7C15 % 2**64)))
                 for index in range(1, 5001)]  # fmt: skip
    assert sum(admitted(gk, address) for address in addresses) == 1
    assert list(gk.inflight()) == ["shop/login/2001:db8:1234:5678::-64"]


@pytest.mark.parametrize(
    ("prefix", "same", "other"),
    [
        (48, "2001:db8:0:ffff::1", "2001:db8:1::1"),
        (56, "2001:db8:0:ff::1", "2001:db8:0:100::1"),
        (128, "2001:db8::1", "2001:db8::2"),
    ],
)
def test_configured_prefix_sets_the_network(prefix: int, same: str, other: str) -> None:
    """With ipv6_prefix = N, addresses agreeing on N bits share a limit."""
    gk = keeper(ipv6_prefix=prefix)
    assert admitted(gk, "2001:db8::1")
    assert not admitted(gk, same)
    assert admitted(gk, other)


def test_odd_addresses_never_raise() -> None:
    """A zone id, brackets, garbage, a 1 MB value or a non-string address is counted under
    some safe key, never an error; a zone id counts by its network."""
    gk = keeper()
    for address in ["fe80::1%eth0", "[2001:db8::1]", "not an address", "x" * 1_000_000, 7, ""]:
        admitted(gk, address)
    assert not admitted(gk, "fe80::2")
    for key in gk.inflight():
        assert len(key) <= 128 and "/" not in key.removeprefix("shop/login/")


@pytest.mark.parametrize("zone", ["eth0", "z" * 70, "0" * 5000])
def test_a_zone_id_of_any_length_counts_by_the_network(zone: str) -> None:
    """Zone ids are cut before anything else: a client spraying long ones (which would
    not fit an address's length) still counts by its /64, bracketed or not."""
    gk = keeper()
    assert admitted(gk, f"fe80::1%{zone}")
    assert not admitted(gk, f"fe80::2%{zone}x")
    assert not admitted(gk, f"[fe80::3%{zone}]")
    assert set(gk.inflight()) == {"shop/login/fe80::-64"}


def test_ipv4_is_counted_per_address(gk: GateKeeper) -> None:
    """IPv4 addresses still count one by one."""
    assert admitted(gk, "192.0.2.1")
    assert admitted(gk, "192.0.2.2")
    assert not admitted(gk, "192.0.2.1")


@given(
    st.integers(0, 2**128 - 1),
    st.integers(0, 2**128 - 1),
    st.integers(1, 128),
)
def test_same_segment_exactly_when_the_networks_agree(a: int, b: int, prefix: int) -> None:
    """Two non-mapped IPv6 addresses get one key segment exactly when their first
    ``prefix`` bits agree; the segment never holds a path separator."""
    first, second = ipaddress.IPv6Address(a), ipaddress.IPv6Address(b)
    if first.ipv4_mapped is not None or second.ipv4_mapped is not None:
        return
    same = a >> (128 - prefix) == b >> (128 - prefix)
    segment = ip_segment(str(first), prefix)
    assert (segment == ip_segment(str(second), prefix)) == same
    assert "/" not in segment and segment.endswith(f"-{prefix}")


# ---------------------------------------------------------------------------- the middleware


def ok_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def test_middleware_limits_an_ipv6_network() -> None:
    """Through the middleware, a second address of the same /64 gets the login limit's
    fault."""
    gk = keeper()
    client = Client(GateKeeperMiddleware(ok_app, gk))
    first = client.get("/login", environ_base={"REMOTE_ADDR": "2001:db8::1"})
    second = client.get(
        "/login",
        environ_base={"REMOTE_ADDR": "2001:db8::2"},
        headers={"Accept": "application/json"},
    )
    first.close()
    second.close()
    assert (first.status_code, second.status_code) == (200, 429)
    assert second.get_json()["limit"]["path"] == "shop/login/*"
    assert busy(gk) == {}


@pytest.mark.parametrize(
    ("first", "again"),
    [
        ("203.0.113.7:51234", "203.0.113.7:51235"),
        ("203.0.113.7:51234", "203.0.113.7"),
        ("[2001:db8::7]:443", "[2001:db8::9]:8443"),
        ("[2001:db8::7]:443", "2001:db8::7"),
    ],
)
def test_an_address_with_a_port_counts_as_the_address(first: str, again: str) -> None:
    """A proxy that writes the client's port with its address (Azure's X-Forwarded-For,
    through ProxyFix) gives each source port of one client: counted as the address (an
    IPv6 one by its network), not as a key per port."""
    gk = keeper()
    assert admitted(gk, first)
    assert not admitted(gk, again)
