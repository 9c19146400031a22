"""The FlashInfer usage record: compacted on read, bounded, and an upgraded kernel
(one name recorded with two digests) keeps the newest digest with one warning."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from distcache.integrations.flashinfer import _record
from distcache.integrations.flashinfer._record import COMPACT_SUFFIX, Recorder, read_record
from distcache.testing import LoopbackOrigin

REPO = Path(__file__).resolve().parents[2]
HOST = _record._host()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _finished(directory: Path, pid: int, lines: dict[str, bytes], *, mtime: int) -> Path:
    """The record file a finished process ``pid`` of this host left, dated ``mtime``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{HOST}-{pid}-rank0.txt"
    path.write_text("".join(f"{sha(data)}  {name}\n" for name, data in lines.items()))
    os.utime(path, (mtime, mtime))
    return path


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def test_two_digests_for_one_name_keep_the_newest_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _finished(tmp_path, 11, {"pin/k.cubin": b"v2", "pin/a.cubin": b"a"}, mtime=2_000_000)
    _finished(tmp_path, 10, {"pin/k.cubin": b"v1"}, mtime=1_000_000)  # older: before the upgrade
    with caplog.at_level(logging.WARNING, logger=_record.__name__):
        assert read_record(tmp_path) == {"pin/k.cubin": sha(b"v2"), "pin/a.cubin": sha(b"a")}
        assert read_record(tmp_path) == {"pin/k.cubin": sha(b"v2"), "pin/a.cubin": sha(b"a")}
    warnings = [r for r in caplog.records if "two digests" in r.getMessage()]
    assert len(warnings) == 1  # the compacted file holds only the newest
    assert "pin/k.cubin" in warnings[0].getMessage()


def test_a_process_from_before_an_upgrade_finishing_later_does_not_bring_its_digest_back(
    tmp_path: Path,
) -> None:
    old = _finished(tmp_path, 10, {"pin/k.cubin": b"v1"}, mtime=1_000_000)
    _finished(tmp_path, 11, {"pin/k.cubin": b"v2"}, mtime=2_000_000)  # after the upgrade
    fd = os.open(old, os.O_WRONLY | os.O_APPEND)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # the pre-upgrade process still runs
        assert read_record(tmp_path) == {"pin/k.cubin": sha(b"v2")}
        assert old.exists()  # not merged while it is written
    finally:
        os.close(fd)  # it finishes: the next reads merge its file
    assert read_record(tmp_path) == {"pin/k.cubin": sha(b"v2")}
    assert read_record(tmp_path) == {"pin/k.cubin": sha(b"v2")}
    assert _files(tmp_path) == [HOST + COMPACT_SUFFIX]
    merged = (tmp_path / (HOST + COMPACT_SUFFIX)).read_text()
    assert merged == f"{sha(b'v2')}  pin/k.cubin\n"


def test_reading_merges_finished_processes_into_one_file_per_host(tmp_path: Path) -> None:
    for pid in range(20):
        _finished(tmp_path, 100 + pid, {f"pin/k{pid}.cubin": b"%d" % pid}, mtime=1_000 + pid)
    (tmp_path / "other-host-7.txt").write_text(f"{sha(b'x')}  pin/x.cubin\n")
    assert len(read_record(tmp_path)) == 21
    # Another host's file is that host's to compact.
    assert _files(tmp_path) == sorted([HOST + COMPACT_SUFFIX, "other-host-7.txt"])
    for pid in range(3):
        _finished(tmp_path, 200 + pid, {f"pin/n{pid}.cubin": b"n"}, mtime=5_000 + pid)
    assert len(read_record(tmp_path)) == 24
    assert _files(tmp_path) == sorted([HOST + COMPACT_SUFFIX, "other-host-7.txt"])


def test_a_live_writer_is_not_merged_and_keeps_recording(tmp_path: Path) -> None:
    _finished(tmp_path, 10, {"pin/old.cubin": b"o"}, mtime=1_000)
    live = Recorder(tmp_path, f"{HOST}-{os.getpid()}.txt")
    assert live.add("pin/a.cubin", sha(b"a"))
    assert set(read_record(tmp_path)) == {"pin/old.cubin", "pin/a.cubin"}
    assert live.path.exists()  # its writer holds it: not merged
    assert live.add("pin/b.cubin", sha(b"b"))
    live.close()
    # Closed: the next read merges it, and a later add opens a new file.
    assert set(read_record(tmp_path)) == {"pin/old.cubin", "pin/a.cubin", "pin/b.cubin"}
    assert not live.path.exists()
    reopened = Recorder(tmp_path, live.path.name)
    assert reopened.add("pin/c.cubin", sha(b"c"))
    reopened.close()
    assert set(read_record(tmp_path)) == {"pin/old.cubin", "pin/a.cubin", "pin/b.cubin",
                                          "pin/c.cubin"}


