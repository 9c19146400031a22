"""A process's cached labels (``names.log``) after ``pool rm`` or ``pool prune``
rewrote the log in place under it: the removed label is gone from its view, labels
appended since into the byte range it had read are seen, and its own ``remember`` of
the removed name records it again for everyone. An unchanged log is not read again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.store import ArtifactPool
from distcache.store._prune import apply, plan_rm


def _put(pool: ArtifactPool, name: str) -> Artifact:
    data = name.encode()
    pool.put(data)
    artifact = Artifact(name, sha256_hex(data))
    pool.remember([artifact])
    return artifact


@pytest.fixture
def root(tmp_path: Path) -> Path:
    pool = ArtifactPool(tmp_path / "pool")
    for name in ("pin/a.cubin", "pin/b.cubin", "pin/c.cubin"):
        _put(pool, name)
    return pool.root


def test_a_long_lived_view_follows_a_removal_and_the_labels_appended_after_it(
        root: Path) -> None:
    server = ArtifactPool(root)
    assert sorted(server.names()) == ["pin/a.cubin", "pin/b.cubin", "pin/c.cubin"]
    operator = ArtifactPool(root)
    apply(operator, plan_rm(operator, ["pin/a.cubin"]))
    # Others append after the rewrite: the log grows past where the server read.
    other = ArtifactPool(root)
    for name in ("pin/d.cubin", "pin/e.cubin"):
        _put(other, name)
    expected = ["pin/b.cubin", "pin/c.cubin", "pin/d.cubin", "pin/e.cubin"]
    assert sorted(ArtifactPool(root).names()) == expected
    assert sorted(server.names()) == expected


def test_remembering_a_removed_label_records_it_again_for_everyone(root: Path) -> None:
    server = ArtifactPool(root)
    assert "pin/a.cubin" in server.names()
    operator = ArtifactPool(root)
    apply(operator, plan_rm(operator, ["pin/a.cubin"]))
    _put(ArtifactPool(root), "pin/d.cubin")
    again = _put(server, "pin/a.cubin")  # fetched again after the removal
    assert ArtifactPool(root).names()["pin/a.cubin"] == again.sha256
    assert ArtifactPool(root).has(again.sha256)


def test_a_rewrite_that_leaves_the_log_longer_is_read_again_from_the_start(
        root: Path) -> None:
    server = ArtifactPool(root)
    server.names()
    operator = ArtifactPool(root)
    apply(operator, plan_rm(operator, ["pin/b.cubin"]))
    for i in range(4):  # well past the old end before the server looks again
        _put(operator, f"pin/new{i}.cubin")
    names = server.names()
    assert "pin/b.cubin" not in names
    assert {f"pin/new{i}.cubin" for i in range(4)} <= set(names)


def test_a_rewrite_is_seen_where_the_names_around_the_old_end_share_a_long_ending(
        tmp_path: Path) -> None:
    # One kernel under two hash prefixes: the last bytes of the records are alike.
    kernel = ("batched_gemm/Bmm_Bfloat16_E2m1E2m1_Fp32_t128x8x512u2_s6_et128x8_m128x8x64_"
              "cga1x1x1_16dp256b_TN_sm100a.cubin")
    seed = ArtifactPool(tmp_path / "pool")
    a = _put(seed, f"aaaaaaaa/{kernel}")
    _put(seed, f"bbbbbbbb/{kernel}")
    server = ArtifactPool(seed.root)
    server.names()
    operator = ArtifactPool(seed.root)
    apply(operator, plan_rm(operator, ["aaaaaaaa/*"]))
    _put(ArtifactPool(seed.root), f"cccccccc/{kernel}")  # the same length as a's record
    assert sorted(server.names()) == [f"bbbbbbbb/{kernel}", f"cccccccc/{kernel}"]
    _put(server, a.name)
    assert a.name in ArtifactPool(seed.root).names()


def test_an_unchanged_log_is_not_read_again_and_an_appended_one_only_past_its_end(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.store import _names

    server = ArtifactPool(root)
    a = Artifact("pin/a.cubin", sha256_hex(b"pin/a.cubin"))
    server.names()
    reads: list[tuple[int, int]] = []
    real = _names.read_checked

    def counted(path: Path, offset: int, tail: bytes) -> Any:
        read = real(path, offset, tail)
        reads.append((offset, len(read[0])))
        return read

    monkeypatch.setattr(_names, "read_checked", counted)
    for _ in range(3):
        server.remember([a])
    assert reads == []  # one stat each, no read
    _put(ArtifactPool(root), "pin/z.cubin")
    reads.clear()
    server.remember([a])
    assert len(reads) == 1 and reads[0][0] > 0 and reads[0][1] == 1
