"""``DISTCACHE_OFFLINE=1`` at the pool: a miss never reaches an origin.

The callers above (the collective prefetch, ``distcache fetch``, the FlashInfer
wrapper) decide offline before they pick an origin; this is the last check, where
the request would be made, so an origin handed to :meth:`ArtifactPool.fetch` or
:meth:`ArtifactPool.download` directly is not asked either. The setting is read at
call time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from distcache.config import setting
from distcache.errors import ConfigError

if TYPE_CHECKING:
    from distcache.artifact import Artifact
    from distcache.origins import Origin


def refuse_offline(artifact: Artifact, root: Path, origin: Origin) -> None:
    """Raise when downloads are off; return when ``origin`` may be asked.

    Raises:
        ConfigError: ``DISTCACHE_OFFLINE=1``: names the artifact, the pool, the
            origin that was not asked, and the commands that bring the artifact in.
    """
    if not setting("offline"):
        return
    describe = getattr(origin, "describe", None)
    source = describe() if callable(describe) else repr(origin)
    raise ConfigError(
        f"{artifact.name} (sha256 {artifact.sha256}) is not in the pool at {root} and "
        f"DISTCACHE_OFFLINE=1 forbids downloads, so {source} was not asked; on a machine "
        f"that reaches an origin run: printf '%s  %s\\n' {artifact.sha256} {artifact.name} "
        "> need.txt && distcache fetch --manifest need.txt && distcache pool export "
        "--tar need.tar; then here: distcache pool import need.tar (or unset "
        "DISTCACHE_OFFLINE)", variable="DISTCACHE_OFFLINE", value="1")
