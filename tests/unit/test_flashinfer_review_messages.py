"""What the loader wrapper tells a user: a refused name's warning says what was
answered, and the offline miss's recipe can be pasted into a shell whatever the
artifact's name holds."""

from __future__ import annotations

import hashlib
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, parse_checksums
from distcache.integrations.flashinfer._loader import PooledLoader, fetch_hint
from distcache.store import ArtifactPool

SHA = hashlib.sha256(b"kernel").hexdigest()


class FlashInfer:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []

    def __call__(self, file_name: Any, sha256: Any, session: Any = None) -> bytes:
        self.calls.append((file_name, sha256))
        return b"flashinfer's answer"


@pytest.mark.parametrize("name", ["../k.cubin", "/etc/passwd"])
def test_a_refused_name_is_not_said_to_go_to_flashinfer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    flashinfer = FlashInfer()
    loader = PooledLoader(ArtifactPool(tmp_path / "pool"), flashinfer)
    with caplog.at_level(logging.WARNING):
        assert loader(name, SHA) == b""
    assert flashinfer.calls == []
    [line] = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert "FlashInfer's own loader" not in line, line
    assert "b''" in line and "FLASHINFER_CUBIN_DIR" in line, line


@pytest.mark.parametrize("name", [
    "pin/gemm/include/my kernel.h",
    "pin/gemm/include/k$(touch pwned).h",
    "pin/gemm/include/it's.h",
    "pin/gemm/include/a;b&c.h",
])
def test_the_offline_recipe_writes_the_name_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setenv("FLASHINFER_CUBINS_REPOSITORY", "https://repo.example/c/")
    hint = fetch_hint(Artifact(name, SHA))
    connected = hint.removeprefix("on a connected machine run: ").split("; then here: ")[0]
    manifest = connected.split(" && ")[0]  # the printf into need.txt
    done = subprocess.run(["bash", "-c", manifest], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert parse_checksums((tmp_path / "need.txt").read_text()) == [Artifact(name, SHA)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["need.txt"]  # nothing else ran


def test_an_unwritable_cubin_directory_says_what_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from distcache.integrations.flashinfer import _install

    readonly = tmp_path / "site" / "cubins"
    monkeypatch.delenv("FLASHINFER_CUBIN_CHECKSUM_DISABLED", raising=False)
    monkeypatch.setattr(_install, "cubin_dir", lambda: readonly)
    monkeypatch.setattr(_install, "writable_cubin_dir", lambda current: None)
    with caplog.at_level(logging.WARNING):
        assert _install._choose_cubin_dir() == (readonly, None)
    [line] = [r.getMessage() for r in caplog.records if str(readonly) in r.getMessage()]
    assert "FLASHINFER_WORKSPACE_BASE" in line and "writable directory" in line, line
