"""A sync reads the names log from its cursor a chunk at a time (store._log
``names_since``), a line longer than any record (the zeros a power loss can leave at
a file's end, a planted file) skipped as it is read: never held whole, the records
around it kept, the mark the same as over the bytes themselves."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zlib
from pathlib import Path

from distcache.artifact import Artifact
from distcache.store import ArtifactPool
from distcache.store._log import names_since

LONG = 16 << 20


def _names_log(pool: ArtifactPool) -> Path:
    logs = [p for p in pool.root.rglob("names*") if p.is_file()]
    assert len(logs) == 1, logs
    return logs[0]


def test_a_long_line_is_skipped_without_being_held(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    before, after = pool.put(b"before"), pool.put(b"after")
    pool.remember([Artifact("before.cubin", before)])
    with _names_log(pool).open("ab") as log:
        log.write(b"\0" * LONG)  # no newline: one line longer than any record
        log.write(b"\n")
    pool.remember([Artifact("after.cubin", after)])
    path = _names_log(pool)
    labels, end, mark, _ = names_since(path, [])
    # Measured in a process of its own: nothing else allocates there meanwhile.
    code = ("import sys, tracemalloc\n"
            "from distcache.store._log import names_since\n"
            "tracemalloc.start()\n"
            "names_since(sys.argv[1], [])\n"
            "print(tracemalloc.get_traced_memory()[1])\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout)
    assert labels == {"before.cubin": before, "after.cubin": after}
    whole = path.read_bytes()
    assert end == len(whole) and mark == f"{zlib.crc32(whole):08x}"
    assert peak < LONG // 4, peak
    # A cursor within the log is taken up where it was, the long line skipped again.
    head = whole.index(b"\0")
    assert names_since(path, [(head, f"{zlib.crc32(whole[:head]):08x}")])[:3] == (
        {"after.cubin": after}, end, mark)


def test_records_read_in_chunks_keep_their_labels_and_the_mark(tmp_path: Path) -> None:
    # Enough records to span many chunks, some names multi-byte, a torn record at the
    # end: every whole one is read, and the mark covers the whole records only.
    pool = ArtifactPool(tmp_path / "pool")
    made = {}
    for i in range(3000):
        data = b"%d" % i
        made[f"d{i % 7}/k\u00e9rnel-{i}.cubin"] = hashlib.sha256(data).hexdigest()
        pool.put(data)
    pool.remember([Artifact(n, s) for n, s in made.items()])
    path = _names_log(pool)
    whole = path.read_bytes()
    with path.open("ab") as log:
        log.write(b"0" * 64 + b" torn")
    labels, end, mark, _ = names_since(path, [])
    assert labels == made and end == len(whole) and mark == f"{zlib.crc32(whole):08x}"
