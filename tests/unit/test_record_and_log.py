"""The start-up path's value classes (distcache._record) and on-demand loggers
(distcache._log): same behaviour as a frozen dataclass and a standard logger, without
loading ``dataclasses`` or ``logging`` on a rank that does not need them."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from distcache._log import get_logger
from distcache.artifact import Artifact
from distcache.collective import PrefetchReport
from distcache.store.layout import PoolLayout

SHA = "a" * 64
ROOT = Path(__file__).resolve().parents[2]


def _report(**changes: object) -> PrefetchReport:
    values: dict[str, object] = dict(
        operation="prefetch", artifacts=2, objects=2, downloads=1, origin_bytes=10,
        broadcasts=1, broadcast_bytes=10, received_bytes=10, discarded_bytes=0,
        pool_hits=1, objects_published=2, pools=2, writers=(0, 1), downloaders=(0,),
        peak_bytes=10, seconds={"fetch": 0.5})
    values.update(changes)
    return PrefetchReport(**values)  # type: ignore[arg-type]


def test_a_record_is_a_frozen_value() -> None:
    a, b = Artifact("x/y.cubin", SHA, 3), Artifact("x//y.cubin", SHA, 3)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Artifact("x/y.cubin", SHA, 4) and a != ("x/y.cubin", SHA, 3)
    assert repr(a) == f"Artifact(name='x/y.cubin', sha256='{SHA}', size=3)"
    with pytest.raises(AttributeError, match="cannot assign to field 'size'"):
        a.size = 4  # type: ignore[misc]
    with pytest.raises(AttributeError, match="cannot delete"):
        del a.name  # type: ignore[misc]
    assert a.size == 3


def test_replace_validates_like_the_constructor_and_refuses_unknown_fields() -> None:
    a = Artifact("k.cubin", SHA)
    assert a.replace(size=7) == Artifact("k.cubin", SHA, 7) and a.size is None
    with pytest.raises(ValueError, match="non-negative"):
        a.replace(size=-1)
    with pytest.raises(TypeError, match=r"no field.*sha"):
        a.replace(sha="b" * 64)


def test_records_copy_pickle_and_match_positionally() -> None:
    report = _report()
    for other in (copy.copy(report), copy.deepcopy(report),
                  pickle.loads(pickle.dumps(report))):
        assert other == report and other is not report
    layout = PoolLayout("/tmp/pool")
    again = pickle.loads(pickle.dumps(layout))
    assert again == layout and again.journal_log == layout.journal_log
    match Artifact("m.cubin", SHA, 1):
        case Artifact(name, sha, size):
            assert (name, sha, size) == ("m.cubin", SHA, 1)
        case _:
            pytest.fail("no positional match")


def test_as_dict_gives_plain_fields_in_order() -> None:
    report = _report()
    fields = report.as_dict()
    assert list(fields) == list(PrefetchReport.__match_args__)
    assert fields["writers"] == (0, 1) and fields["seconds"] == {"fetch": 0.5}
    fields["seconds"]["fetch"] = 9.0
    assert report.seconds["fetch"] == 0.5  # a copy, not the report's own mapping
    assert PrefetchReport(**fields) != report
    assert PrefetchReport(**report.as_dict()) == report
    # Derived fields take no part: one layout per root.
    assert PoolLayout("/a").as_dict() == {"root": Path("/a")}


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)


def test_loading_the_hook_loads_neither_dataclasses_nor_logging() -> None:
    done = _run("import sys, distcache; distcache.init; distcache.InitOptions; "
                "distcache.PrefetchReport; distcache.Artifact; import launch; launch.detect; "
                "import json; print(json.dumps(sorted(m for m in ('dataclasses', 'logging', "
                "'inspect') if m in sys.modules)))")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_below_warning_nothing_is_loaded_and_warnings_reach_stderr() -> None:
    done = _run("import sys; from distcache._log import get_logger; log = get_logger('distcache.t')\n"
                "log.debug('quiet %s', 1); log.info('quiet'); "
                "assert 'logging' not in sys.modules\n"
                "log.warning('loud %d', 7); assert 'logging' in sys.modules\n"
                "log.debug('still quiet')")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "loud 7\n"


def test_records_name_the_caller_and_follow_the_configured_level(
        caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("distcache.test_log")
    with caplog.at_level(logging.DEBUG, logger="distcache.test_log"):
        log.debug("d %s", "x")
        log.info("i")
        log.log(logging.WARNING, "w")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("e")
    records = [r for r in caplog.records if r.name == "distcache.test_log"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("DEBUG", "d x"), ("INFO", "i"), ("WARNING", "w"), ("ERROR", "e")]
    assert {r.funcName for r in records} == {
        "test_records_name_the_caller_and_follow_the_configured_level"}
    assert {r.pathname for r in records} == {__file__}
    assert records[-1].exc_info is not None and records[-1].exc_info[0] is RuntimeError
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distcache.test_log"):
        log.info("dropped")
    assert not [r for r in caplog.records if r.name == "distcache.test_log"]
