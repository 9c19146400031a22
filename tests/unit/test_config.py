"""Settings: explicit > DISTCACHE_* > default, typed errors, nothing read at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from distcache.config import ENV_VARS, TABLE, Settings, parse_bytes, settings
from distcache.errors import ConfigError
from tests.support.helpers import run_group

ROOT = Path(__file__).resolve().parents[2]


def test_explicit_argument_beats_environment_beats_default() -> None:
    env = {"DISTCACHE_TIMEOUT": "42", "DISTCACHE_HTTP_RETRIES": "7"}
    assert settings({}).timeout == 600.0
    assert settings(env).timeout == 42.0
    assert settings(env, timeout=5.0).timeout == 5.0
    assert settings(env, timeout=None).timeout == 42.0  # None counts as not given
    assert settings(env).http_retries == 7


def test_zero_and_empty_are_real_values_not_defaults() -> None:
    assert settings({"DISTCACHE_HTTP_RETRIES": "0"}).http_retries == 0
    assert settings({}, http_retries=0).http_retries == 0
    assert (
        settings(
            {"DISTCACHE_DISABLE": "0"},
        ).disable
        is False
    )
    assert settings({}, disable=False).disable is False
    assert settings({"DISTCACHE_ORIGIN": ""}).origins == ()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DISTCACHE_TIMEOUT", "soon"),
        ("DISTCACHE_TIMEOUT", "-1"),
        ("DISTCACHE_HTTP_RETRIES", "many"),
        ("DISTCACHE_DOWNLOADS_PER_RANK", "0"),
        ("DISTCACHE_DISABLE", "maybe"),
        ("DISTCACHE_BUCKET_BYTES", "64 parsecs"),
        ("DISTCACHE_CHUNK_BYTES", "2G"),
        ("DISTCACHE_CHUNK_BYTES", "0"),
    ],
)
def test_bad_value_raises_config_error_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings({variable: value})
    assert info.value.variable == variable  # type: ignore[attr-defined]
    assert variable in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_keyword_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown setting"):
        settings({}, colour="blue")


@pytest.mark.parametrize(("field", "given"), [
    ("downloads_per_rank", 0), ("downloads_per_rank", -2), ("downloads_per_job", 0),
    ("http_retries", -1), ("http_retries", 2.5), ("downloads_per_rank", True),
    ("downloads_per_job", "8"),
])
def test_a_count_given_as_a_keyword_is_held_to_its_variable_s_rule(field: str,
                                                                   given: object) -> None:
    """``DISTCACHE_DOWNLOADS_PER_RANK=0`` is refused; so is ``downloads_per_rank=0``,
    which the plan would otherwise divide by."""
    with pytest.raises(ConfigError, match=field):
        settings({}, **{field: given})
    assert getattr(settings({}, **{field: 3}), field) == 3


def test_a_prefetch_told_no_download_threads_raises_a_config_error(tmp_path: Path) -> None:
    from distcache.collective import prefetch
    from distcache.comm import ThreadGroup
    from distcache.origins import DirOrigin
    from distcache.store import ArtifactPool
    from distcache.testing import make_artifacts
    from tests.support.threads import run_ranks

    artifacts = make_artifacts(tmp_path / "origin", 2, min_size=100, max_size=200, seed=5)
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    group = ThreadGroup(2, timeout=10.0)
    results = run_ranks(group, lambda comm: prefetch(
        artifacts, comm=comm, pool=pools[comm.rank], origin=DirOrigin(tmp_path / "origin"),
        timeout=10.0, downloads_per_rank=0))
    for result in results:
        assert isinstance(result, ConfigError), result
        assert "downloads_per_rank=0" in str(result)


def test_sizes_accept_units_and_reject_nonsense() -> None:
    assert parse_bytes("512") == 512
    assert parse_bytes("64M") == 64 << 20
    assert parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("2kb") == 2048
    assert settings({"DISTCACHE_BUCKET_BYTES": "1g"}).bucket_bytes == 1 << 30
    with pytest.raises(ConfigError, match="SIZE_VAR='-3'"):
        parse_bytes("-3", variable="SIZE_VAR")


@pytest.mark.parametrize("text", ["9223372036854775808", "8388608T", "1" * 400, "1" * 5000])
def test_a_size_past_any_filesystem_is_refused_naming_the_variable(text: str) -> None:
    # A cap no filesystem could reach is a typo, not "no cap"; past 4,300 digits int()
    # itself refuses, which must not escape as a bare ValueError.
    with pytest.raises(ConfigError, match=r"DISTCACHE_POOL_MAX_BYTES=.*more bytes than any"):
        parse_bytes(text, variable="DISTCACHE_POOL_MAX_BYTES")


def test_the_largest_size_and_leading_zeros_still_parse() -> None:
    assert parse_bytes("9223372036854775807") == (1 << 63) - 1
    assert parse_bytes("8388607T") == 8388607 << 40
    assert parse_bytes("0" * 30 + "64M") == 64 << 20
    assert parse_bytes("0" * 30) == 0


def test_booleans_and_numbers_parse_their_spellings() -> None:
    assert settings({"DISTCACHE_OFFLINE": "yes"}).offline is True
    assert settings({"DISTCACHE_FLASHINFER": "off"}).flashinfer is False
    assert settings({}).flashinfer is True
    assert settings({"DISTCACHE_HTTP_TIMEOUT": "2.5"}).http_timeout == 2.5
    assert settings({}).pool_max_bytes is None


def test_settings_are_frozen_and_replace_returns_a_copy() -> None:
    base = settings({})
    with pytest.raises(AttributeError):
        base.timeout = 1.0  # type: ignore[misc]
    changed = base.replace(timeout=1.0)
    assert (base.timeout, changed.timeout) == (600.0, 1.0)
    assert isinstance(changed, Settings)


def test_pool_directory_follows_xdg_then_home() -> None:
    assert settings({"XDG_CACHE_HOME": "/x"}).pool_dir == Path("/x/distcache")
    assert settings({"HOME": "/h"}).pool_dir == Path("/h/.cache/distcache")
    assert settings({"DISTCACHE_POOL": "/p"}).pool_dir == Path("/p")


def test_one_table_sets_every_setting_and_documents_every_variable() -> None:
    fields = list(Settings._fields)
    assert sorted(v.field for v in TABLE) == sorted(fields)
    assert len({v.name for v in TABLE}) == len(TABLE)
    assert {v.name: (v.shown, v.doc) for v in TABLE} == ENV_VARS


def test_a_blank_variable_is_unset_for_typed_settings_and_empty_for_lists() -> None:
    blank = {v.name: "" for v in TABLE if v.name != "DISTCACHE_FLASHINFER_FAMILIES"}
    assert settings({**blank, "HOME": "/h"}) == settings({"HOME": "/h"}).replace(origins=())
    assert settings({"DISTCACHE_ORIGIN": " a , b"}).origins == ("a", "b")
    with pytest.raises(ConfigError, match="entry 2 of 3 is empty"):
        settings({"DISTCACHE_ORIGIN": " a , ,b"})


def test_flashinfer_families_set_but_listing_nothing_is_an_error() -> None:
    assert settings({}).flashinfer_families is None
    assert settings({"DISTCACHE_FLASHINFER_FAMILIES": "*.cubin, *.h"}).flashinfer_families == (
        "*.cubin", "*.h")
    for listing_nothing in ("", " , "):
        with pytest.raises(ConfigError, match="DISTCACHE_FLASHINFER_FAMILIES"):
            settings({"DISTCACHE_FLASHINFER_FAMILIES": listing_nothing})


def test_launch_rendezvous_timeout_is_a_setting() -> None:
    assert settings({}).init_timeout == 300.0
    assert settings({"DISTCACHE_INIT_TIMEOUT": "12"}).init_timeout == 12.0


def test_nothing_is_read_at_import() -> None:
    code = (
        "import distcache, distcache.config, distcache.comm\n"
        "from distcache.config import settings\n"
        "from distcache.errors import ConfigError\n"
        "try:\n"
        "    settings()\n"
        "except ConfigError as exc:\n"
        "    print(exc.variable)\n"
    )
    env = {"PYTHONPATH": str(ROOT), "DISTCACHE_TIMEOUT": "not-a-number", "PATH": "/usr/bin:/bin"}
    proc = run_group([sys.executable, "-c", code], timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "DISTCACHE_TIMEOUT"
    assert isinstance(proc, subprocess.CompletedProcess)


def test_one_setting_read_alone_is_what_the_whole_table_gives() -> None:
    """``setting(field)`` reads one row (a check made per artifact), as settings() does."""
    from distcache.config import setting

    for env in ({}, {"DISTCACHE_OFFLINE": "1", "DISTCACHE_MAX_ARTIFACT_BYTES": "2k"},
                {"DISTCACHE_OFFLINE": " ", "DISTCACHE_MAX_ARTIFACT_BYTES": ""}):
        whole = settings(env)
        assert setting("offline", env) is whole.offline
        assert setting("max_artifact_bytes", env) == whole.max_artifact_bytes
    with pytest.raises(ConfigError, match="DISTCACHE_OFFLINE"):
        setting("offline", {"DISTCACHE_OFFLINE": "maybe"})
