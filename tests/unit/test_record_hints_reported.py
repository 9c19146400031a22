"""A usage record's hint that the origin lacks is benign and handled: the rank that
downloads it logs its failure below WARNING (rank 0's one warning says it), while every
other failure keeps its ERROR line; and the start-up's report names the recorded
artifacts it left out, the same on every rank, in the order they were left out."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distcache._resolve import _ONE_BY_ONE, prefetch_manifests
from distcache.artifact import Artifact
from distcache.collective import PrefetchReport
from distcache.comm import Communicator, ThreadGroup
from distcache.errors import PrefetchError
from distcache.integrations.flashinfer import FlashInfer
from distcache.store import ArtifactPool
from tests.support.helpers import isolated_init
from tests.support.threads import run_ranks
from tests.unit.test_record_entries_best_effort import (
    LEFT_OUT,
    TIMEOUT,
    _gone,
    _layout,
    _present,
    _record,
    _warnings,
)

FAILED = "failed on rank"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    yield from isolated_init(monkeypatch, tmp_path)


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and r.name.startswith("distcache")]


def _failures_below_warning(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno < logging.WARNING and FAILED in r.getMessage()]


def _prefetch_record(tmp_path: Path, caplog: pytest.LogCaptureFixture, listed: list[Artifact],
                     *, nodes: bool = False, manifests: Any = ()) -> list[Any]:
    """Each rank's result of a start-up prefetch (two ranks, or two nodes of two ranks)
    of a record listing ``listed`` and ``manifests``, from the test's mirror, every
    record at DEBUG captured."""
    _, origin = _present(tmp_path)
    record = _record(tmp_path / "rec", listed)
    group, _pools, place = _layout(tmp_path, nodes)

    def body(base: Communicator) -> Any:
        comm, pool = place(base)
        return prefetch_manifests(comm, pool, origin, manifests=manifests,
                                  integrations=[FlashInfer(record)], timeout=TIMEOUT,
                                  offline=False)

    with caplog.at_level(logging.DEBUG):
        return run_ranks(group, body, limit=90)


# -- the log ---------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [False, True], ids=["two-ranks", "two-nodes-of-two"])
def test_a_hint_the_origin_lacks_logs_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, nodes: bool,
) -> None:
    present, _ = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    results = _prefetch_record(tmp_path, caplog, [present, gone], nodes=nodes)
    for result in results:
        assert isinstance(result, PrefetchReport), result
    assert _errors(caplog) == []
    (warning,) = _warnings(caplog)
    assert gone.name in warning
    # The downloading rank still says what failed, below WARNING.
    (failure,) = _failures_below_warning(caplog)
    assert gone.name in failure and "ArtifactNotFound" in failure


def test_a_manifest_entry_the_origin_lacks_keeps_its_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, _ = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    results = _prefetch_record(tmp_path, caplog, [present, gone], manifests=[[gone]])
    for result in results:
        assert isinstance(result, PrefetchError), result
        assert result.artifact == gone.name
    (error,) = _errors(caplog)
    assert error.startswith(f"prefetch fetch {FAILED} ") and gone.name in error
    assert "ArtifactNotFound" in error
    assert _failures_below_warning(caplog) == [] and _warnings(caplog) == []


def test_a_hint_that_fails_otherwise_keeps_its_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, _ = _present(tmp_path)
    # Listed with another file's digest: the origin has it, its bytes do not match.
    wrong = Artifact(present.name, _gone("pin/other.cubin").sha256)
    results = _prefetch_record(tmp_path, caplog, [wrong])
    for result in results:
        assert isinstance(result, PrefetchError), result
        assert result.artifact == wrong.name and "ArtifactNotFound" not in str(result)
    (error,) = _errors(caplog)
    assert FAILED in error and wrong.name in error
    assert _failures_below_warning(caplog) == []
    assert not any(LEFT_OUT in r.getMessage() for r in caplog.records)


# -- the report ------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [False, True], ids=["two-ranks", "two-nodes-of-two"])
def test_the_report_names_the_hints_left_out_one_by_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, nodes: bool,
) -> None:
    present, _ = _present(tmp_path)
    gone = [_gone("pin/gone-b.cubin"), _gone("pin/gone-c.cubin")]
    results = _prefetch_record(tmp_path, caplog, [present, *gone], nodes=nodes)
    _left_out_alike(results, gone, caplog)
    for result in results:
        assert result.summary().splitlines()[0].endswith(
            ", 2 recorded artifact(s) left out"), result.summary()


def test_the_report_names_every_hint_left_out_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, _ = _present(tmp_path)
    gone = [_gone(f"pin/gone-{i}.cubin") for i in range(7)]
    results = _prefetch_record(tmp_path, caplog, [present, *gone])
    left_out = _left_out_alike(results, gone, caplog)
    assert all(f"{len(gone)} recorded artifact(s) left out" in r.summary() for r in results)
    # _ONE_BY_ONE one at a time, each as a failed run named it, then the rest at once,
    # in the order the prefetch lists them.
    first = set(left_out[:_ONE_BY_ONE])
    assert left_out[_ONE_BY_ONE:] == tuple(sorted(g.name for g in gone if g.name not in first))


def _left_out_alike(results: list[Any], gone: list[Artifact],
                    caplog: pytest.LogCaptureFixture) -> tuple[str, ...]:
    """Check that every rank's report names ``gone`` as left out, alike on every rank
    and in the order the warning names them; return that order."""
    for result in results:
        assert isinstance(result, PrefetchReport), result
        assert result.artifacts == 1
        assert sorted(result.left_out) == sorted(g.name for g in gone), result.left_out
    (left_out,) = {r.left_out for r in results}  # alike on every rank
    (warning,) = _warnings(caplog)
    assert f": {', '.join(left_out)}; " in warning
    return left_out


def test_without_an_origin_the_report_names_the_hints_no_pool_holds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, _ = _present(tmp_path)
    gone = _gone("pin/gone.cubin")
    record = _record(tmp_path / "rec", [present, gone])
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]
    pools[1].put((tmp_path / "origin" / present.name).read_bytes())

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(comm, pools[comm.rank], None,
                                  integrations=[FlashInfer(record)], timeout=TIMEOUT,
                                  offline=False)

    for result in run_ranks(ThreadGroup(2, timeout=TIMEOUT), body):
        assert isinstance(result, PrefetchReport), result
        assert result.left_out == (gone.name,)
        assert "1 recorded artifact(s) left out" in result.summary()


def test_nothing_left_out_is_an_empty_field_the_summary_does_not_mention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    present, _ = _present(tmp_path)
    results = _prefetch_record(tmp_path, caplog, [present])
    for result in results:
        assert isinstance(result, PrefetchReport), result
        assert result.left_out == ()
        assert "left out" not in result.summary()
    assert _errors(caplog) == [] and _warnings(caplog) == []


def test_the_field_defaults_to_empty_and_round_trips() -> None:
    fields: dict[str, Any] = dict(
        operation="prefetch", artifacts=2, objects=2, downloads=1, origin_bytes=10,
        broadcasts=1, broadcast_bytes=10, received_bytes=10, discarded_bytes=0,
        pool_hits=1, objects_published=2, pools=2, writers=(0, 1), downloaders=(0,),
        peak_bytes=10, seconds={"fetch": 0.5})
    report = PrefetchReport(**fields)
    assert report.left_out == () and "left out" not in report.summary()
    named = report.replace(left_out=("a.cubin", "b.cubin"))
    assert named != report and named.left_out == ("a.cubin", "b.cubin")
    assert PrefetchReport(**named.as_dict()) == named
    assert named.summary().splitlines()[0].endswith(", 2 recorded artifact(s) left out")
    assert named.summary().splitlines()[1] == report.summary().splitlines()[1]


def test_a_node_member_takes_the_field_from_its_leaders_word_checked() -> None:
    from types import SimpleNamespace

    from distcache._delegate import _unpacked
    from distcache.errors import WireError

    tree: Any = SimpleNamespace(rank=1, backend="gloo", leader=0)
    report = PrefetchReport("prefetch", 1, 1, 1, 10, 1, 10, 10, 0, 0, 1, 2, (0,), (0,), 10,
                            {"fetch": 0.5}, ("a.cubin",))
    assert _unpacked(report.as_dict(), "rank 1", tree) == report
    for bad in (["a.cubin"], ("a.cubin", 3), "a.cubin"):
        with pytest.raises(WireError, match="malformed"):
            _unpacked({**report.as_dict(), "left_out": bad}, "rank 1", tree)
    without = report.as_dict()
    del without["left_out"]
    with pytest.raises(WireError, match="malformed"):
        _unpacked(without, "rank 1", tree)
