"""The loader wrapper where a file FlashInfer would read is not a regular file: a FIFO
(or a symlink to one) in ``FLASHINFER_CUBIN_DIR`` or in an installed cubin directory.

Opening a FIFO for reading blocks until a writer comes, and FlashInfer's C++ side
waits on the wrapper's answer in its ctypes callback: such a file must be passed over
(and replaced, where the wrapper places the artifact), never opened in blocking mode.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact
from distcache.integrations.flashinfer import _download
from distcache.integrations.flashinfer._download import _write
from distcache.integrations.flashinfer._loader import PooledLoader
from distcache.store import ArtifactPool

HEADER = b"// header as published\n" * 20
HEADER_NAME = "pin/gemm/include/k.h"
CUBIN = b"\x7fELF kernel" * 50
CUBIN_NAME = "pin/fmha/trtllm-gen/k.cubin"
#: Seconds a call may take before it counts as blocked.
BOUND_S = 5.0


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Origin:
    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.calls: list[str] = []

    def describe(self) -> str:
        return "test://origin"

    def fetch(self, artifact: Artifact) -> bytes:
        self.calls.append(artifact.name)
        return self.files[artifact.name]


def release(fifo: Path) -> None:
    """Let a reader blocked in ``open(fifo)`` go on (it then reads nothing)."""
    with contextlib.suppress(OSError):
        if fifo.is_fifo():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def within_bound(call: Any, *fifos: Path) -> list[Any]:
    """``call()``'s answer in a list, or an empty list when it did not return within
    :data:`BOUND_S` (the FIFOs are then opened for writing, so that it can end)."""
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()
    thread.join(BOUND_S)
    blocked = thread.is_alive()
    for fifo in fifos:
        release(fifo)
    thread.join(BOUND_S)
    return [] if blocked else answer


@pytest.mark.parametrize("linked", [False, True])
def test_a_fifo_at_the_name_in_the_cubin_directory_is_replaced(
    tmp_path: Path, linked: bool
) -> None:
    cubins = tmp_path / "cubins"
    target = cubins / HEADER_NAME
    target.parent.mkdir(parents=True)
    fifo = tmp_path / "elsewhere.fifo" if linked else target
    os.mkfifo(fifo)
    if linked:
        os.symlink(fifo, target)
    origin = Origin({HEADER_NAME: HEADER})
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), lambda *a: b"",
                          origin=origin, cubin_dir=lambda: cubins)  # type: ignore[arg-type]
    assert within_bound(lambda: loader(HEADER_NAME, sha(HEADER)), fifo) == [HEADER]
    assert origin.calls == [HEADER_NAME]
    # FlashInfer's path readers open it next: the artifact is there now, as a file.
    assert not target.is_symlink() and target.is_file() and target.read_bytes() == HEADER


def test_a_fifo_in_an_installed_directory_is_passed_over(tmp_path: Path) -> None:
    installed, cubins = tmp_path / "installed", tmp_path / "cubins"
    fifo = installed / CUBIN_NAME
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    origin = Origin({CUBIN_NAME: CUBIN})
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), lambda *a: b"", origin=origin,
                          cubin_dir=lambda: cubins,
                          seed_dirs=lambda: (installed,))  # type: ignore[arg-type]
    assert within_bound(lambda: loader(CUBIN_NAME, sha(CUBIN)), fifo) == [CUBIN]
    assert origin.calls == [CUBIN_NAME]


def test_a_fifo_in_an_installed_directory_does_not_block_flashinfers_answer(
    tmp_path: Path,
) -> None:
    installed, cubins = tmp_path / "installed", tmp_path / "cubins"
    name = "pin/other/k.bin"  # outside the pooled families: the fallback answers
    fifo = installed / name
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), lambda *a: b"flashinfer's",
                          cubin_dir=lambda: cubins, seed_dirs=lambda: (installed,))
    assert within_bound(lambda: loader(name, sha(b"flashinfer's")), fifo) == [b"flashinfer's"]


def test_a_direct_download_that_cannot_replace_a_fifo_does_not_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "checksums.txt"
    os.mkfifo(fifo)

    def refuse(root: Path, target: Path, data: bytes) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(_download, "write_replacing", refuse)
    assert within_bound(lambda: _write(fifo, HEADER, None), fifo) == [False]
