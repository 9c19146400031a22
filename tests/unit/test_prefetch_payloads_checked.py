"""What the prefetch's all-gathers bring from the other ranks is checked before it is
used: the collective's agreement (its download counts above all), the start-up
prefetch's carried flags, the ranks' compressed usage-record lists (inflated only up to
the manifest size limit) and the pools' answers of what they hold. A malformed entry
is a WireError naming its sender, the same on every rank (each receives the same
gathered list), never a raw TypeError, ZeroDivisionError, IndexError or zlib.error, nor
a bitmap taken from a rank that does not read that pool."""

from __future__ import annotations

import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import distcache._held
from distcache._held import held_anywhere
from distcache._resolve import _prefetch, prefetch_manifests, union_across_ranks
from distcache.artifact import MAX_MANIFEST_BYTES, Artifact, manifest_text
from distcache.collective import PrefetchReport, prefetch
from distcache.comm import Communicator, ThreadGroup
from distcache.errors import PoolError, PrefetchError, WireError
from distcache.origins import DirOrigin
from distcache.store import ArtifactPool
from distcache.testing import make_artifacts
from tests.support.threads import Wanting, run_ranks

TIMEOUT = 20.0
A = Artifact("k.cubin", "ab" * 32, None)
B = Artifact("m.cubin", "cd" * 32, None)

#: One all-gather's answer: the gathered list, or a function of what this rank sent.
Answer = list[Any] | Callable[[Any], list[Any]]


class ScriptedComm:
    """Rank ``rank`` of ``size``, whose all-gathers answer from ``script`` in turn (an
    in-process backend, so that no node tree is made over it)."""

    backend = "threads"
    node_id = "node"

    def __init__(self, rank: int, size: int, script: list[Answer]) -> None:
        self.rank, self.size, self._script = rank, size, script

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        answer = self._script.pop(0)
        return answer(obj) if callable(answer) else answer

    def barrier(self, *, timeout: float | None = None) -> None:
        pass


def _as_peer(rank: int, sent: Any) -> Callable[[Any], list[Any]]:
    """An answer in which rank 0 sent what this rank did and rank ``rank`` ``sent``."""
    return lambda own: [own, *([own] * (rank - 1)), sent]


def _same_on_ranks(ranks: list[int], size: int, call: Callable[[ScriptedComm], Any],
                   script: Callable[[], list[Answer]]) -> list[BaseException]:
    """What ``call`` raises on each of ``ranks`` given the same gathered lists."""
    raised: list[BaseException] = []
    for rank in ranks:
        with pytest.raises(BaseException) as caught:
            call(ScriptedComm(rank, size, script()))
        raised.append(caught.value)
    return raised


def _wire(error: BaseException) -> WireError:
    """The WireError that ``error`` is, or that it was raised from."""
    found = error if isinstance(error, WireError) else error.__cause__
    assert isinstance(found, WireError), repr(error)
    return found


# -- the collective's agreement ------------------------------------------------------


def _said(own: Any, **changed: Any) -> Any:
    """``own`` (a rank's agreement tuple) as another rank in another pool says it."""
    fields = dict(zip(("digest", "listed", "pool_id", "node_id", "names", "counts"), own,
                      strict=True))
    fields.update(pool_id="pool-b", node_id="n1")
    fields.update(changed)
    return tuple(fields.values())


