"""``Session.sync``'s work: each rank stores what its JIT cache directories gained,
then the collective sync brings every pool what any rank fetched or published since
the last one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from distcache._log import get_logger
from distcache.errors import DistcacheError

if TYPE_CHECKING:
    from distcache.collective import PrefetchReport, SyncState
    from distcache.comm import Communicator
    from distcache.integrations import Integration
    from distcache.store import ArtifactPool

log = get_logger(__name__)


def publish_and_sync(comm: Communicator, pool: ArtifactPool,
                     integrations: Sequence[Integration], state: SyncState,
                     timeout: float | None) -> PrefetchReport:
    """Collective: :func:`publish_jit`, then :func:`distcache.collective.sync` over
    ``comm`` with ``state`` (what the last sync left)."""
    publish_jit(pool, integrations)
    from distcache.collective import sync  # loaded by the first sync

    report = sync(comm=comm, pool=pool, timeout=timeout, state=state)
    if comm.rank == 0:
        log.info("sync: %s", report.summary())
    return report


def publish_jit(pool: ArtifactPool, integrations: Sequence[Integration]) -> None:
    """Store what this rank's JIT cache directories (the JIT families among
    ``integrations``) gained; not collective: a failure, of whatever type, is logged,
    so that no rank leaves the others waiting in the sync."""
    from distcache.jit import Family

    for integration in integrations:
        if isinstance(integration, Family):
            try:
                count = integration.publish(pool)
            except (DistcacheError, OSError) as exc:
                log.warning("%s: not published: %s", integration.name, exc)
                continue
            except Exception as exc:  # raised here, it would leave the others waiting
                log.warning("%s: not published: %s: %s", integration.name,
                            type(exc).__name__, exc, exc_info=True)
                continue
            log.debug("%s: published %d new file(s)", integration.name, count)
