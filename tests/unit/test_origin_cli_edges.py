"""Edges where a bad value must become the project's own refusal: an origin URL with
a port that is not one, a mirror entry that is not a regular file, a misspelt
``prefetch --jit`` name, an export into a file, and a directory that has
``objects/`` but is not a pool distcache made."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache.cli._common as cli_common
from distcache.artifact import Artifact, sha256_hex
from distcache.cli import main
from distcache.errors import ConfigError, OriginError
from distcache.origins import Credentials, DirOrigin, HttpOrigin, open_origin
from distcache.store import PoolLayout
from distcache.testing import make_artifacts
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import clear_settings

BAD_PORTS = [
    ("http://mirror.example:99999/cubins", "mirror.example:..."),
    ("https://mirror.example:65536", "mirror.example:..."),
    ("http://mirror.example:80a/cubins", "mirror.example"),
    ("https://mirror.example:-1/cubins", "mirror.example"),
    ("http://mirror.example:0/cubins", "mirror.example:0"),
    ("http://[::1]:99999/cubins", "[::1]:..."),
    ("https://user:hunter2@mirror.example:99999/c?sig=s3cret", "mirror.example:..."),
]


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


def _assert_named_without_secrets(exc: ConfigError, shown: str) -> None:
    text = str(exc)
    assert "not a valid URL" in text and shown in text, text
    assert "hunter2" not in text and "s3cret" not in text and "user" not in text
    value = str(exc.value)  # type: ignore[attr-defined]
    assert "hunter2" not in value and "s3cret" not in value


# --- a port that is not one ------------------------------------------------------------


@pytest.mark.parametrize(("url", "shown"), BAD_PORTS)
def test_an_http_origin_with_a_bad_port_is_a_config_error_naming_it(url: str,
                                                                    shown: str) -> None:
    with pytest.raises(ConfigError) as info:
        HttpOrigin(url)
    assert info.value.variable == "base_url"  # type: ignore[attr-defined]
    _assert_named_without_secrets(info.value, shown)


@pytest.mark.parametrize(("url", "shown"), BAD_PORTS)
def test_an_origin_spec_with_a_bad_port_is_a_config_error_naming_it(
    tmp_path: Path, url: str, shown: str
) -> None:
    with pytest.raises(ConfigError) as info:  # second in a chain, after a mirror
        open_origin(f"{tmp_path},{url}", credentials=Credentials.none())
    assert info.value.variable == "origin"  # type: ignore[attr-defined]
    _assert_named_without_secrets(info.value, shown)


def test_a_password_where_the_port_goes_is_never_shown() -> None:
    # "user:secret" with the "@host" left out: urlsplit reads the password as the port.
    with pytest.raises(ConfigError) as info:
        open_origin("https://user:hunter2/cubins", credentials=Credentials.none())
    assert "hunter2" not in str(info.value) and "not a valid URL" in str(info.value)


@pytest.mark.parametrize("secret", ["98765432109", "123456", "65536"])
def test_a_numeric_password_where_the_port_goes_is_never_shown(secret: str) -> None:
    # Digits longer than any port are a secret read as the port, not a mistyped port.
    with pytest.raises(ConfigError) as info:
        open_origin(f"https://alice:{secret}/cubins", credentials=Credentials.none())
    assert secret not in str(info.value) and "alice:..." in str(info.value)


def test_a_directory_named_like_a_scheme_is_a_mirror(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("https", "http", "file"):
        (tmp_path / name).mkdir()
        assert isinstance(open_origin(name, credentials=Credentials.none()), DirOrigin)


def test_a_file_url_with_a_bad_port_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not a valid URL"):
        open_origin("file://localhost:x/srv/mirror", credentials=Credentials.none())


def test_a_good_port_still_opens_an_origin() -> None:
    origin = open_origin("HTTP://Mirror.Example:8443/cubins", credentials=Credentials.none())
    assert isinstance(origin, HttpOrigin)
    assert origin.describe() == "http://mirror.example:8443/cubins"
    assert HttpOrigin("http://[::1]:8000/c").describe() == "http://[::1]:8000/c"


def test_distcache_origin_with_a_bad_port_is_refused_by_the_cli(tmp_path: Path) -> None:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(f"{sha256_hex(b'x')}  a/k.cubin\n")
    env = cli_env(tmp_path)
    env["DISTCACHE_ORIGIN"] = "https://user:hunter2@mirror.example:99999/cubins"
    done = run_cli(env, "--pool", str(tmp_path / "pool"), "fetch", "--manifest", str(manifest))
    assert done.returncode == 1, done.stderr
    assert "not a valid URL" in done.stderr and "mirror.example:..." in done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    assert "hunter2" not in done.stderr


# --- a mirror entry that is not a regular file -----------------------------------------


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every path ``os.open`` is called on while the test runs."""
    paths: list[str] = []
    real = os.open

    def spy(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        paths.append(os.fspath(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    yield paths


def test_a_fifo_in_a_mirror_is_refused_before_it_is_opened(
    tmp_path: Path, opened: list[str]
) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    os.mkfifo(mirror / "k.cubin")
    with pytest.raises(OriginError, match=r"not a regular file \(a FIFO\)"):
        DirOrigin(mirror).fetch(Artifact("k.cubin", sha256_hex(b"")))
    assert str(mirror / "k.cubin") not in opened


def test_a_link_to_a_device_in_a_mirror_is_refused_before_it_is_opened(
    tmp_path: Path, opened: list[str]
) -> None:
    mirror = tmp_path / "mirror"
    (mirror / "a").mkdir(parents=True)
    (mirror / "a" / "k.cubin").symlink_to(os.devnull)
    (mirror / "a" / "dir.cubin").mkdir()
    with pytest.raises(OriginError, match=r"not a regular file \(a device\)"):
        DirOrigin(mirror).fetch(Artifact("a/k.cubin", sha256_hex(b"")))
    with pytest.raises(OriginError, match=r"not a regular file \(a directory\)"):
        DirOrigin(mirror).fetch(Artifact("a/dir.cubin", sha256_hex(b"")))
    assert not any(p.startswith(str(mirror)) for p in opened)


def test_a_file_replaced_by_a_fifo_after_its_stat_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    fifo = mirror / "k.cubin"
    os.mkfifo(fifo)
    real = os.stat

    def as_if_regular(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        found = real(path, *args, **kwargs)
        if os.fspath(path) != str(fifo):
            return found
        # What the stat saw before the file was swapped for a FIFO.
        fields = list(found)
        fields[0] = stat.S_IFREG | 0o644
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", as_if_regular)
    with pytest.raises(OriginError, match=r"not a regular file \(a FIFO\)"):
        DirOrigin(mirror).fetch(Artifact("k.cubin", sha256_hex(b"")))


def test_a_missing_mirror_file_is_still_not_found(tmp_path: Path) -> None:
    from distcache.errors import ArtifactNotFound

    with pytest.raises(ArtifactNotFound):
        DirOrigin(tmp_path).fetch(Artifact("absent.cubin", sha256_hex(b"")))


# --- the command line ------------------------------------------------------------------


def test_prefetch_with_an_unknown_jit_cache_creates_no_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "pool"
    assert main(["prefetch", "--pool", str(root), "--jit", "inductor", "--jit", "inductr"]) == 2
    err = capsys.readouterr().err
    assert "--jit" in err and "'inductr'" in err and "inductor" in err
    assert not root.exists()


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    served = tmp_path / "origin"
    make_artifacts(served, 2, min_size=100, max_size=400, seed=5)
    root = tmp_path / "pool"
    assert main(["--pool", str(root), "pool", "import", str(served)]) == 0
    return root


@pytest.mark.parametrize("below", ["", "sub"])
def test_export_into_an_existing_file_is_a_clear_refusal(
    tmp_path: Path, pool: Path, capsys: pytest.CaptureFixture[str], below: str
) -> None:
    existing = tmp_path / "mirror.txt"
    existing.write_text("keep me\n")
    target = existing / below if below else existing
    capsys.readouterr()
    assert main(["--pool", str(pool), "pool", "export", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distcache: error: cannot export to ")
    assert f"{existing} exists and is not a directory" in err and "--tar" in err
    assert "Errno" not in err and "internal error" not in err
    assert existing.read_text() == "keep me\n"


def test_export_into_a_directory_still_writes_the_mirror(tmp_path: Path, pool: Path) -> None:
    target = tmp_path / "out" / "mirror"
    assert main(["--pool", str(pool), "pool", "export", str(target)]) == 0
    assert (target / "checksums.txt").is_file()


# --- which directory is a pool ---------------------------------------------------------


def test_pool_layout_tells_a_pool_distcache_made_from_a_directory_with_objects(
    tmp_path: Path,
) -> None:
    layout = PoolLayout(tmp_path / "p")
    assert not layout.is_pool() and not layout.is_pool(made_by_distcache=True)
    layout.objects.mkdir(parents=True)
    assert layout.is_pool() and not layout.is_pool(made_by_distcache=True)
    layout.pool_id_file.write_text("id\n")
    assert layout.is_pool(made_by_distcache=True)
    layout.pool_id_file.unlink()
    layout.format_file.write_text("1\n")
    assert layout.is_pool(made_by_distcache=True)


def test_the_cli_asks_the_layout_which_directory_is_a_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not hasattr(cli_common, "is_pool")
    foreign = tmp_path / "repo.git"
    (foreign / "objects").mkdir(parents=True)
    assert main(["--pool", str(foreign), "pool", "stats"]) == 1
    assert "not a distcache pool" in capsys.readouterr().err
    assert main(["--pool", str(foreign), "doctor", "--json"]) == 0
    assert "not created yet" in capsys.readouterr().out
    assert sorted(p.name for p in foreign.iterdir()) == ["objects"]