@pytest.mark.parametrize("changed", [
    {"counts": (0, 4)},          # the plan divides by it
    {"counts": (4, 0)},
    {"counts": (2.5, 4)},
    {"counts": (True, 4)},
    {"counts": (4,)},
    {"counts": [4, 32]},
    {"counts": None},
    {"listed": -1},
    {"listed": "1"},
    {"digest": 7},
    {"pool_id": None},
])
def test_a_malformed_agreement_fails_the_prefetch_naming_its_sender(
    tmp_path: Path, changed: dict[str, Any],
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    comm: Any = ScriptedComm(0, 2, [lambda own: [own, _said(own, **changed)]])
    with pytest.raises(PrefetchError) as caught:
        prefetch([A], comm=comm, pool=pool, origin=DirOrigin(tmp_path), timeout=5)
    wire = _wire(caught.value)
    assert wire.peer == 1 and "rank 1 sent a malformed agreement" in str(wire)


@pytest.mark.parametrize("sent", [None, 5, ("d" * 64, 1), ["d" * 64, 1, "p", "n", "x", (4, 4)]])
def test_an_agreement_of_another_shape_is_the_same_wire_error_on_every_rank(
    tmp_path: Path, sent: Any,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    good = ("d" * 64, 1, "pool-a", "n0", "e" * 64, (4, 32))

    def call(comm: ScriptedComm) -> Any:
        return prefetch([A], comm=comm, pool=pool, origin=DirOrigin(tmp_path),  # type: ignore[arg-type]
                        timeout=5)

    errors = _same_on_ranks([0, 2], 3, call, lambda: [[good, sent, good]])
    raised = [_wire(e) for e in errors]
    assert {(str(w), w.peer) for w in raised} == {(str(raised[0]), 1)}
    # The prefetch's own error too: the same on every rank, naming the sender.
    assert len({str(e) for e in errors}) == 1 and {e.rank for e in errors} == {1}


def test_ranks_with_different_download_counts_still_prefetch_with_the_smallest(
    tmp_path: Path,
) -> None:
    listed = make_artifacts(tmp_path / "origin", 3, min_size=1_000, max_size=4_000, seed=5)
    origin = DirOrigin(tmp_path / "origin")
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]

    def body(comm: Communicator) -> Any:
        return prefetch(listed, comm=comm, pool=pools[comm.rank], origin=origin,
                        timeout=TIMEOUT, downloads_per_rank=1 + comm.rank,
                        downloads_per_job=2 + comm.rank)

    results = run_ranks(ThreadGroup(2, timeout=TIMEOUT), body)
    assert all(isinstance(r, PrefetchReport) for r in results), results
    assert all(p.has(a.sha256) for p in pools for a in listed)


# -- the start-up prefetch's carried flags -------------------------------------------


@pytest.mark.parametrize("carry", [
    None,
    (True, False, None),                       # three fields
    [True, False, None, b"k" * 8],             # a list
    (1, False, None, b"k" * 8),                # a number for "no origin"
    (True, None, None, b"k" * 8),              # no bool for "offline"
    (True, False, 5, b"k" * 8),                # a number for the records' digest
    (True, False, None, "k" * 8),              # a str for the list key
    (True, False, None, None),
])
def test_a_malformed_carry_is_the_same_wire_error_naming_its_sender_on_every_rank(
    tmp_path: Path, carry: Any,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    good = ("node", None, (True, False, None, b"k" * 8))

    def call(comm: ScriptedComm) -> Any:
        return _prefetch(comm, pool, None, [[A]], [], 5.0, False, None)  # type: ignore[arg-type]

    raised = _same_on_ranks([0, 2], 3, call, lambda: [[good, ("node", None, carry), good]])
    assert all(type(e) is WireError and e.peer == 1 for e in raised), raised
    assert "rank 1 sent a malformed agreement" in str(raised[0])
    assert len({str(e) for e in raised}) == 1


def test_well_formed_carries_and_record_lists_still_prefetch(tmp_path: Path) -> None:
    listed, wanted = make_artifacts(tmp_path / "origin", 2, min_size=1_000, max_size=4_000,
                                    seed=3)
    manifest = tmp_path / "manifest.txt"
    manifest.write_text(manifest_text([listed]))
    origin = DirOrigin(tmp_path / "origin")
    pools = [ArtifactPool(tmp_path / f"pool-{r}") for r in range(2)]

    def body(comm: Communicator) -> Any:
        return prefetch_manifests(
            comm, pools[comm.rank], origin, manifests=[manifest], timeout=TIMEOUT,
            integrations=[Wanting([wanted])] if comm.rank == 1 else [], offline=False)

    results = run_ranks(ThreadGroup(2, timeout=TIMEOUT), body)
    assert all(isinstance(r, PrefetchReport) for r in results), results
    assert all(p.has(a.sha256) for p in pools for a in (listed, wanted))


# -- the ranks' usage-record lists ---------------------------------------------------


def _union(comm: ScriptedComm) -> list[Artifact]:
    return union_across_ranks(comm, [A], recorded_ns=1)  # type: ignore[arg-type]


def _union_script(part: Any, size: int = 2) -> Callable[[], list[Answer]]:
    """Rank 1 says it has a list of its own, then sends ``part``; rank 0 sends its list
    (``[A]``) and any other rank says it has the same list as rank 0."""
    return lambda: [lambda own: [own, "b" * 64, *[own] * (size - 2)],
                    [(zlib.compress(manifest_text([A]).encode()), 1), part,
                     *[None] * (size - 2)]]


@pytest.mark.parametrize("part", [
    5,
    (b"xx", 0),                                                    # not zlib
    [zlib.compress(b""), 0],                                       # a list
    (zlib.compress(b""),),                                         # one field
    (zlib.compress(b""), True),                                    # a bool date
    (zlib.compress(b""), 1.5),
    (zlib.compress(b""), None),
    ("text", 0),
    (zlib.compress(manifest_text([B]).encode())[:-4], 0),          # cut off
    (zlib.compress(manifest_text([B]).encode()) + b"more", 0),     # trailing bytes
    (zlib.compress(b"\xff\xfe"), 0),                               # not UTF-8
    (zlib.compress(b"not a manifest\n"), 0),
])
def test_a_malformed_record_list_is_the_same_wire_error_naming_its_sender_on_every_rank(
    part: Any,
) -> None:
    raised = _same_on_ranks([0, 2], 3, _union, _union_script(part, size=3))
    assert all(type(e) is WireError and e.peer == 1 for e in raised), raised
    assert "rank 1 sent a malformed" in str(raised[0])
    assert len({str(e) for e in raised}) == 1


def _bomb(inflated: int) -> bytes:
    """A zlib stream of ``inflated`` zero bytes, made a MiB at a time."""
    squeeze, step = zlib.compressobj(), b"\0" * (1 << 20)
    parts = [squeeze.compress(step) for _ in range(inflated >> 20)]
    return b"".join(parts) + squeeze.flush()


def _peak_while(call: Callable[[], Any]) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        call()
        raised = None
    except BaseException as exc:
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


def test_a_list_that_inflates_past_the_cap_is_refused_without_inflating_it_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(distcache._held, "MAX_MANIFEST_BYTES", 8 << 20, raising=False)
    bomb = _bomb(512 << 20)  # about 500 KB that inflate to 512 MiB
    raised, peak = _peak_while(lambda: _union(ScriptedComm(0, 2, _union_script((bomb, 0))())))
    assert type(raised) is WireError and raised.peer == 1, repr(raised)
    assert "inflates past" in str(raised)
    assert peak < 64 << 20, peak


def test_the_cap_is_the_manifest_size_limit_and_is_held_to_it() -> None:
    bomb = _bomb(MAX_MANIFEST_BYTES + (16 << 20))
    raised, peak = _peak_while(lambda: _union(ScriptedComm(0, 2, _union_script((bomb, 0))())))
    assert type(raised) is WireError and raised.peer == 1, repr(raised)
    assert f"inflates past {MAX_MANIFEST_BYTES} bytes" in str(raised)
    assert peak < MAX_MANIFEST_BYTES + (48 << 20), peak  # one copy at most, no second


def test_a_list_at_the_cap_is_taken_and_one_past_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = manifest_text([B]).encode()
    monkeypatch.setattr(distcache._held, "MAX_MANIFEST_BYTES", len(text), raising=False)
    assert _union(ScriptedComm(0, 2, _union_script((zlib.compress(text), 0))())) == [A, B]
    longer = zlib.compress(text + b"\n")
    with pytest.raises(WireError, match=r"rank 1 sent a malformed list.*inflates past"):
        _union(ScriptedComm(0, 2, _union_script((longer, 0))()))


def test_well_formed_record_lists_are_united_and_the_newest_digest_wins() -> None:
    newer = Artifact("k.cubin", "ef" * 32, None)
    script = _union_script((zlib.compress(manifest_text([newer, B]).encode()), 2))
    assert _union(ScriptedComm(0, 2, script())) == [newer, B]


# -- what the pools hold -------------------------------------------------------------

OWN, OTHER = ("pool-a", "/a", "n0"), ("pool-b", "/b", "n1")


@pytest.mark.parametrize("key", [
    ("pool-b", "/b"),               # two fields
    ["pool-b", "/b", "n1"],         # a list
    ("pool-b", 5, "n1"),
    None,
])
def test_a_malformed_pool_key_is_the_same_wire_error_naming_its_sender_on_every_rank(
    tmp_path: Path, key: Any,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    raised = _same_on_ranks(
        [0, 2], 3, lambda comm: held_anywhere(comm, pool, [A]),  # type: ignore[arg-type]
        lambda: [[OWN, key, OWN], [(b"\0", None), (None, None), (None, None)]])
    assert all(type(e) is WireError and e.peer == 1 for e in raised), raised
    assert "rank 1 sent a malformed pool (id, root, host)" in str(raised[0])
    assert len({str(e) for e in raised}) == 1


@pytest.mark.parametrize(("key", "sent"), [
    (OTHER, (b"", None)),                   # the reader's bitmap is short
    (OTHER, (b"\x01\x00", None)),           # or long: another list
    (OTHER, ("\x01", None)),
    (OTHER, (None, None)),                  # the reader says nothing
    (OTHER, (b"\x01", "OSError: x")),       # both
    (OTHER, [b"\x01", None]),
    (OTHER, None),
    (OWN, (b"\x01", None)),                 # a bitmap from a rank that is not the reader
    (OWN, (None, "OSError: x")),            # a failure from one
])
def test_a_malformed_or_unasked_pool_answer_is_the_same_wire_error_on_every_rank(
    tmp_path: Path, key: tuple[str, str, str], sent: Any,
) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    raised = _same_on_ranks(
        [0, 2], 3, lambda comm: held_anywhere(comm, pool, [A]),  # type: ignore[arg-type]
        lambda: [[OWN, key, OTHER if key == OWN else OWN],
                 [(b"\0", None), sent, (b"\0", None) if key == OWN else (None, None)]])
    assert all(type(e) is WireError and e.peer == 1 for e in raised), raised
    assert "rank 1 sent a malformed (bitmap, failure)" in str(raised[0])
    assert len({str(e) for e in raised}) == 1


def test_well_formed_pool_answers_still_tell_what_is_held(tmp_path: Path) -> None:
    pool = ArtifactPool(tmp_path / "pool")
    held, where = held_anywhere(ScriptedComm(0, 3, [  # type: ignore[arg-type]
        [OWN, OTHER, OWN], [(b"\0", None), (b"\x02", None), (None, None)]]), pool, [A, B])
    assert held == [False, True]
    assert where == ["pool pool-a at /a on n0 (ranks 0, 2)", "pool pool-b at /b on n1 (rank 1)"]
    with pytest.raises(PoolError, match="OSError: x"):
        held_anywhere(ScriptedComm(2, 3, [  # type: ignore[arg-type]
            [OWN, OTHER, OWN], [(b"\0", None), (None, "rank 1 (n1): OSError: x"),
                                (None, None)]]), pool, [A])
