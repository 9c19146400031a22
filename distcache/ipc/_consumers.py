"""The consumer table of a pool segment: who mapped it, who left, who died.

A consumer writes its own row when it maps the pool (state ``MAPPED``, its pid and
its pid namespace) and again when it closes (``LEFT``). The producer reads the rows
with plain loads to (a) release the leases of a consumer that left or died, so they
do not leak, (b) unlink a segment name once every consumer has mapped it, and (c)
free its memory only after every consumer has unmapped it. Nothing here blocks: a
dead consumer is noticed by ``kill(pid, 0)`` and its ``/proc`` state when the
producer looks, never by waiting for it.

A pid is only meaningful in its own pid namespace: a consumer in another namespace
(another container sharing ``/dev/shm``) is never declared dead by pid, only by its
``LEFT`` word.
"""

from __future__ import annotations

import functools
import os

from distcache._proc import stat_fields
from distcache.errors import IpcError
from distcache.ipc._layout import ABSENT, LEFT, MAPPED, ControlWords, Layout


@functools.cache
def pid_namespace() -> int:
    """This process's pid namespace inode (low 32 bits), or 0 when unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF or 1
    except OSError:
        return 0


def process_alive(pid: int) -> bool:
    """Whether ``pid`` names a live (not zombie) process in this pid namespace."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)
    return not fields or fields[0] not in ("Z", "X")  # unreadable: taken for alive


class ConsumerTable:
    """Rows of the consumer table over a segment's control words."""

    def __init__(self, words: ControlWords, layout: Layout) -> None:
        self._words = words
        self._layout = layout

    def join(self, index: int, pool_id: str | None = None) -> None:
        """Record that this process mapped the pool as consumer ``index``.

        Raises:
            IpcError: a live process (this one included) already maps the pool as
                consumer ``index``: two readers would share one ack word.
        """
        base = self._layout.consumer(index)
        if self._words.get(base) == MAPPED and not self.gone(index):
            raise IpcError(
                f"consumer {index} of pool {pool_id} is already mapped by pid "
                f"{self._words.get(base + 1)}, which still maps it; it must close first",
                pool_id=pool_id,
            )
        self._words.set(base + 1, os.getpid())
        self._words.set(base + 2, pid_namespace())
        self._words.set(base, MAPPED)

    def leave(self, index: int) -> None:
        """Record that consumer ``index`` unmapped the pool and acknowledges nothing more."""
        self._words.set(self._layout.consumer(index), LEFT)

    def state(self, index: int) -> int:
        return self._words.get(self._layout.consumer(index))

    def gone(self, index: int) -> bool:
        """Consumer ``index`` left, or mapped the pool and has since died."""
        base = self._layout.consumer(index)
        state = self._words.get(base)
        if state == LEFT:
            return True
        if state != MAPPED:
            return False
        namespace = self._words.get(base + 2)
        if namespace == 0 or namespace != pid_namespace():
            return False
        return not process_alive(self._words.get(base + 1))

    def all_joined(self, count: int) -> bool:
        """Every one of the first ``count`` consumers has mapped the pool (or left)."""
        return all(self.state(i) != ABSENT for i in range(count))

    def holding(self, count: int) -> list[int]:
        """Consumers that still map the pool (mapped, not left, not dead)."""
        return [i for i in range(count) if self.state(i) == MAPPED and not self.gone(i)]
