"""Values a variable's type lets through but its use cannot take are refused where the
variable is read, naming it and the value: a count too large to agree on across ranks,
an artifact cap of no bytes, and a pool directory starting with a ``~`` no shell
expanded."""

from __future__ import annotations

from pathlib import Path

import pytest

from distcache.config import setting, settings
from distcache.errors import ConfigError

COUNTS = ("DISTCACHE_DOWNLOADS_PER_RANK", "DISTCACHE_DOWNLOADS_PER_JOB",
          "DISTCACHE_HTTP_RETRIES")


def named(error: ConfigError) -> tuple[object, object]:
    """The variable (or keyword) and the value a refusal names."""
    return error.variable, error.value  # type: ignore[attr-defined]


# --- counts ---------------------------------------------------------------------------


@pytest.mark.parametrize("variable", COUNTS)
@pytest.mark.parametrize("raw", ["9" * 80, "1000001"])
def test_a_count_past_the_largest_is_refused_naming_the_variable(variable: str,
                                                                 raw: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}='{raw}' must be") as caught:
        settings({variable: raw})
    assert named(caught.value) == (variable, raw)


@pytest.mark.parametrize("variable", COUNTS)
def test_the_largest_count_is_taken(variable: str) -> None:
    row = {"DISTCACHE_DOWNLOADS_PER_RANK": "downloads_per_rank",
           "DISTCACHE_DOWNLOADS_PER_JOB": "downloads_per_job",
           "DISTCACHE_HTTP_RETRIES": "http_retries"}[variable]
    assert getattr(settings({variable: "1000000"}), row) == 1_000_000
    assert getattr(settings({}, **{row: 1_000_000}), row) == 1_000_000


def test_a_huge_count_given_as_a_keyword_is_refused_naming_the_keyword() -> None:
    with pytest.raises(ConfigError, match="downloads_per_rank=") as caught:
        settings({}, downloads_per_rank=10 ** 80)
    assert named(caught.value) == ("downloads_per_rank", 10 ** 80)


def test_a_prefetch_told_a_huge_count_raises_a_config_error(tmp_path: Path) -> None:
    """Not a failure of the exchange the ranks agree on their counts by, which names
    neither the setting nor its value."""
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
        timeout=10.0, downloads_per_rank=int("9" * 80)))
    for result in results:
        assert isinstance(result, ConfigError), result
        assert "downloads_per_rank=" in str(result)


# --- the artifact cap -----------------------------------------------------------------


@pytest.mark.parametrize("raw", ["0", " 0 ", "0K", "0GiB"])
def test_an_artifact_cap_of_no_bytes_is_refused_as_the_keyword_is(raw: str) -> None:
    """``HttpOrigin(max_bytes=0)`` is refused; so is the variable, which would otherwise
    fail every artifact of unknown size as "over the cap of 0 bytes"."""
    with pytest.raises(ConfigError, match="DISTCACHE_MAX_ARTIFACT_BYTES") as caught:
        settings({"DISTCACHE_MAX_ARTIFACT_BYTES": raw})
    assert named(caught.value) == ("DISTCACHE_MAX_ARTIFACT_BYTES", raw)
    with pytest.raises(ConfigError, match="DISTCACHE_MAX_ARTIFACT_BYTES"):
        setting("max_artifact_bytes", {"DISTCACHE_MAX_ARTIFACT_BYTES": raw})
    assert settings({"DISTCACHE_MAX_ARTIFACT_BYTES": "1"}).max_artifact_bytes == 1


# --- the pool directory ---------------------------------------------------------------


@pytest.mark.parametrize("raw", ["~/pool", "~", "~alice/pool"])
def test_a_pool_starting_with_a_tilde_is_refused_when_read(raw: str) -> None:
    conf = settings({"DISTCACHE_POOL": raw, "HOME": "/h"})  # the other settings resolve
    with pytest.raises(ConfigError, match="DISTCACHE_POOL") as caught:
        _ = conf.pool_dir
    assert named(caught.value) == ("DISTCACHE_POOL", raw)
    assert repr(raw) in str(caught.value)


def test_a_pool_holding_a_tilde_further_on_is_a_path() -> None:
    assert settings({"DISTCACHE_POOL": "/data/~pool/"}).pool_dir == Path("/data/~pool")


def test_a_command_makes_no_directory_named_tilde(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from distcache.cli import main

    manifest = tmp_path / "m.txt"
    manifest.write_text("\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DISTCACHE_POOL", "~/pool")
    assert main(["fetch", "--manifest", str(manifest)]) != 0
    err = capsys.readouterr().err
    assert "DISTCACHE_POOL='~/pool'" in err and "internal error" not in err
    assert not (tmp_path / "~").exists()
    # --pool wins over the variable, as over a default that cannot be worked out.
    assert main(["--pool", str(tmp_path / "pool"), "fetch", "--manifest", str(manifest)]) == 0
    assert not (tmp_path / "~").exists()
