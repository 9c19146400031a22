"""A foreground init installs the integrations that read nothing the prefetch brings
while the prefetch runs, the others after it; failures on either side leave nothing
installed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import distcache
from distcache.artifact import Artifact, manifest_text
from distcache.errors import ConfigError, PrefetchError
from distcache.origins import DirOrigin
from distcache.session import current
from distcache.testing import make_artifacts
from tests.support.helpers import PlainIntegration, isolated_init, on_threads

HELD_S = 3.0  # how long a held download waits for the install before it gives up


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


class HeldOrigin(DirOrigin):
    """A directory origin whose downloads wait until ``released`` is set (or
    :data:`HELD_S` passes, then they fail): what an install beside the prefetch can
    release and an install after it cannot."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.released = threading.Event()
        self.waited_out = 0

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        if not self.released.wait(HELD_S):
            self.waited_out += 1
            raise distcache.errors.OriginError(f"{artifact.name}: held past {HELD_S} s",
                                               name=artifact.name)
        return super().fetch_into(artifact, out)


class Noting(PlainIntegration):
    """An integration that notes, at its install, which of ``watched`` the pool held,
    and can release a held origin or fail."""

    name = "noting"

    def __init__(self, watched: list[Artifact], *, release: threading.Event | None = None,
                 fail: bool = False, order: list[str] | None = None) -> None:
        self.watched, self.release, self.fail = watched, release, fail
        self.held_at_install: list[bool] | None = None
        self.on_thread: str | None = None
        self.order = order if order is not None else []
        self.uninstalls = 0

    def install(self, pool: Any, origin: Any) -> None:
        self.held_at_install = [pool.has(a.sha256) for a in self.watched]
        self.on_thread = threading.current_thread().name
        if self.release is not None:
            self.release.set()
        if self.fail:
            raise ConfigError(f"{self.name}: cannot install here")
        self.order.append(self.name)

    def uninstall(self) -> None:
        self.uninstalls += 1


class Beside(Noting):
    name = "beside"
    install_beside_prefetch = True


def _init(tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]],
          integrations: list[Noting], **options: Any) -> distcache.Session:
    origin, manifest, _ = held
    return distcache.init(pool=tmp_path / "pool", origin=origin, manifests=[manifest],
                          integrations=integrations, **options)


@pytest.fixture
def held(tmp_path: Path) -> tuple[HeldOrigin, Path, list[Artifact]]:
    artifacts = make_artifacts(tmp_path / "origin", 4, min_size=1000, max_size=4000)
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(manifest_text(artifacts))
    return HeldOrigin(tmp_path / "origin"), manifest, artifacts


def test_an_install_beside_the_prefetch_runs_while_the_downloads_wait_and_the_rest_after(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]]
) -> None:
    origin, _, artifacts = held
    order: list[str] = []
    after = Noting(artifacts, order=order)
    beside = Beside(artifacts, release=origin.released, order=order)
    with _init(tmp_path, held, [after, beside]) as session:
        # The downloads waited for the install: it ran on its own thread before any
        # artifact was in the pool; the other install came after every one was.
        assert origin.waited_out == 0
        assert beside.held_at_install == [False] * len(artifacts)
        assert beside.on_thread == "distcache-install"
        assert after.held_at_install == [True] * len(artifacts)
        assert session.report is not None and session.report.downloads == len(artifacts)
        assert order == ["beside", "noting"] and session.integrations == [beside, after]
        # The install beside is timed apart: it overlaps the prefetch's phase.
        assert session.phases["beside:beside"] > 0 and session.phases["noting"] > 0
        assert "beside" not in session.phases
    assert beside.uninstalls == 1 and after.uninstalls == 1


def test_without_the_attribute_an_install_waits_for_the_prefetch(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]]
) -> None:
    # The same integration, not marked: its release comes only after the prefetch,
    # so every held download gives up and init fails (what the first test rules out).
    origin, _, artifacts = held
    plain = Noting(artifacts, release=origin.released)
    with pytest.raises(PrefetchError):
        _init(tmp_path, held, [plain], timeout=60)
    assert origin.waited_out > 0 and plain.held_at_install is None
    assert current() is None


def test_a_failing_install_beside_the_prefetch_raises_after_it_and_installs_nothing_else(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]]
) -> None:
    origin, _, artifacts = held
    after = Noting(artifacts)
    # It releases the held downloads, then fails: raised only once the prefetch is over.
    broken = Beside(artifacts, release=origin.released, fail=True)
    with pytest.raises(ConfigError, match="beside: cannot install here"):
        _init(tmp_path, held, [broken, after])
    assert broken.on_thread == "distcache-install" and origin.waited_out == 0
    # The prefetch ran to its end first (a collective is never left half-way).
    pool = distcache.ArtifactPool(tmp_path / "pool")
    assert all(pool.has(a.sha256) for a in artifacts)
    assert after.held_at_install is None and after.uninstalls == 0
    assert broken.uninstalls == 0 and current() is None


