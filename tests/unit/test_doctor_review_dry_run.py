"""``prefetch --dry-run --flashinfer --record DIR`` reads the usage record as it is:
it lists what the record names, and neither compacts the record's files nor leaves a
lock file among them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from distcache import cli
from distcache.integrations.flashinfer._record import _host
from tests.support.helpers import clear_settings


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_settings(monkeypatch)


def _listing(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_dry_run_leaves_the_usage_record_as_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "record"
    record.mkdir()
    sha = [hashlib.sha256(n.encode()).hexdigest() for n in ("a", "b")]
    # Two finished processes of this host: what a compaction merges and removes.
    (record / f"{_host()}-101.txt").write_text(f"{sha[0]}  kernels/a.cubin\n")
    (record / f"{_host()}-102-rank1.txt").write_text(f"{sha[1]}  kernels/b.cubin\n")
    before = _listing(record)
    capsys.readouterr()
    status = cli.main(["--pool", str(tmp_path / "pool"), "prefetch", "--flashinfer",
                       "--record", str(record), "--dry-run"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert _listing(record) == before, sorted(record.iterdir())
    assert f"  {sha[0]}  kernels/a.cubin" in out.splitlines(), out
    assert f"  {sha[1]}  kernels/b.cubin" in out.splitlines(), out
    assert not (tmp_path / "pool").exists()
