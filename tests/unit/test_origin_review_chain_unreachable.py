"""An origin of a chain that wrote part of an artifact and then found its server gone
(:class:`~distcache.errors.OriginUnreachable`): its bytes must not stay in front of the
next origin's. The next origin verifies only what it writes itself, so bytes left
behind would reach the pool under the artifact's sha256."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from distcache.artifact import Artifact
from distcache.errors import OriginError, OriginUnreachable
from distcache.origins import BaseOrigin, DirOrigin, OriginChain

DATA = b"the artifact's real bytes\n" * 10


class _CutThenRefused(BaseOrigin):
    """Sends the first bytes of the artifact, then the server refuses connections."""

    def __init__(self) -> None:
        self.calls = 0

    def describe(self) -> str:
        return "s3://bucket/cubins"

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        self.calls += 1
        out.write(DATA[:40])
        raise OriginUnreachable("origin s3://bucket/cubins is unreachable: connection refused",
                                url="s3://bucket/cubins", name=artifact.name,
                                cause="connection refused")


class _Pipe:
    """A stream that cannot be rewound (a pipe, a socket)."""

    def __init__(self) -> None:
        self.raw = io.BytesIO()

    def write(self, data: Any) -> int:
        return self.raw.write(data)

    def seekable(self) -> bool:
        return False

    def tell(self) -> int:
        raise io.UnsupportedOperation("tell")


def _mirror(tmp_path: Path) -> tuple[DirOrigin, Artifact]:
    root = tmp_path / "mirror"
    root.mkdir()
    (root / "k.cubin").write_bytes(DATA)
    return DirOrigin(root), Artifact("k.cubin", hashlib.sha256(DATA).hexdigest())


def test_fetch_returns_only_the_next_origins_verified_bytes(tmp_path: Path) -> None:
    mirror, artifact = _mirror(tmp_path)
    chain = OriginChain([_CutThenRefused(), mirror])
    assert chain.fetch(artifact) == DATA


def test_fetch_into_a_file_holds_only_the_artifact_after_what_came_before(
        tmp_path: Path) -> None:
    mirror, artifact = _mirror(tmp_path)
    chain = OriginChain([_CutThenRefused(), mirror])
    with open(tmp_path / "staged", "w+b") as out:
        out.write(b"HEAD")  # the stream's own bytes before the artifact stay
        assert chain.fetch_into(artifact, out) == len(DATA)
        out.seek(0)
        assert out.read() == b"HEAD" + DATA


def test_a_stream_that_cannot_be_rewound_ends_the_chain(tmp_path: Path) -> None:
    mirror, artifact = _mirror(tmp_path)
    chain = OriginChain([_CutThenRefused(), mirror])
    pipe = _Pipe()
    with pytest.raises(OriginError) as caught:
        chain.fetch_into(artifact, pipe)  # type: ignore[arg-type]
    assert not isinstance(caught.value, OriginUnreachable)  # the mirror was never asked
    assert "tried 1 of 2" in caught.value.message
    assert "s3://bucket/cubins" in caught.value.message
    assert pipe.raw.getvalue() == DATA[:40]  # nothing of the mirror's after the cut bytes


def test_every_later_artifact_gets_only_the_mirrors_bytes(tmp_path: Path) -> None:
    mirror, artifact = _mirror(tmp_path)
    down = _CutThenRefused()
    chain = OriginChain([down, mirror])
    other = Artifact("k2.cubin", artifact.sha256)
    (mirror.path / "k2.cubin").write_bytes(DATA)
    assert chain.fetch(artifact) == DATA
    assert chain.fetch(other) == DATA
    assert down.calls == 2
