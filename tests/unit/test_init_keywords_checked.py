"""``init``'s keywords are checked at the call: a value of the wrong shape is a
``ConfigError`` naming the keyword (or the variable) and the shape expected, raised
before anything is set up, never a ``TypeError`` or ``AttributeError`` from deep inside
the start-up. A manifest may begin with a byte order mark."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache._prepare import as_lists
from distcache.artifact import (
    Artifact,
    decode_manifest,
    merge_manifests,
    parse_checksums,
    read_manifest,
    sha256_hex,
)
from distcache.comm import local
from distcache.config import settings
from distcache.errors import ConfigError, DistcacheError, ManifestError
from distcache.session import InitOptions
from tests.support.helpers import isolated_init

SHA = sha256_hex(b"x")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class Recorded:
    """An integration whose ``manifest()`` returns what it is given."""

    name = "recorded"

    def __init__(self, wanted: Any) -> None:
        self.wanted = wanted

    def available(self) -> bool:
        return True

    def default_origin(self) -> None:
        return None

    def manifest(self) -> Any:
        return self.wanted

    def install(self, pool: Any, origin: Any) -> None:
        pass

    def uninstall(self) -> None:
        pass

    def materialize_dir(self) -> None:
        return None


def _refused(tmp_path: Path, variable: str, **fields: Any) -> ConfigError:
    """The ConfigError ``init(**fields)`` raises, checked to name ``variable`` and to
    leave the pool unmade (raised at the call)."""
    fields.setdefault("pool", tmp_path / "pool")
    fields.setdefault("integrations", ())
    fields.setdefault("comm", local())
    with pytest.raises(ConfigError) as info:
        distcache.init(**fields)
    assert info.value.variable == variable, info.value
    assert variable in str(info.value)
    if isinstance(fields["pool"], Path):
        assert not fields["pool"].exists()
    return info.value


# --- pool ---------------------------------------------------------------------------


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_pool_is_refused_not_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blank: str) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    error = _refused(tmp_path, "pool", pool=blank)
    assert "empty" in str(error)
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("given", [b"/tmp/bytes-pool", 5, 1.5, ["a"]])
def test_a_pool_of_another_type_names_pool(tmp_path: Path, given: Any) -> None:
    error = _refused(tmp_path, "pool", pool=given)
    assert "ArtifactPool" in str(error) and "directory" in str(error)


# --- manifests ----------------------------------------------------------------------


def test_a_flat_artifact_list_is_refused_with_the_shape(tmp_path: Path) -> None:
    manifest = tmp_path / "m.txt"
    manifest.write_text(f"{SHA}  x.bin\n")
    error = _refused(tmp_path, "manifests", manifests=read_manifest(manifest))
    assert "[read_manifest(" in str(error) or "list of" in str(error)
    assert "Artifact" in str(error)


@pytest.mark.parametrize("given", [None, [None], [b"/tmp/m.txt"], [["x.bin"]], 5,
                                   [[Artifact("x.bin", SHA), "y.bin"]]])
def test_wrongly_shaped_manifests_name_manifests(tmp_path: Path, given: Any) -> None:
    error = _refused(tmp_path, "manifests", manifests=given)
    assert "list of" in str(error)


def test_a_single_manifest_path_is_still_refused(tmp_path: Path) -> None:
    error = _refused(tmp_path, "manifests", manifests=str(tmp_path / "m.txt"))
    assert "single path" in str(error)


def test_as_lists_checks_the_shape_for_every_caller() -> None:
    with pytest.raises(ConfigError, match="manifests"):
        as_lists([["x.bin"]])
    with pytest.raises(ConfigError, match="manifests"):
        as_lists(iter([None]))
    artifact = Artifact("x.bin", SHA)
    assert as_lists((iter([artifact]), "m.txt")) == [[artifact], "m.txt"]


def test_merge_manifests_names_the_part_of_a_non_artifact() -> None:
    with pytest.raises(ManifestError, match=r"^m lists 'x\.bin', which is not an Artifact"):
        merge_manifests([("m", ["x.bin"])])
    with pytest.raises(ManifestError, match=r"^m lists None"):
        merge_manifests([("m", None)])  # type: ignore[list-item]


def test_an_integration_whose_manifest_holds_names_is_named(tmp_path: Path) -> None:
    with pytest.raises(DistcacheError, match=r"recorded lists 'x\.bin', which is not an "
                                             r"Artifact") as info:
        distcache.init(pool=tmp_path / "pool", integrations=[Recorded(["x.bin"])],
                       comm=local())
    assert isinstance(info.value, ManifestError)


# --- comm ---------------------------------------------------------------------------


class MpiLike:
    """What an mpi4py communicator looks like from here: rank and size, no more."""

    rank = 0
    size = 1

    def Get_rank(self) -> int:
        return 0


@pytest.mark.parametrize("given", [MpiLike(), "gloo", 0])
def test_a_comm_that_is_not_a_communicator_points_to_from_mpi(
        tmp_path: Path, given: Any) -> None:
    error = _refused(tmp_path, "comm", comm=given)
    assert "distcache.comm.from_mpi(" in str(error)
    assert "Communicator" in str(error)


# --- integrations, ipc_pools ----------------------------------------------------------


def test_a_single_integration_is_refused_with_the_list_it_wants(tmp_path: Path) -> None:
    error = _refused(tmp_path, "integrations", integrations=Recorded([]))
    assert "list" in str(error)


def test_integrations_as_a_string_is_refused_whole(tmp_path: Path) -> None:
    error = _refused(tmp_path, "integrations", integrations="flashinfer")
    assert "'flashinfer'" in str(error) and "list" in str(error)


@pytest.mark.parametrize("given", ["abc", b"abc", object(), 3])
def test_ipc_pools_must_be_a_list(tmp_path: Path, given: Any) -> None:
    error = _refused(tmp_path, "ipc_pools", ipc_pools=given)
    assert "list" in str(error)


# --- environ, transport ----------------------------------------------------------------


@pytest.mark.parametrize("value", [5, True, None, b"5"])
def test_environ_values_must_be_strings(tmp_path: Path, value: Any) -> None:
    error = _refused(tmp_path, "DISTCACHE_TIMEOUT", environ={"DISTCACHE_TIMEOUT": value})
    assert "string" in str(error)
    if value is None:
        return  # settings() reads a None value as unset
    with pytest.raises(ConfigError, match=r"DISTCACHE_TIMEOUT.*string"):
        settings({"DISTCACHE_TIMEOUT": value})


@pytest.mark.parametrize("given", [[("A", "B")], "A=B", 5])
def test_environ_must_be_a_mapping(tmp_path: Path, given: Any) -> None:
    error = _refused(tmp_path, "environ", environ=given)
    assert "mapping" in str(error)
    with pytest.raises(ConfigError, match=r"environ.*mapping"):
        settings(given)


def test_a_keyword_transport_is_named_as_the_keyword(tmp_path: Path) -> None:
    error = _refused(tmp_path, "transport", transport="tcp")
    assert str(error).startswith("transport='tcp': expected one of default, nccl")
    assert "DISTCACHE_TRANSPORT='tcp'" not in str(error)
    with pytest.raises(ConfigError, match=r"^transport=5: expected one of"):
        settings({}, transport=5)
    with pytest.raises(ConfigError, match=r"^DISTCACHE_TRANSPORT='tcp': expected one of"):
        settings({"DISTCACHE_TRANSPORT": "tcp"})


def test_the_options_record_is_checked_as_the_keywords_are(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pool"):
        distcache.init(InitOptions(pool="", integrations=(), comm=local()))


# --- manifest text ---------------------------------------------------------------------


@pytest.mark.parametrize("line", [f"{SHA}  x", f"{SHA} *x", f"{SHA}  x\r", f"{SHA}  dir//x",
                                  f"{SHA.upper()}  x", f"  {SHA}  x"])
def test_the_separators_sha256sum_writes_are_read(line: str) -> None:
    expected = "dir/x" if "dir" in line else "x"
    assert parse_checksums(line + "\n") == [Artifact(expected, SHA)]


def test_a_manifest_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    assert parse_checksums(f"\ufeff{SHA}  x\n") == [Artifact("x", SHA)]
    with pytest.raises(ManifestError, match=r"^line 2: the manifest is not UTF-8 \(byte 71\)"):
        decode_manifest(b"\xef\xbb\xbf" + f"{SHA}  x\n".encode() + b"\xff")
    data = b"\xef\xbb\xbf" + f"{SHA}  x\n".encode()
    assert parse_checksums(decode_manifest(data)) == [Artifact("x", SHA)]
    manifest = tmp_path / "bom.txt"
    manifest.write_bytes(data)
    assert read_manifest(manifest) == [Artifact("x", SHA)]
