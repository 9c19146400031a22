"""The consumer table: how a producer tells a consumer that left or died from one that
is only slow, without waiting on it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from distcache.ipc._consumers import ConsumerTable, pid_namespace, process_alive
from distcache.ipc._layout import ABSENT, LEFT, MAPPED, Layout, WordArray


def _table(consumers: int = 3) -> tuple[ConsumerTable, WordArray, Layout]:
    layout = Layout(4, consumers)
    words = WordArray(memoryview(bytearray(layout.header_bytes)), layout.stride)
    return ConsumerTable(words, layout), words, layout


def test_join_leave_and_the_states_a_producer_reads() -> None:
    table, words, layout = _table()
    assert [table.state(i) for i in range(3)] == [ABSENT] * 3
    assert not table.all_joined(3)
    table.join(0)
    table.join(2)
    assert words.get(layout.consumer(0) + 1) == os.getpid()
    assert [table.state(i) for i in range(3)] == [MAPPED, ABSENT, MAPPED]
    assert table.holding(3) == [0, 2] and not table.gone(0) and not table.gone(1)
    table.leave(2)
    assert table.state(2) == LEFT and table.gone(2) and table.holding(3) == [0]
    table.join(1)
    assert table.all_joined(3)


def test_a_dead_pid_is_gone_only_in_our_own_pid_namespace() -> None:
    table, words, layout = _table()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)  # reaped: the pid names nothing now
    base = layout.consumer(1)
    words.set(base + 1, proc.pid)
    words.set(base + 2, pid_namespace())
    words.set(base, MAPPED)
    assert table.gone(1)
    words.set(base + 2, (pid_namespace() + 1) & 0xFFFFFFFF or 1)  # another container
    assert not table.gone(1), "a pid from another namespace must not be judged here"


def test_a_zombie_is_not_alive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while process_alive(proc.pid):  # exited but not reaped: a zombie
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
    finally:
        proc.wait(timeout=60)
    assert process_alive(os.getpid())
    assert not process_alive(0)
