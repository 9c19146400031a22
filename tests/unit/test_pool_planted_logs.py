"""Something other than a regular file at a pool's logs (a FIFO, a symlink, a directory,
planted or left behind): no publication or lookup waits on it, nothing is written
through it, and the error or warning names the log, what is there and what to do.

``journal.log`` records publications: one that cannot be written fails the publication,
as an unwritable journal does. ``names.log`` only names: one that is not a regular file
costs the labels, said once, and every lookup by sha256 is still served.

Each step that could wait on a FIFO runs in a child killed after 30 s, so a hang fails
the test instead of the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import ArtifactNameError, PoolError
from distcache.store import ArtifactPool
from tests.support.cli import cli_env, run_cli
from tests.support.helpers import warnings_kept

DATA = b"verified kernel bytes " * 100
SHA = sha256_hex(DATA)


def _child(tmp_path: Path, body: str) -> dict[str, Any]:
    """Run ``body`` (which sets ``out``; ``pool_root`` and ``DATA`` are given) in a
    child killed after 30 s; its ``out`` with the warnings it logged."""
    script = tmp_path / "child.py"
    script.write_text(warnings_kept("""
        from distcache.artifact import Artifact, sha256_hex
        from distcache.store import ArtifactPool
        from distcache.store._log import AppendLog
        DATA = b"verified kernel bytes " * 100
        pool_root = {root!r}
    """.format(root=str(tmp_path / "pool")), body))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=cli_env(tmp_path), timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def _plant(path: Path, kind: str, target: Path) -> None:
    """Put a ``kind`` (fifo, symlink, directory) at ``path`` in place of the log."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(target, path)
    else:
        path.mkdir()


_SAID = {"fifo": "a FIFO", "symlink": "a symbolic link", "directory": "a directory"}

# -- journal.log -----------------------------------------------------------------------


def test_a_fifo_at_the_journal_fails_the_publication_naming_it_instead_of_hanging(
        tmp_path: Path) -> None:
    ArtifactPool(tmp_path / "pool")
    _plant(tmp_path / "pool" / "journal.log", "fifo", tmp_path)
    out = _child(tmp_path, """
        try:
            ArtifactPool(pool_root).put(DATA)
            out["put"] = "returned"
        except Exception as exc:
            out["put"] = [type(exc).__name__, str(exc), exc.errno]
    """)
    name, message, code = out["put"]
    assert name == "PoolError", out
    assert f"{tmp_path / 'pool' / 'journal.log'}: not a regular file but a FIFO" in message
    assert "remove it" in message and code == 22  # EINVAL


def test_a_fifo_at_the_journal_that_someone_reads_is_refused_and_not_written(
        tmp_path: Path) -> None:
    ArtifactPool(tmp_path / "pool")
    journal = tmp_path / "pool" / "journal.log"
    _plant(journal, "fifo", tmp_path)
    reader = os.open(journal, os.O_RDONLY | os.O_NONBLOCK)  # the open of a write succeeds
    try:
        with pytest.raises(PoolError, match=r"journal\.log: not a regular file but a FIFO"):
            ArtifactPool(tmp_path / "pool").put(DATA)
        assert os.read(reader, 4096) == b""  # nothing went through it
    finally:
        os.close(reader)


@pytest.mark.parametrize("log", ["journal.log", "names.log"])
def test_an_append_to_a_fifo_log_returns_with_an_error_naming_it(
        tmp_path: Path, log: str) -> None:
    ArtifactPool(tmp_path / "pool")
    _plant(tmp_path / "pool" / log, "fifo", tmp_path)
    out = _child(tmp_path, f"""
        import os
        try:
            AppendLog(os.path.join(pool_root, {log!r}), 0o666).append(["a" * 64])
            out["append"] = "appended"
        except Exception as exc:
            out["append"] = [type(exc).__name__, str(exc)]
    """)
    assert out["append"] == [
        "PoolError", f"cannot open {tmp_path / 'pool' / log}: not a regular file but a FIFO; "
        "remove it to let the pool start a new log"], out


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_journal_that_is_not_a_file_fails_the_publication_naming_what_is_there(
        tmp_path: Path, kind: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"")
    _plant(pool.layout.journal_log, kind, elsewhere)
    with pytest.raises(PoolError, match=f"journal\\.log: not a regular file but {_SAID[kind]}"):
        pool.put(DATA)
    assert elsewhere.read_bytes() == b""  # never written through


# -- names.log -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_planted_names_log_costs_the_labels_never_a_lookup_by_sha(
        tmp_path: Path, kind: str) -> None:
    ArtifactPool(tmp_path / "pool").put(DATA)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not a names log\n")
    _plant(tmp_path / "pool" / "names.log", kind, elsewhere)
    out = _child(tmp_path, f"""
        class NoOrigin:
            def describe(self): return "no origin"
            def fetch(self, artifact): raise AssertionError("the origin was asked")
        pool = ArtifactPool(pool_root)
        got = []
        for i in range(3):
            artifact = Artifact(f"new/kernel_{{i}}.cubin", sha256_hex(DATA))
            got.append(pool.fetch(artifact, NoOrigin()) == DATA)
            placed = pool.materialize(artifact, {str(tmp_path / 'placed')!r})
            got.append(placed.read_bytes() == DATA)
        pool.remember([Artifact("asked/for.cubin", sha256_hex(DATA))])
        out["got"] = got
    """)
    assert out["got"] == [True] * 6, out
    said = [w for w in out["warnings"] if "names are not recorded" in w]
    assert len(said) == 1, out["warnings"]  # once per pool, not per lookup
    assert f"{tmp_path / 'pool' / 'names.log'}: not a regular file but {_SAID[kind]}" in said[0]
    assert "remove it" in said[0]
    assert elsewhere.read_bytes() == b"not a names log\n"


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_distcache_fetch_serves_what_the_pool_holds_past_a_planted_names_log(
        tmp_path: Path, kind: str) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(DATA)
    _plant(pool.layout.names_log, kind, Path("/etc/passwd"))
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "kernel.cubin").write_bytes(DATA)
    fresh = b"a kernel the pool lacks"
    (origin / "fresh.cubin").write_bytes(fresh)
    manifest = tmp_path / "checksums.txt"
    manifest.write_text(f"{SHA}  kernel.cubin\n{sha256_hex(fresh)}  fresh.cubin\n")
    done = run_cli(cli_env(tmp_path), "--pool", str(pool.root), "fetch", "--manifest",
                   str(manifest), "--origin", str(origin))
    assert done.returncode == 0, done.stderr
    assert f"names.log: not a regular file but {_SAID[kind]}" in done.stderr
    assert ArtifactPool(pool.root).has(sha256_hex(fresh))


def test_a_planted_names_log_still_refuses_an_unsafe_name_and_fails_a_listing(
        tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    pool.put(DATA)
    _plant(pool.layout.names_log, "directory", tmp_path)
    with pytest.raises(ArtifactNameError):
        pool.remember([_forged("../escape.cubin")])
    # A listing of the labels has none to give: it says why rather than listing nothing.
    with pytest.raises(PoolError, match=r"names\.log: not a regular file but a directory"):
        pool.names()


def _forged(name: str) -> Artifact:
    """An Artifact of DATA that skipped validation, as duck-typed callers may pass."""
    artifact = object.__new__(Artifact)
    object.__setattr__(artifact, "name", name)
    object.__setattr__(artifact, "sha256", SHA)
    object.__setattr__(artifact, "size", None)
    return artifact
