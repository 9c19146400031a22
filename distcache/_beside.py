"""Integration installs that run while ``init``'s start-up prefetch does.

An integration whose install reads nothing the prefetch brings (FlashInfer's: it
puts a wrapper in front of the loader and looks artifacts up only when the engine
asks, after ``init`` returns) need not wait for the prefetch: :class:`InstallsBeside`
installs those on a thread of their own while the prefetch runs, in the order given,
so that on a rank that waits for its node leader's downloads the install costs no
time of its own. An integration says so with a true ``install_beside_prefetch``
attribute; the rest (the JIT cache families, which fill their directories from the
pool) are installed after the prefetch, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from distcache._log import get_logger

if TYPE_CHECKING:
    from distcache.integrations import Integration
    from distcache.origins import Origin
    from distcache.store import ArtifactPool

log = get_logger(__name__)


@contextmanager
def phase(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds of the block to ``phases[name]`` (a phase may come back: the
    peers' start, then their share; an install beside the prefetch is timed apart)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def installs_beside(integration: Integration) -> bool:
    """Whether ``integration`` may be installed while the start-up prefetch runs."""
    return getattr(integration, "install_beside_prefetch", False) is True


class InstallsBeside:
    """Installs the integrations of ``chosen`` that :func:`installs_beside` allows on
    a thread started at once; :meth:`join` waits for it. Each install's seconds go to
    ``phases`` under the integration's name (they overlap the prefetch's)."""

    def __init__(self, chosen: Sequence[Integration], pool: ArtifactPool,
                 origin: Origin | None, phases: dict[str, float]) -> None:
        self.early = [i for i in chosen if installs_beside(i)]
        self._installed: list[Integration] = []
        self._error: BaseException | None = None
        self._args = (pool, origin, phases)
        self._thread: threading.Thread | None = None
        if self.early:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="distcache-install")
            self._thread.start()

    def _run(self) -> None:
        pool, origin, phases = self._args
        for integration in self.early:
            try:
                with phase(phases, integration.name):
                    integration.install(pool, origin)
            except BaseException as exc:  # raised on the caller's thread by check()
                self._error = exc
                return
            self._installed.append(integration)

    def join_into(self, installed: list[Integration]) -> list[Integration]:
        """Wait for the installs (each is non-collective and bounded by its own
        imports), append those done to ``installed`` in order and return them."""
        if self._thread is not None:
            self._thread.join()
        installed.extend(self._installed)
        return list(self._installed)

    def check(self) -> None:
        """Raise what the first failing install raised (those after it were not
        tried), after :meth:`join_into`."""
        if self._error is not None:
            raise self._error


def install_rest(chosen: Sequence[Integration], early: Sequence[Integration],
                 pool: ArtifactPool, origin: Origin | None, phases: dict[str, float],
                 installed: list[Integration], note: Callable[..., None]) -> None:
    """Install each integration of ``chosen`` not in ``early`` (installed beside the
    prefetch), in order, appending it to ``installed`` once installed; ``note``
    logs a line for each."""
    for integration in chosen:
        if any(integration is done for done in early):
            note("%s: installed beside the prefetch (%.2f s)", integration.name,
                 phases.get(integration.name, 0.0))
            continue
        with phase(phases, integration.name):
            integration.install(pool, origin)
        installed.append(integration)
        note("%s: installed (%.2f s)", integration.name, phases[integration.name])