def test_an_install_failing_on_one_rank_leaves_the_other_ranks_ready(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]]
) -> None:
    # Two nodes with a pool each: every rank runs the prefetch, then the node agents'
    # endpoints are shared (a collective). The failing rank raises after that round,
    # so the other is not left waiting in it for the timeout.
    from distcache.comm import ThreadGroup
    from distcache.session import SessionSlot

    origin, manifest, artifacts = held
    origin.released.set()
    group = ThreadGroup(2, ["node-a", "node-b"], timeout=5)
    out = on_threads(2, lambda rank: SessionSlot().init(
        comm=group.comm(rank), pool=tmp_path / f"pool-{rank}", origin=origin,
        manifests=[manifest], integrations=[Beside(artifacts, fail=rank == 0)], timeout=5))
    assert isinstance(out[0], ConfigError), out[0]
    assert isinstance(out[1], distcache.Session), out[1]
    assert out[1].report is not None and out[1].report.objects == len(artifacts)
    out[1].close()


def test_a_failing_prefetch_uninstalls_what_was_installed_beside_it(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]]
) -> None:
    origin, _, artifacts = held
    (tmp_path / "origin" / artifacts[0].name).unlink()  # one download fails for good
    beside = Beside(artifacts, release=origin.released)
    after = Noting(artifacts)
    with pytest.raises(PrefetchError, match=artifacts[0].name):
        _init(tmp_path, held, [beside, after])
    assert beside.held_at_install is not None and beside.uninstalls == 1
    assert after.held_at_install is None and current() is None


def test_in_the_background_every_install_follows_the_prefetch(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]]
) -> None:
    # The engine may look artifacts up while a background start-up runs: the wrapper
    # is put in front of the loader only once the prefetch is over.
    origin, _, artifacts = held
    origin.released.set()
    beside = Beside(artifacts)
    session = _init(tmp_path, held, [beside], background=True)
    report = session.wait()
    assert report is not None and report.downloads == len(artifacts)
    assert beside.held_at_install == [True] * len(artifacts)
    assert beside.on_thread == "distcache-start-up"
    session.close()
    assert beside.uninstalls == 1


@pytest.mark.parametrize(("imported", "environ", "beside"), [
    (True, {}, True),
    (False, {}, True),
    (False, {"FLASHINFER_LOGLEVEL": "3"}, True),
    # FlashInfer's import at level 10 installs a SIGTERM handler: main thread only.
    (False, {"FLASHINFER_LOGLEVEL": "10"}, False),
    (True, {"FLASHINFER_LOGLEVEL": "10"}, True),
    (False, {"FLASHINFER_LOGLEVEL": "x"}, False),
    (False, {"FLASHINFER_LOGLEVEL": "\u00b2"}, False),  # a digit int() refuses
    # Offline, the install sets FLASHINFER_NO_DOWNLOAD: not beside running threads.
    (True, {"DISTCACHE_OFFLINE": "1"}, False),
])
def test_flashinfer_is_installed_beside_the_prefetch_where_its_install_allows_it(
    monkeypatch: pytest.MonkeyPatch, imported: bool, environ: dict[str, str], beside: bool
) -> None:
    import sys

    from distcache._beside import installs_beside
    from distcache.integrations.flashinfer import FlashInfer
    from distcache.integrations.flashinfer._upstream import LOADER_MODULE

    monkeypatch.delenv("FLASHINFER_LOGLEVEL", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if imported:
        monkeypatch.setitem(sys.modules, LOADER_MODULE, sys.modules.get(LOADER_MODULE)
                            or type(sys)(LOADER_MODULE))
    else:
        monkeypatch.delitem(sys.modules, LOADER_MODULE, raising=False)
    assert installs_beside(FlashInfer()) is beside


def test_an_install_failing_beside_a_failing_prefetch_is_logged_under_its_error(
    tmp_path: Path, held: tuple[HeldOrigin, Path, list[Artifact]],
    caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    artifacts = held[2]  # never released: every download gives up
    broken = Beside(artifacts, fail=True)
    with caplog.at_level(logging.WARNING, logger="distcache"), \
            pytest.raises(PrefetchError, match="held past"):
        _init(tmp_path, held, [broken])
    assert any("installing beside beside the prefetch failed as well" in r.getMessage()
               and "cannot install here" in r.getMessage() for r in caplog.records)
    assert broken.uninstalls == 0 and current() is None


def test_an_interrupted_wait_leaves_the_install_which_then_uninstalls_itself(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    from distcache import _beside

    monkeypatch.setattr(_beside, "ABANDON_S", 0.2)
    gate = threading.Event()

    class Hung(Beside):
        def install(self, pool: Any, origin: Any) -> None:
            gate.wait(30)  # an import stuck on a hung filesystem, until released
            super().install(pool, origin)

    hung = Hung([])
    beside = _beside.InstallsBeside([hung], None, None, {})  # type: ignore[arg-type]
    beside.start()
    # Ctrl-C: SIGINT to the main thread, waiting in the join.
    main = threading.main_thread().ident
    assert main is not None
    installed: list[Any] = []
    # A job started in the background (as CI's may be) inherits SIGINT ignored.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()
            beside.join_into(installed)  # Ctrl-C: left after ABANDON_S, not for ever
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert installed == [] and hung.uninstalls == 0
    gate.set()
    deadline = time.monotonic() + 10
    while hung.uninstalls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    # It ended after init had gone on without it: it took itself out again.
    assert hung.order == ["beside"] and hung.uninstalls == 1
