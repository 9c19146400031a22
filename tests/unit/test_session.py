"""distcache.init at world size 1: the hook composes pool, prefetch, IPC and is idempotent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcache
from distcache.artifact import manifest_text
from distcache.errors import ConfigError
from distcache.testing import LoopbackOrigin, make_artifacts
from tests.support.helpers import isolated_init


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


@pytest.fixture
def origin_and_manifest(tmp_path: Path) -> Iterator[tuple[LoopbackOrigin, Path, int]]:
    artifacts = make_artifacts(tmp_path / "origin", 6, min_size=1000, max_size=5000)
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(manifest_text(artifacts))
    with LoopbackOrigin(tmp_path / "origin") as srv:
        yield srv, manifest, len(artifacts)


def test_init_prefetches_then_a_second_launch_downloads_nothing(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    srv, manifest, k = origin_and_manifest
    with distcache.init(
        pool=tmp_path / "pool", origin=srv.url, manifests=[manifest], integrations=()
    ) as session:
        assert session.report is not None
        assert session.report.downloads == k
        assert session.comm.size == 1
    assert srv.total_requests == k
    with distcache.init(
        pool=tmp_path / "pool", origin=srv.url, manifests=[manifest], integrations=()
    ) as session:
        assert session.report is not None
        assert session.report.downloads == 0
    assert srv.total_requests == k


def test_an_artifact_list_read_once_is_prefetched_whole(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    # The origin's set-up looks into the lists before the prefetch reads them: a
    # generator (read once) must reach the prefetch whole.
    from distcache.artifact import parse_checksums

    srv, manifest, k = origin_and_manifest
    listed = parse_checksums(manifest.read_text())
    with distcache.init(pool=tmp_path / "pool", origin=srv.url, integrations=(),
                        manifests=[(a for a in listed)]) as session:
        assert session.report is not None and session.report.downloads == k
    assert srv.total_requests == k


def test_second_init_returns_the_same_session(tmp_path: Path) -> None:
    first = distcache.init(pool=tmp_path / "pool", integrations=())
    second = distcache.init(pool=tmp_path / "other", integrations=())
    assert first is second
    first.close()
    third = distcache.init(pool=tmp_path / "pool", integrations=())
    assert third is not first
    third.close()


def test_disable_makes_init_a_usable_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DISTCACHE_DISABLE", "1")
    session = distcache.init(pool=tmp_path / "pool", manifests=[tmp_path / "missing.txt"])
    assert session.disabled
    assert session.pool is None
    assert session.sync() is None
    assert session.comm.size == 1
    assert not (tmp_path / "pool").exists()
    session.close()
    session.close()


def test_manifest_without_origin_is_a_config_error(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    _, manifest, _ = origin_and_manifest
    with pytest.raises(ConfigError, match="DISTCACHE_ORIGIN"):
        distcache.init(pool=tmp_path / "pool", manifests=[manifest], integrations=())


def test_init_exchanges_ipc_pools_and_closes_them(tmp_path: Path) -> None:
    from distcache.ipc import ShmPool

    producer = ShmPool(1 << 20)
    with distcache.init(pool=tmp_path / "pool", ipc_pools=[producer], integrations=()) as session:
        assert session.registry is not None
        assert dict(session.registry.opens) == {}
    assert session.closed
    producer.close()


def test_sync_on_a_closed_session_is_an_error(tmp_path: Path) -> None:
    session = distcache.init(pool=tmp_path / "pool", integrations=())
    session.close()
    with pytest.raises(distcache.errors.DistcacheError, match="closed"):
        session.sync()


class Recording:
    """An integration that wants some artifacts and records what init did with it."""

    name = "recording"

    def __init__(self, wanted: list[distcache.Artifact], origin: str | None = None) -> None:
        self.wanted = wanted
        self.origin = origin
        self.installed: list[tuple[object, object]] = []
        self.uninstalls = 0

    def available(self) -> bool:
        return True

    def default_origin(self) -> str | None:
        return self.origin

    def manifest(self) -> list[distcache.Artifact]:
        return list(self.wanted)

    def install(self, pool: object, origin: object) -> None:
        self.installed.append((pool, origin))

    def uninstall(self) -> None:
        self.uninstalls += 1

    def materialize_dir(self) -> Path | None:
        return None


def test_integrations_are_prefetched_from_their_default_origin_installed_and_uninstalled(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    srv, manifest, _ = origin_and_manifest
    wanted = distcache.parse_checksums(manifest.read_text())[:2]
    integration = Recording(wanted, origin=srv.url)
    with distcache.init(pool=tmp_path / "pool", integrations=[integration]) as session:
        assert session.report is not None and session.report.downloads == 2
        assert session.integrations == [integration]
        ((pool, origin),) = integration.installed
        assert pool is session.pool and srv.url in origin.describe()  # type: ignore[attr-defined]
    assert integration.uninstalls == 1
    assert srv.total_requests == 2


def test_a_manifest_and_an_integration_naming_one_artifact_twice_is_an_error(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    srv, manifest, _ = origin_and_manifest
    first = distcache.parse_checksums(manifest.read_text())[0]
    stale = distcache.Artifact(first.name, "0" * 64)
    with pytest.raises(distcache.errors.ManifestError, match="two digests"):
        distcache.init(pool=tmp_path / "pool", origin=srv.url, manifests=[manifest],
                       integrations=[Recording([stale])])


def test_integrations_default_to_flashinfer_and_a_list_is_exactly_what_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distcache._options import compose
    from distcache.config import settings
    from distcache.integrations.flashinfer import FlashInfer

    monkeypatch.delenv("DISTCACHE_FLASHINFER", raising=False)
    (default,) = compose(None, settings())  # FlashInfer is importable here
    assert isinstance(default, FlashInfer) and default.record is None
    other = Recording([])
    recording = FlashInfer(record=tmp_path / "rec")
    assert compose([other, recording], settings()) == [other, recording]
    assert compose([other], settings()) == [other]
    assert compose((), settings()) == []
    off = settings({"DISTCACHE_FLASHINFER": "0"})
    assert compose(None, off) == [] and compose([other, recording], off) == [other]


def test_init_options_group_the_arguments_and_keywords_replace_their_fields(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    from distcache.session import InitFields, InitOptions

    srv, manifest, k = origin_and_manifest
    options = InitOptions(pool=tmp_path / "pool", origin=srv.url, integrations=())
    with distcache.init(options, manifests=[manifest]) as session:
        assert session.report is not None and session.report.downloads == k
        assert session.options == InitOptions(pool=tmp_path / "pool", origin=srv.url,
                                               integrations=(), manifests=[manifest])
        assert options.manifests == ()  # frozen: the keywords made a new value
    # The keywords init takes are exactly the option fields.
    assert set(InitFields.__annotations__) == set(InitOptions.__match_args__)
    # A value: replace() makes a new one, assignment is refused.
    assert options.replace(timeout=5.0) == InitOptions(pool=tmp_path / "pool", origin=srv.url,
                                                       integrations=(), timeout=5.0)
    with pytest.raises(AttributeError):
        options.timeout = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field"):
        options.replace(flashinfer=False)
    assert distcache.InitOptions is InitOptions


@pytest.mark.parametrize("old", ["flashinfer", "flashinfer_record", "no_such_option"])
def test_an_unknown_init_option_is_a_config_error_naming_the_options(
    tmp_path: Path, old: str
) -> None:
    with pytest.raises(ConfigError, match=f"unknown option.*{old}.*FlashInfer\\(record=DIR\\)"):
        fields: dict[str, Any] = {old: False}
        distcache.init(pool=tmp_path / "pool", **fields)
    assert distcache.session.current() is None
    with pytest.raises(ConfigError, match="must be an InitOptions"):
        distcache.init({"pool": tmp_path / "pool"})  # type: ignore[arg-type]


def test_a_session_slot_keeps_one_session_and_close_leaves_it(tmp_path: Path) -> None:
    from distcache.session import SessionSlot, current

    slot = SessionSlot()
    first = slot.init(pool=tmp_path / "pool", integrations=())
    assert slot.current() is first and slot.init() is first
    assert current() is None  # the process's own slot is another one
    process = distcache.init(pool=tmp_path / "pool", integrations=())
    assert process is not first and current() is process
    first.close()
    assert slot.current() is None and current() is process
    second = slot.init(pool=tmp_path / "other", integrations=())
    assert second is not first and second.pool is not None
    assert second.pool.root == tmp_path / "other"
    second.close()
    process.close()
    assert current() is None


def test_a_failed_start_up_leaves_the_slot_empty(tmp_path: Path) -> None:
    from distcache.session import SessionSlot

    slot = SessionSlot()
    with pytest.raises(ConfigError):
        slot.init(pool=tmp_path / "pool", integrations=(), manifests=[[]],
                  transport="carrier-pigeon")
    assert slot.current() is None


def test_something_that_is_not_an_integration_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not an Integration"):
        distcache.init(pool=tmp_path / "pool", integrations=[object()])  # type: ignore[list-item]


def test_background_init_returns_at_once_and_wait_gives_the_report(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    srv, manifest, k = origin_and_manifest
    srv.latency = 0.3  # every request takes a while: init must not wait for them
    session = distcache.init(pool=tmp_path / "pool", origin=srv.url, manifests=[manifest],
                             integrations=(), background=True)
    assert not session.ready  # the downloads are still under way
    report = session.wait(60)
    assert session.ready
    assert report is not None and report.downloads == k
    assert session.wait() is report
    assert srv.total_requests == k
    session.close()


def test_a_background_failure_is_raised_by_wait_not_by_init(
    tmp_path: Path, origin_and_manifest: tuple[LoopbackOrigin, Path, int]
) -> None:
    from distcache.errors import PrefetchError

    srv, manifest, _ = origin_and_manifest
    srv.inject("500", count=None)
    session = distcache.init(pool=tmp_path / "pool", origin=srv.url, manifests=[manifest],
                             integrations=(), background=True, timeout=30)
    with pytest.raises(PrefetchError):
        session.wait(60)
    with pytest.raises(PrefetchError):  # again: the same error, not a hang or None
        session.wait(1)
    session.close()


def test_an_unknown_transport_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="DISTCACHE_TRANSPORT"):
        distcache.init(pool=tmp_path / "pool", integrations=(),
                       manifests=[[]], transport="carrier-pigeon")
