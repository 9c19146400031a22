"""A fan-out directory of ``objects/`` that this user cannot list (another user's,
made under umask 077) is not taken for an empty one: ``pool verify`` does not call
the pool whole, and ``pool stats`` and ``gc`` say which objects they did not see."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from distcache.cli import main
from distcache.errors import PoolError
from distcache.store import ArtifactPool


def _pool_with_private_fanout(root: Path, monkeypatch: pytest.MonkeyPatch
                              ) -> tuple[ArtifactPool, str]:
    """A pool of 20 objects, one of whose fan-out directories cannot be listed."""
    pool = ArtifactPool(root)
    shas = [pool.put(f"object {i}".encode()) for i in range(20)]
    private = pool.layout.fanout(shas[0])
    real = os.scandir

    def scandir(path: object = ".") -> object:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) == private:
            raise PermissionError(errno.EACCES, "Permission denied", private)
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "scandir", scandir)
    return pool, private


def test_verify_does_not_call_a_pool_whole_that_it_could_not_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pool, private = _pool_with_private_fanout(tmp_path / "pool", monkeypatch)

    with pytest.raises(PoolError) as raised:
        pool.verify()

    assert private in str(raised.value)
    assert "not verified" in str(raised.value)
    assert raised.value.errno == errno.EACCES


def test_pool_verify_exits_1_naming_the_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _pool, private = _pool_with_private_fanout(tmp_path / "pool", monkeypatch)

    code = main(["--pool", str(tmp_path / "pool"), "pool", "verify"])

    err = capsys.readouterr().err
    assert code == 1
    assert private in err and "Permission denied" in err


def test_stats_and_gc_say_which_objects_they_did_not_see(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool, private = _pool_with_private_fanout(tmp_path / "pool", monkeypatch)

    with caplog.at_level(logging.WARNING, logger="distcache.store._maintenance"):
        stats = pool.stats()
        pool.gc(1 << 30)

    said = [r.getMessage() for r in caplog.records if private in r.getMessage()]
    assert len(said) == 2, said
    assert "not counted" in said[0] and "neither counted nor collected" in said[1]
    assert stats.objects < 20