def test_a_writer_reopening_after_compaction_loses_nothing(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, f"{HOST}-{os.getpid()}.txt")
    for i in range(50):
        recorder.add(f"pin/k{i}.cubin", sha(b"%d" % i))
        if i % 10 == 9:
            recorder.close()  # lets the reader merge the file; the next add reopens
            read_record(tmp_path)
    recorder.close()
    assert len(read_record(tmp_path)) == 50


def test_the_record_is_bounded_dropping_the_oldest(tmp_path: Path) -> None:
    for i in range(5):
        _finished(tmp_path, 10 + i, {f"pin/k{i}.cubin": b"%d" % i}, mtime=1_000 + i)
    assert list(read_record(tmp_path, max_entries=3)) == ["pin/k2.cubin", "pin/k3.cubin",
                                                          "pin/k4.cubin"]
    compact = (tmp_path / (HOST + COMPACT_SUFFIX)).read_text().splitlines()
    assert len(compact) == 3


def test_concurrent_readers_agree_while_one_compacts(tmp_path: Path) -> None:
    for i in range(30):
        _finished(tmp_path, 10 + i, {f"pin/k{i}.cubin": b"%d" % i}, mtime=1_000 + i)
    results: list[dict[str, str]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            results.append(read_record(tmp_path))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(results) == 8 and all(r == results[0] for r in results)
    assert len(results[0]) == 30
    assert _files(tmp_path) == [HOST + COMPACT_SUFFIX]


def test_prefetch_succeeds_with_a_record_of_an_upgraded_kernel(tmp_path: Path) -> None:
    """An upgrade recorded a new digest for a name: the prefetch takes the newest,
    warns once, and exits 0 (it failed with ManifestError on every later launch)."""
    served = tmp_path / "origin"
    (served / "pin").mkdir(parents=True)
    (served / "pin" / "k.cubin").write_bytes(b"new kernel")
    record = tmp_path / "record"
    _finished(record, 10, {"pin/k.cubin": b"old kernel"}, mtime=1_000_000)
    _finished(record, 11, {"pin/k.cubin": b"new kernel"}, mtime=2_000_000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTCACHE_")}
    env.update(PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    with LoopbackOrigin(served) as origin:
        done = subprocess.run(
            [sys.executable, "-m", "distcache", "--pool", str(tmp_path / "pool"), "prefetch",
             "--flashinfer", "--record", str(record), "--origin", origin.url],
            capture_output=True, text=True, env=env, timeout=120, check=False,
        )
        assert done.returncode == 0, done.stderr
        assert origin.total_requests == 1
    assert done.stderr.count("two digests") == 1
    assert "1 artifacts" in done.stdout


def test_two_nodes_records_that_straddle_an_upgrade_keep_the_newest_on_every_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node-local record directories: node a ran before FlashInfer was upgraded (its
    record names the old digest), node b after. The job prefetches the newest digest
    on every rank, from the pools, with one warning for the job."""
    from distcache._resolve import prefetch_manifests
    from distcache.artifact import Artifact
    from distcache.comm import ThreadGroup
    from distcache.integrations.flashinfer import FlashInfer
    from distcache.store import ArtifactPool

    old, new = {"pin/k.cubin": b"v1", "pin/a.cubin": b"a"}, {"pin/k.cubin": b"v2"}
    records = [tmp_path / "record-a", tmp_path / "record-b"]
    _finished(records[0], 10, old, mtime=1_000_000)
    _finished(records[1], 11, new, mtime=2_000_000)
    pools = [ArtifactPool(tmp_path / f"pool-{n}") for n in "ab"]
    for data in (b"v2", b"a"):  # both pools are warm with what the newest record wants
        for pool in pools:
            pool.put(data, sha(data))
    assert FlashInfer(record=records[1]).recorded_ns() == 2_000_000 * 10**9
    group = ThreadGroup(2, ["node-a", "node-b"], timeout=30)
    out: list[object] = [None, None]

    def body(rank: int) -> None:
        try:
            out[rank] = prefetch_manifests(group.comm(rank), pools[rank], None,
                                           integrations=[FlashInfer(record=records[rank])],
                                           timeout=30)
        except BaseException as exc:
            out[rank] = exc

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for report in out:
        assert not isinstance(report, BaseException), report
    wanted = {Artifact("pin/k.cubin", sha(b"v2")), Artifact("pin/a.cubin", sha(b"a"))}
    for pool in pools:
        assert {Artifact(n, s) for n, s in pool.names().items()} == wanted
    warnings = [r for r in caplog.records if "two digests" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "pin/k.cubin" in warnings[0].getMessage() and sha(b"v2")[:12] in warnings[0].getMessage()
