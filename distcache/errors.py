"""The distcache error tree.

Every error distcache raises on purpose is a :class:`DistcacheError`. Leaves also
subclass the builtin they mean, so ``except ValueError`` or ``except TimeoutError``
in engine code keeps working::

    DistcacheError
    ├── ArtifactNameError (ValueError)      an untrusted artifact name was rejected
    ├── ManifestError (ValueError)          a malformed checksums/manifest line
    ├── ConfigError (ValueError)            a bad argument or DISTCACHE_* value
    ├── IntegrityError                      bytes did not match their SHA-256
    ├── OriginError                         an origin could not deliver an artifact
    ├── PoolError (OSError)                 the on-disk pool could not be used
    ├── CommError                           a communicator backend failed
    │   └── CollectiveTimeout (TimeoutError)  a collective did not complete in time
    ├── RemoteError                         an error raised on another rank
    ├── ManifestMismatchError               ranks disagree on a collective's input
    ├── PrefetchError                       the collective prefetch failed (on any rank)
    ├── IpcError                            an IPC pool or feature reference is unusable
    │   └── StaleHandleError                a reference to an old epoch of a pool
    └── launch.LaunchError (ValueError)     launcher environment is missing or inconsistent

Errors carry structured attributes (``sha256``, ``path``, ``rank``, ``host`` ...) and
survive pickling, because they cross ranks: a failure on one rank is all-gathered and
re-raised on every other rank.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArtifactNameError",
    "CollectiveTimeout",
    "CommError",
    "ConfigError",
    "DistcacheError",
    "IntegrityError",
    "IpcError",
    "ManifestError",
    "ManifestMismatchError",
    "OriginError",
    "PoolError",
    "PrefetchError",
    "RemoteError",
    "StaleHandleError",
]


def _rebuild(cls: type[DistcacheError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class DistcacheError(Exception):
    """Base of every error distcache raises on purpose.

    Keyword arguments become attributes (``err.rank``, ``err.sha256`` ...). The
    message is the first positional argument and is the whole human-readable text.
    """

    def __init__(self, message: str = "", **attrs: Any) -> None:
        super().__init__(message)
        for key, value in attrs.items():
            setattr(self, key, value)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduce calls cls(*args), which loses keyword attributes and
        # breaks subclasses whose __init__ takes other arguments.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class ArtifactNameError(DistcacheError, ValueError):
    """An artifact name was rejected as unsafe. Attributes: ``name``, ``reason``."""


class ManifestError(DistcacheError, ValueError):
    """A malformed manifest (``sha256sum`` format). Attributes: ``line`` (1-based),
    ``text``."""


class ConfigError(DistcacheError, ValueError):
    """A bad configuration value. Attributes: ``variable``, ``value``."""


class IntegrityError(DistcacheError):
    """Bytes did not match their SHA-256. Attributes: ``sha256`` (expected),
    ``actual``, ``source``."""


class OriginError(DistcacheError):
    """An origin could not deliver an artifact. Attributes: ``url``, ``status``,
    ``name``."""


class PoolError(DistcacheError, OSError):
    """The on-disk pool could not be used. Attributes: ``path``."""


class CommError(DistcacheError):
    """A communicator backend failed. Attributes: ``op``, ``rank``, ``backend``."""


class CollectiveTimeout(CommError, TimeoutError):
    """A collective did not complete within its timeout. Attributes: ``op``,
    ``timeout``, ``rank``."""


class RemoteError(DistcacheError):
    """An error raised on another rank. Attributes: ``rank``, ``host``,
    ``remote_type`` (the class name of the original error)."""


class ManifestMismatchError(DistcacheError):
    """Ranks called a collective with different inputs. Attributes: ``groups``
    (digest -> list of ranks)."""


class PrefetchError(DistcacheError):
    """The collective prefetch failed. Raised identically on every rank.
    Attributes: ``artifact``, ``rank``, ``host``, ``cause``."""


class IpcError(DistcacheError):
    """An IPC pool or feature reference cannot be used. Attributes: ``pool_id``."""


class StaleHandleError(IpcError):
    """A feature reference names an epoch of a pool that is no longer mapped."""
