"""Integration installs that run while ``init``'s start-up prefetch does.

An integration whose install reads nothing the prefetch brings (FlashInfer's: it
puts a wrapper in front of the loader and looks artifacts up only when the engine
asks, after ``init`` returns) need not wait for the prefetch: :class:`InstallsBeside`
installs those on a thread of their own while the prefetch runs, in the order given,
so that the install (and the import of the consumer it may do) costs no time of its
own while the ranks wait for downloads. An integration says so with a true
``install_beside_prefetch`` attribute (read when ``init`` starts its prefetch; a
consumer whose import must happen on the main thread says false); the rest (the JIT
cache families, which fill their directories from the pool) are installed after the
prefetch. Such an install is timed as ``"<name>:beside"`` in ``Session.phases``: it
overlaps the ``"prefetch"`` phase.
"""

from __future__ import annotations

import contextlib
import contextvars
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

#: What the phase of an install beside the prefetch is named after (``"<name>:beside"``).
BESIDE = ":beside"


@contextmanager
def phase(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds of the block to ``phases[name]`` (a phase may come back: the
    peers' start, then their share)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start


def installs_beside(integration: Integration) -> bool:
    """Whether ``integration`` may be installed while the start-up prefetch runs (not
    where asking raises: its install then raises after the prefetch, as any other's)."""
    try:
        return getattr(integration, "install_beside_prefetch", False) is True
    except Exception:
        return False


#: Seconds an interrupted ``init`` still waits for an install beside the prefetch
#: before it leaves it (which then uninstalls itself when it ends).
ABANDON_S = 2.0


class InstallsBeside:
    """Installs the integrations of ``chosen`` that :func:`installs_beside` allows on
    a thread :meth:`start` starts; :meth:`join_into` waits for it and :meth:`check`
    raises what an install raised."""

    def __init__(self, chosen: Sequence[Integration], pool: ArtifactPool,
                 origin: Origin | None, phases: dict[str, float]) -> None:
        self.early = [i for i in chosen if installs_beside(i)]
        self._installed: list[Integration] = []
        self._error: BaseException | None = None
        self._pool, self._origin, self._phases = pool, origin, phases
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._left = False  # join_into has returned: nothing more is recorded

    def start(self) -> None:
        if self.early:
            # In the caller's context: an install that calls init finds the session
            # being started (distcache.session).
            self._thread = threading.Thread(target=contextvars.copy_context().run,
                                            args=(self._run,), daemon=True,
                                            name="distcache-install")
            self._thread.start()

    def _run(self) -> None:
        for integration in self.early:
            try:
                with phase(self._phases, integration.name + BESIDE):
                    integration.install(self._pool, self._origin)
            except BaseException as exc:  # raised on the caller's thread by check()
                self._error = exc
                return
            with self._lock:
                if self._left:  # init was interrupted and went on without it
                    integration.uninstall()
                    return
                self._installed.append(integration)

    def join_into(self, installed: list[Integration], *, failing: bool = False
                  ) -> list[Integration]:
        """Wait for the installs (each is non-collective and bounded by its own
        imports), append those done to ``installed`` in order (so ``Session.close``
        uninstalls them) and return them. A Ctrl-C while waiting waits at most
        :data:`ABANDON_S` more (a second one not at all), then is raised; an install
        that ends later uninstalls itself. An install's error is logged here (with
        ``failing``, the caller is raising an error of its own and drops it)."""
        interrupted: BaseException | None = None
        if self._thread is not None:
            try:
                self._thread.join()
            except KeyboardInterrupt as exc:
                interrupted = exc
                with contextlib.suppress(KeyboardInterrupt):
                    self._thread.join(ABANDON_S)
        with self._lock:
            self._left = True
            done = list(self._installed)
        installed.extend(done)
        if self._error is not None:
            log.warning("installing %s beside the prefetch failed%s: %s",
                        self.early[len(done)].name, " as well" if failing else "",
                        self._error, exc_info=self._error)
        if interrupted is not None:
            raise interrupted
        return done

    def check(self) -> None:
        """Raise what the first failing install raised (those after it were not
        tried), once :meth:`join_into` returned. Call it after the start-up's last
        collective, so that the other ranks are not left waiting in it."""
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
                 phases.get(integration.name + BESIDE, 0.0))
            continue
        with phase(phases, integration.name):
            integration.install(pool, origin)
        installed.append(integration)
        note("%s: installed (%.2f s)", integration.name, phases[integration.name])
