"""A warm pool this process may read but not write (a read-only mount, a baked image,
another user's pool): lookups under names it has not recorded still return the
verified bytes, and an init's prefetch of what it holds succeeds; the labels it cannot
record are said once, and only writes that are asked for fail."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from distcache.artifact import Artifact, sha256_hex
from distcache.errors import PoolError
from distcache.store import ArtifactPool
from tests.support.cli import cli_env, run_read_only
from tests.support.helpers import warnings_kept

DATA = {f"kernel_{i}.cubin": bytes([i]) * (1000 + i) for i in range(3)}


@pytest.fixture
def warm(tmp_path: Path) -> Path:
    """A pool holding DATA, labelled under ``old/`` names only."""
    pool = ArtifactPool(tmp_path / "pool")
    for name, data in DATA.items():
        pool.put(data)
        pool.remember([Artifact(f"old/{name}", sha256_hex(data))])
    return pool.root


def _run(tmp_path: Path, warm: Path, body: str) -> dict[str, object]:
    """Run ``body`` (which sets ``out``) in a child with ``warm`` mounted read-only;
    return ``out`` and the warnings it logged."""
    script = tmp_path / "child.py"
    script.write_text(warnings_kept(f"""
        import sys
        from distcache.artifact import Artifact, sha256_hex
        from distcache.store import ArtifactPool
        DATA = {{f"kernel_{{i}}.cubin": bytes([i]) * (1000 + i) for i in range(3)}}
        pool = ArtifactPool({str(warm)!r})
    """, body))
    env = cli_env(tmp_path)
    done = run_read_only(env, warm, [sys.executable, str(script)])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_fetch_and_materialize_under_new_names_read_a_read_only_pool(
    tmp_path: Path, warm: Path
) -> None:
    names_before = (warm / "names.log").read_bytes()
    out = _run(tmp_path, warm, f"""
        class NoOrigin:
            def describe(self): return "no origin"
            def fetch(self, artifact): raise AssertionError("the origin was asked")
        got = []
        for name, data in DATA.items():
            artifact = Artifact("new/" + name, sha256_hex(data))
            got.append(pool.fetch(artifact, NoOrigin()) == data)
            placed = pool.materialize(artifact, {str(tmp_path / 'placed')!r})
            got.append(placed.read_bytes() == data)
        out["got"] = got
        try:
            pool.remember([Artifact("asked/for.cubin", sha256_hex(DATA["kernel_0.cubin"]))])
            out["remember"] = "recorded"
        except Exception as exc:
            out["remember"] = type(exc).__name__ + ": " + str(exc)
    """)
    assert out["got"] == [True] * 6
    # A write that is asked for still fails, naming the log and why.
    assert str(out["remember"]).startswith("PoolError: cannot open "), out
    assert "Read-only file system" in str(out["remember"])
    warnings = [w for w in out["warnings"] if "names are not recorded" in str(w)]
    assert len(warnings) == 1, out["warnings"]  # once per pool, not per lookup
    assert "names.log" in warnings[0] and "Read-only file system" in warnings[0]
    assert (warm / "names.log").read_bytes() == names_before
    assert sorted(p.name for p in (tmp_path / "placed" / "new").iterdir()) == sorted(DATA)


def test_prefetch_of_what_a_read_only_pool_holds_succeeds(tmp_path: Path, warm: Path) -> None:
    manifest = tmp_path / "checksums.txt"
    manifest.write_text("".join(f"{sha256_hex(d)}  new/{n}\n" for n, d in DATA.items()))
    out = _run(tmp_path, warm, f"""
        import distcache
        from distcache.comm import local
        artifacts = distcache.parse_checksums(open({str(manifest)!r}).read())
        for _ in range(3):  # a session's start-up prefetch, then its syncs' kind of calls
            report = distcache.prefetch(artifacts, comm=local(), pool=pool,
                                        origin=distcache.HttpOrigin("http://127.0.0.1:9"))
        out["objects"], out["downloads"] = report.objects, report.downloads
    """)
    assert (out["objects"], out["downloads"]) == (3, 0), out
    said = [w for w in out["warnings"] if "names are not recorded" in str(w)]
    assert len(said) == 1, out["warnings"]  # once per pool, not per call


def test_a_names_log_that_is_a_directory_costs_the_labels_naming_it_not_the_lookup(
    tmp_path: Path, warm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (warm / "names.log").unlink()
    (warm / "names.log").mkdir()  # EISDIR: labels only name, the bytes are still served
    pool = ArtifactPool(warm)
    data = DATA["kernel_1.cubin"]

    class NoOrigin:
        def describe(self) -> str:
            return "no origin"

        def fetch(self, artifact: Artifact) -> bytes:
            raise AssertionError("the origin was asked")

    with caplog.at_level(logging.WARNING, logger="distcache"):
        got = pool.fetch(Artifact("new/kernel_1.cubin", sha256_hex(data)), NoOrigin())
    assert got == data
    assert any(re.search(r"cannot read .*names\.log: not a regular file but a directory; "
                         "remove it", r.getMessage()) for r in caplog.records)
    with pytest.raises(PoolError, match=r"names\.log: not a regular file but a directory"):
        pool.names()
