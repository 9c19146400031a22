"""One check of seconds for every path a number of seconds comes in by: a
``DISTCACHE_*`` variable, an explicit keyword, a command's ``--timeout``, and a
communicator's ``timeout``. The same value is refused with the same words on each."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from distcache.cli._main import build_parser
from distcache.comm._base import check_timeout
from distcache.config import TABLE, check_seconds, settings
from distcache.errors import ConfigError
from distcache.store import ArtifactPool

NOT_SECONDS = "must be a number of seconds above 0 and at most 1,000,000"
#: ... and a wait far past what any wait downstream takes (1e10 s overflowed there).
BAD_TEXTS = ("0", "-5", "nan", "inf", "-inf", "1e400", "1e10", "1000000.5")
#: The variables whose values are seconds (their rows parse with the one check).
SECONDS_VARIABLES = ("DISTCACHE_TIMEOUT", "DISTCACHE_HTTP_TIMEOUT", "DISTCACHE_LOCK_TIMEOUT",
                     "DISTCACHE_INIT_TIMEOUT")


def named(error: ConfigError) -> tuple[Any, Any]:
    """The variable (or keyword) and the value a refusal names."""
    return error.variable, error.value  # type: ignore[attr-defined]


def cli_error(capsys: pytest.CaptureFixture[str], timeout: str) -> str:
    """What ``distcache prefetch --timeout=<timeout>`` says when it refuses the value."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["prefetch", "--manifest", "m.txt", f"--timeout={timeout}"])
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("raw", BAD_TEXTS)
def test_the_same_value_is_refused_with_the_same_words_on_every_path(
    raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError) as from_env:
        settings({"DISTCACHE_TIMEOUT": raw})
    assert str(from_env.value) == f"DISTCACHE_TIMEOUT={raw!r} {NOT_SECONDS}"
    assert named(from_env.value) == ("DISTCACHE_TIMEOUT", raw)

    number = float(raw)
    with pytest.raises(ConfigError) as explicit:
        settings({}, timeout=number)
    assert str(explicit.value) == f"timeout={number!r} {NOT_SECONDS}"
    assert named(explicit.value) == ("timeout", number)

    assert f"argument --timeout: {raw!r} {NOT_SECONDS}" in cli_error(capsys, raw)

    with pytest.raises(ValueError) as communicator:
        check_timeout(number)
    assert type(communicator.value) is ValueError  # not a ConfigError, as before
    assert str(communicator.value) == f"timeout={number!r} {NOT_SECONDS}"


def test_a_value_that_is_no_number_is_refused_with_the_same_words_on_every_path(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError, match=r"^DISTCACHE_TIMEOUT='soon' is not a number$"):
        settings({"DISTCACHE_TIMEOUT": "soon"})
    with pytest.raises(ConfigError, match=r"^timeout='soon' is not a number$"):
        settings({}, timeout="soon")
    assert "argument --timeout: 'soon' is not a number" in cli_error(capsys, "soon")
    with pytest.raises(ValueError, match=r"^timeout='soon' is not a number$"):
        check_timeout("soon")  # type: ignore[arg-type]


@pytest.mark.parametrize("given", ["5", True, False, b"5", [5]])
def test_an_explicit_timeout_must_already_be_a_number(given: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"timeout={given!r} is not a number")):
        settings({}, timeout=given)
    with pytest.raises(ValueError, match="is not a number"):
        check_timeout(given)


@pytest.mark.parametrize("name", SECONDS_VARIABLES)
@pytest.mark.parametrize("raw", BAD_TEXTS)
def test_every_seconds_variable_refuses_the_same_values(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as caught:
        settings({name: raw})
    assert str(caught.value) == f"{name}={raw!r} {NOT_SECONDS}"


@pytest.mark.parametrize("name", SECONDS_VARIABLES)
def test_every_seconds_variable_reads_a_finite_positive_number(name: str) -> None:
    field = next(v.field for v in TABLE if v.name == name)
    assert getattr(settings({name: " 2.5 "}), field) == 2.5


def test_good_seconds_are_read_as_floats_on_every_path() -> None:
    assert check_seconds(" 2.5 ", what="x") == 2.5
    assert check_seconds("1e6", what="x") == 1_000_000.0  # the longest wait taken
    assert check_seconds(7, what="x", text=False) == 7.0
    conf = settings({}, timeout=7)
    assert conf.timeout == 7.0 and isinstance(conf.timeout, float)
    assert build_parser().parse_args(["prefetch", "--manifest", "m", "--timeout", "1e-3"]
                                     ).timeout == 0.001
    check_timeout(None)
    check_timeout(0.5)


def test_an_explicit_number_of_seconds_is_an_int_or_a_float() -> None:
    # numpy's float64 is a float; its ints, float32 and Fraction are refused here, by
    # name, rather than deep in a wait that takes floats only.
    from fractions import Fraction

    np = pytest.importorskip("numpy")
    assert check_seconds(np.float64(2.5), what="timeout", text=False) == 2.5
    refused: list[Any] = [np.int64(30), np.float32(1.5), Fraction(1, 2), np.array([1.0, 2.0]),
                          True, complex(3, 0)]
    for given in refused:
        with pytest.raises(ConfigError, match="is not a number"):
            check_seconds(given, what="timeout", text=False)
        with pytest.raises(ValueError, match="is not a number"):
            check_timeout(given)


def test_check_seconds_names_what_it_checks() -> None:
    with pytest.raises(ConfigError) as caught:
        check_seconds(math.inf, what="lease", text=False)
    assert str(caught.value) == f"lease=inf {NOT_SECONDS}"
    assert named(caught.value) == ("lease", math.inf)
    with pytest.raises(ConfigError) as unnamed:
        check_seconds("0", what="")
    assert str(unnamed.value) == f"'0' {NOT_SECONDS}"
    assert named(unnamed.value) == (None, "0")


def test_an_explicit_lock_timeout_of_0_is_still_taken(tmp_path: Path) -> None:
    assert settings({}, lock_timeout=0).lock_timeout == 0
    assert ArtifactPool(tmp_path / "pool", lock_timeout=0).lock_timeout == 0
    # From the environment 0 is refused, as every other variable of seconds refuses it.
    with pytest.raises(ConfigError, match=f"DISTCACHE_LOCK_TIMEOUT='0' {NOT_SECONDS}"):
        settings({"DISTCACHE_LOCK_TIMEOUT": "0"})


def test_the_rows_that_check_an_explicit_value() -> None:
    checked = {v.field for v in TABLE if v.check is not None}
    assert checked == {"timeout", "init_timeout", "transport", "http_retries",
                       "downloads_per_rank", "downloads_per_job"}


@pytest.mark.parametrize("given", [0, -1.0, math.inf, math.nan, 1e10])
def test_an_http_origin_and_the_rendezvous_take_the_one_seconds_check(given: float) -> None:
    from distcache.origins import HttpOrigin

    with pytest.raises(ConfigError, match=r"^timeout=.* must be a number of seconds above 0"):
        HttpOrigin("http://mirror.example/c", timeout=given)
    with pytest.raises(ConfigError, match=r"^init_timeout=.* must be a number of seconds"):
        settings({}, init_timeout=given)


def test_an_explicit_transport_is_checked_by_its_row() -> None:
    assert settings({}, transport=" NCCL ").transport == "nccl"
    with pytest.raises(ConfigError, match=r"^transport='pigeon': expected one of"):
        settings({}, transport="pigeon")
    with pytest.raises(ConfigError, match=r"DISTCACHE_TRANSPORT='pigeon': expected one of"):
        settings({"DISTCACHE_TRANSPORT": "pigeon"})
