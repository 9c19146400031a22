"""Lists of origins with an empty entry, and per-host tokens with an impossible port,
are refused with a message naming the variable, the entry and what to do; a token is
never shown."""

from __future__ import annotations

import pytest

from distcache.config import settings
from distcache.errors import ConfigError
from distcache.origins import Credentials, open_origin
from distcache.origins._credentials import parse_tokens

SECRET = "tok-secret-5e6f7a8b9c0d"


def shown(exc: ConfigError) -> str:
    return f"{exc} {exc.args!r} {getattr(exc, 'value', '')!r} {getattr(exc, 'variable', '')!r}"


# -- DISTCACHE_ORIGIN: empty entries ------------------------------------------------------


@pytest.mark.parametrize(("value", "position"), [
    ("http://a.example,,http://b.example", 2),
    ("http://a.example,http://b.example,", 3),
    (",http://b.example", 1),
    ("http://a.example,   ,http://b.example", 2),
    ("http://a.example, \t", 2),
])
def test_an_empty_origin_entry_is_refused_naming_variable_value_and_position(
        value: str, position: int) -> None:
    with pytest.raises(ConfigError) as info:
        settings({"DISTCACHE_ORIGIN": value})
    message = str(info.value)
    assert message.startswith(f"DISTCACHE_ORIGIN={value!r}: entry {position} of "), message
    assert "is empty" in message and "remove the extra comma" in message, message
    assert info.value.variable == "DISTCACHE_ORIGIN"


def test_an_empty_origin_entry_message_redacts_the_other_entries_secrets() -> None:
    value = f"https://alice:{SECRET}@mirror.example/c?sig={SECRET},,http://b.example"
    with pytest.raises(ConfigError, match=r"entry 2 of 3 is empty") as info:
        settings({"DISTCACHE_ORIGIN": value})
    assert SECRET not in shown(info.value)
    assert "mirror.example" in str(info.value)


def test_a_blank_origin_list_and_full_lists_are_still_read() -> None:
    assert settings({"DISTCACHE_ORIGIN": ""}).origins == ()
    assert settings({"DISTCACHE_ORIGIN": "   "}).origins == ()
    assert settings({"DISTCACHE_ORIGIN": " http://a.example , /m "}).origins == (
        "http://a.example", "/m")


def test_an_empty_entry_in_an_origin_string_given_directly_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^origin='http://a\.example,,http://b\.example': "
                                          r"entry 2 of 3 is empty"):
        open_origin("http://a.example,,http://b.example", credentials=Credentials.none())
    with pytest.raises(ConfigError, match=r"entry 2 of 2 is empty"):
        open_origin("http://a.example,", credentials=Credentials.none())


# -- DISTCACHE_ORIGIN_TOKENS: impossible ports ----------------------------------------------


@pytest.mark.parametrize("host", ["mirror.example:0", "mirror.example:00", "mirror.example:",
                                  "mirror.example:65536", "mirror.example:http",
                                  "mirror.example:+443", "[::1]:0"])
def test_a_token_for_an_impossible_port_is_refused_naming_the_entry_not_the_token(
        host: str) -> None:
    text = f"ok.example={SECRET}-ok, {host}={SECRET}"
    with pytest.raises(ConfigError) as info:
        parse_tokens(text)
    message = str(info.value)
    assert f"entry 2 ({host}=<redacted>) has port" in message, message
    assert "not a number from 1 to 65535" in message, message
    assert info.value.variable == "DISTCACHE_ORIGIN_TOKENS"
    assert SECRET not in shown(info.value)
    conf = settings({"DISTCACHE_ORIGIN_TOKENS": text})
    with pytest.raises(ConfigError, match="has port"):
        Credentials.from_settings(conf)


def test_tokens_for_ports_in_range_are_bound_to_those_ports() -> None:
    tokens = parse_tokens(f"a.example:1={SECRET},b.example:65535={SECRET},c.example={SECRET}")
    assert tokens[("https", "a.example", 1)] == SECRET
    assert tokens[("http", "b.example", 65535)] == SECRET
    assert tokens[("https", "c.example", 443)] == SECRET
    assert tokens[("http", "c.example", 80)] == SECRET
    assert parse_tokens(f"[::1]:8443={SECRET}")[("https", "::1", 8443)] == SECRET


@pytest.mark.parametrize("host", ["::1", "fe80::1", "2001:db8::abcd", "2001:db8::1:8443"])
def test_an_ipv6_address_without_brackets_is_refused_as_such(host: str) -> None:
    # Refused before too, as an entry that is not host[:port]=token: now saying why.
    with pytest.raises(ConfigError) as info:
        parse_tokens(f"ok.example={SECRET}, {host}={SECRET}")
    message = str(info.value)
    assert f"entry 2 ({host}=<redacted>) looks like an IPv6 address without brackets" in message
    assert f"[{host}]=TOKEN" in message and SECRET not in shown(info.value)


def test_bracketed_ipv6_addresses_are_bound_with_and_without_a_port() -> None:
    tokens = parse_tokens(f"[fe80::1]={SECRET},[2001:db8::1]:8443={SECRET}")
    assert tokens[("https", "fe80::1", 443)] == SECRET
    assert tokens[("https", "2001:db8::1", 8443)] == SECRET


@pytest.mark.parametrize("entry", ["https://mirror.example:8443", "mirror.example:8443:1",
                                   "user@mirror.example:8443"])
def test_an_entry_with_colons_that_is_no_ipv6_address_is_not_called_one(entry: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tokens(f"{entry}={SECRET}")
    assert "IPv6" not in str(info.value) and SECRET not in shown(info.value)
