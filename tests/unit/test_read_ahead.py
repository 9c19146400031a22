"""A source builds its next bucket while the current one travels: one ahead, never more;
a failure while building reaches the protocol's thread; closing stops the builder."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from distcache.collective._stream import _ReadAhead


def _counting(n: int, built: list[int]) -> Iterator[bytearray]:
    for i in range(n):
        built.append(i)
        yield bytearray([i])


def _settle(built: list[int], expected: int) -> None:
    for _ in range(200):
        if len(built) >= expected:
            break
        threading.Event().wait(0.01)


def test_one_message_is_built_ahead_and_no_more() -> None:
    built: list[int] = []
    ahead = _ReadAhead(_counting(5, built))
    _settle(built, 1)
    threading.Event().wait(0.2)
    assert built == [0]  # built before anyone asked, the next not yet
    assert next(ahead) == bytearray([0])
    _settle(built, 2)
    threading.Event().wait(0.2)
    assert built == [0, 1]
    assert [next(ahead)[0] for _ in range(4)] == [1, 2, 3, 4]
    ahead.close()


def test_a_failure_while_building_is_raised_to_the_taker() -> None:
    def failing() -> Iterator[bytearray]:
        yield bytearray(b"a")
        raise OSError("disk gone")

    ahead = _ReadAhead(failing())
    assert next(ahead) == bytearray(b"a")
    with pytest.raises(OSError, match="disk gone"):
        next(ahead)
    ahead.close()


def test_close_stops_a_builder_that_waits_for_its_turn() -> None:
    built: list[int] = []
    ahead = _ReadAhead(_counting(100, built))
    _settle(built, 1)
    ahead.close()  # returns although nobody took the message built
    assert built == [0]
