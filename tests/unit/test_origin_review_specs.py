"""Origin specs that name something other than what they seem to.

A ``file://`` URL's ``#`` or ``?`` starts a fragment or a query, which a directory has
not: ``file:///data/cubins#v2`` would be read as ``/data/cubins`` and serve another
release's files. ``file:cubins`` (no ``/``) would be a directory relative to wherever
the process runs. A Windows path (``C:\\mirror``, ``\\\\server\\share``) is not a
server missing its scheme, and ``~`` is not expanded in an origin list: the error says
so, showing the spec as it was written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.errors import ConfigError
from distcache.origins import Credentials, DirOrigin, open_origin


def _open(spec: str) -> object:
    return open_origin(spec, credentials=Credentials.none())


@pytest.mark.parametrize("tail", ["#v2", "?v=2", "#", "?"])
def test_a_file_url_with_a_fragment_or_query_is_refused(tmp_path: Path, tail: str) -> None:
    (tmp_path / "cubins").mkdir()
    (tmp_path / f"cubins{tail}").mkdir()
    spec = f"file://{tmp_path}/cubins{tail}"
    with pytest.raises(ConfigError) as caught:
        _open(spec)
    message = caught.value.message
    assert repr(spec) in message
    assert "%23" in message and "%3F" in message


def test_a_hash_in_a_directory_name_is_written_percent_encoded(tmp_path: Path) -> None:
    wanted = tmp_path / "cubins#v2"
    wanted.mkdir()
    data = b"v2 kernel"
    (wanted / "k.cubin").write_bytes(data)
    (tmp_path / "cubins").mkdir()
    origin = _open(f"file://{tmp_path}/cubins%23v2")
    assert isinstance(origin, DirOrigin) and origin.path == wanted
    assert origin.fetch(Artifact("k.cubin", hashlib.sha256(data).hexdigest())) == data


def test_a_file_url_with_a_relative_path_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cubins").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        _open("file:cubins")
    assert "'file:cubins'" in caught.value.message
    assert "file:///absolute/path" in caught.value.message


@pytest.mark.parametrize("spec", ["C:\\mirror", "D:/mirrors/cubins", "\\\\server\\share\\cubins",
                                  "mirrors\\cubins"])
def test_a_windows_path_is_shown_as_written_and_not_taken_for_a_server(spec: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _open(spec)
    message = caught.value.message
    assert repr(spec) in message
    assert "http://" not in message
    assert "Windows" in message


@pytest.mark.parametrize("spec", ["~/mirror", "~", "~alice/mirror"])
def test_a_tilde_is_said_not_to_be_expanded(spec: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _open(spec)
    message = caught.value.message
    assert repr(spec) in message
    assert "'~' is not expanded" in message
    assert "$HOME" in message


def test_a_server_without_its_scheme_is_still_told_to_write_one() -> None:
    with pytest.raises(ConfigError) as caught:
        _open("mirror.example/cubins")
    assert "https://mirror.example/cubins" in caught.value.message


def test_an_origin_listed_twice_is_asked_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    with caplog.at_level("WARNING"):
        origin = _open(f"{mirror},{other},file://{mirror}, {mirror}/")
    assert [o.describe() for o in getattr(origin, "origins", ())] == [
        f"dir:{mirror}", f"dir:{other}"]
    assert caplog.text.count("listed twice") == 2
    assert isinstance(_open(f"{mirror},{mirror}"), DirOrigin)


def test_a_server_listed_twice_is_asked_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        origin = _open("https://cdn.example/c,https://mirror.example/c,https://cdn.example/c")
    assert [o.describe() for o in getattr(origin, "origins", ())] == [
        "https://cdn.example/c", "https://mirror.example/c"]
    assert "'https://cdn.example/c' is listed twice" in caplog.text


def test_servers_told_apart_by_their_query_are_both_kept() -> None:
    origin = _open("https://cdn.example/c?sig=a,https://cdn.example/c?sig=b")
    assert len(getattr(origin, "origins", ())) == 2
