"""A mirror directory that is gone since its origin was opened (deleted, moved, a
``current`` link whose release was removed) is not a mirror that lacks each artifact:
every artifact failing alone with "not in mirror; add it to the mirror" would send the
user to fix thousands of files, and would let a batch go on asking it. The origin is
unreachable instead, and a chain goes on to its next origin without condemning the
artifact. A name whose parent is a file in a mirror that is there is simply missing."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from distcache.artifact import Artifact
from distcache.errors import ArtifactNotFound, OriginError, OriginUnreachable
from distcache.origins import DirOrigin, OriginChain

DATA = b"kernel bytes\n" * 8


def _artifact(name: str = "fmha/k.cubin") -> Artifact:
    return Artifact(name, hashlib.sha256(DATA).hexdigest(), len(DATA))


def _fill(root: Path) -> Path:
    (root / "fmha").mkdir(parents=True)
    (root / "fmha" / "k.cubin").write_bytes(DATA)
    return root


def test_a_deleted_mirror_is_unreachable_not_missing_every_artifact(tmp_path: Path) -> None:
    root = _fill(tmp_path / "mirror")
    origin = DirOrigin(root)
    assert origin.fetch(_artifact()) == DATA
    shutil.rmtree(root)
    with pytest.raises(OriginUnreachable) as caught:
        origin.fetch(_artifact())
    message = caught.value.message
    assert str(root) in message
    assert "add it to the mirror" not in message
    assert "no such directory" in message


def test_a_release_link_whose_target_was_removed_is_unreachable(tmp_path: Path) -> None:
    release = _fill(tmp_path / "v1")
    current = tmp_path / "current"
    current.symlink_to(release)
    origin = DirOrigin(current)
    assert origin.fetch(_artifact()) == DATA
    shutil.rmtree(release)
    with pytest.raises(OriginUnreachable) as caught:
        origin.fetch(_artifact())
    assert str(current) in caught.value.message


def test_a_mirror_replaced_by_a_file_is_unreachable(tmp_path: Path) -> None:
    root = _fill(tmp_path / "mirror")
    origin = DirOrigin(root)
    shutil.rmtree(root)
    root.write_bytes(b"not a directory")
    with pytest.raises(OriginUnreachable) as caught:
        origin.fetch(_artifact())
    assert "not a directory" in caught.value.message


def test_a_chain_goes_on_and_does_not_call_the_artifact_missing(tmp_path: Path) -> None:
    gone = _fill(tmp_path / "gone")
    empty = tmp_path / "empty"
    empty.mkdir()
    chain = OriginChain([DirOrigin(gone), DirOrigin(empty)])
    shutil.rmtree(gone)
    with pytest.raises(OriginError) as caught:
        chain.fetch(_artifact())
    # The gone mirror may hold it: not a definitive "no such artifact".
    assert not isinstance(caught.value, ArtifactNotFound)
    served = _fill(tmp_path / "served")
    assert OriginChain([DirOrigin(gone), DirOrigin(served)]).fetch(_artifact()) == DATA


def test_a_name_under_a_file_of_a_present_mirror_is_not_found(tmp_path: Path) -> None:
    root = _fill(tmp_path / "mirror")
    with pytest.raises(ArtifactNotFound) as caught:
        DirOrigin(root).fetch(_artifact("fmha/k.cubin/extra"))
    assert "fmha/k.cubin/extra" in caught.value.message


def test_a_link_in_the_mirror_to_nothing_says_so(tmp_path: Path) -> None:
    root = _fill(tmp_path / "mirror")
    os.symlink("v9/k.cubin", root / "fmha" / "linked.cubin")
    with pytest.raises(ArtifactNotFound) as caught:
        DirOrigin(root).fetch(_artifact("fmha/linked.cubin"))
    assert "symbolic link to v9/k.cubin" in caught.value.message


def test_a_mirror_not_made_yet_lacks_each_artifact_and_says_why(tmp_path: Path) -> None:
    origin = DirOrigin(tmp_path / "later")
    with pytest.raises(ArtifactNotFound) as caught:
        origin.fetch(_artifact())
    assert "(the mirror: no such directory)" in caught.value.message
    _fill(tmp_path / "later")
    assert origin.fetch(_artifact()) == DATA
    shutil.rmtree(tmp_path / "later")
    with pytest.raises(OriginUnreachable):  # gone, once it served a file
        origin.fetch(_artifact())
