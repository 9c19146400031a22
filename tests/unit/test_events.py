"""Structured events: one JSON line each, appended, never raising into the caller."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from distcache import _events


def test_each_event_is_one_json_line_with_its_fields(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(target))
    assert _events.emit("prefetch", artifacts=3, seconds={"fetch": 0.5}, path=tmp_path)
    assert _events.emit("loader", hits=1)
    lines = target.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["event"] == "prefetch" and first["artifacts"] == 3
    assert first["seconds"] == {"fetch": 0.5} and first["path"] == str(tmp_path)
    assert {"ts", "pid", "host"} <= set(first)
    assert json.loads(lines[1])["event"] == "loader"


def test_nothing_is_written_when_the_variable_is_unset_or_blank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCACHE_LOG_JSON", raising=False)
    assert _events.emit("prefetch") is False
    monkeypatch.setenv("DISTCACHE_LOG_JSON", "  ")
    assert _events.emit("prefetch") is False


def test_an_unwritable_file_drops_the_event_and_logs_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(tmp_path / "missing-dir" / "events.jsonl"))
    _events._warned.clear()
    assert _events.emit("prefetch", n=1) is False
    assert _events.emit("prefetch", n=2) is False
    warnings = [r for r in caplog.records if "DISTCACHE_LOG_JSON" in r.getMessage()]
    assert len(warnings) == 1


def _writer(path: str, tag: int) -> None:
    import os

    os.environ["DISTCACHE_LOG_JSON"] = path
    for i in range(200):
        _events.emit("line", tag=tag, i=i, pad="x" * 300)


def test_lines_from_several_processes_never_interleave(tmp_path: Path) -> None:
    target = tmp_path / "events.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(target), tag)) for tag in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 600
    assert {(r["tag"], r["i"]) for r in records} == {(t, i) for t in range(3) for i in range(200)}


def _family(tmp_path: Path) -> list[Any]:
    import hashlib

    from distcache.artifact import Artifact

    arts = []
    for i in range(5):
        data = f"kernel {i}".encode() * 1000
        path = tmp_path / "mirror" / f"k{i}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        arts.append(Artifact(f"k{i}.cubin", hashlib.sha256(data).hexdigest(), len(data)))
    return arts


def test_a_prefetch_appends_its_report_as_one_event(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from distcache.collective import prefetch
    from distcache.comm import LocalCommunicator
    from distcache.origins import DirOrigin
    from distcache.store import ArtifactPool

    target = tmp_path / "events.jsonl"
    monkeypatch.setenv("DISTCACHE_LOG_JSON", str(target))
    arts = _family(tmp_path)
    prefetch(arts, comm=LocalCommunicator(), pool=ArtifactPool(tmp_path / "pool"),
             origin=DirOrigin(tmp_path / "mirror"))
    (record,) = [json.loads(line) for line in target.read_text().splitlines()]
    assert record["event"] == "prefetch.report"
    assert record["downloads"] == 5 and record["artifacts"] == 5 and record["ranks"] == 1
    assert set(record["seconds"]) >= {"fetch", "move"}


def test_rank0_shows_a_progress_bar_on_a_terminal_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from distcache.collective import _progress, prefetch
    from distcache.comm import LocalCommunicator
    from distcache.origins import DirOrigin
    from distcache.store import ArtifactPool

    arts = _family(tmp_path)
    origin = DirOrigin(tmp_path / "mirror")
    prefetch(arts[:2], comm=LocalCommunicator(), pool=ArtifactPool(tmp_path / "a"),
             origin=origin)
    assert "distcache prefetch" not in capsys.readouterr().err
    monkeypatch.setattr(_progress, "_terminal", lambda: True)
    prefetch(arts, comm=LocalCommunicator(), pool=ArtifactPool(tmp_path / "b"), origin=origin)
    assert "distcache prefetch" in capsys.readouterr().err
