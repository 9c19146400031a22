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
    │   ├── ArtifactNotFound                the origin answered: it has no such artifact
    │   └── OriginUnreachable               no connection at all: the origin is down for now
    ├── PoolError (OSError)                 the on-disk pool could not be used
    ├── PeerError                           a node agent did not serve an artifact
    ├── CommError                           a communicator backend failed
    │   ├── CollectiveTimeout (TimeoutError)  a collective did not complete in time
    │   └── WireError (ValueError)          a payload is not plain data, or not distcache's
    ├── RemoteError                         an error raised on another rank
    ├── ManifestMismatchError               ranks disagree on a collective"s input
    ├── PrefetchError                       the collective prefetch failed (on any rank)
    ├── IpcError                            an IPC pool or feature reference is unusable
    │   └── StaleHandleError                a reference to an old epoch of a pool
    ├── JitCacheError                       a JIT cache directory cannot be published or filled
    ├── LaunchError (ValueError)            launcher environment is missing or inconsistent
    └── WorkspaceError (OSError)            a per-rank workspace slot could not be claimed

Errors carry structured attributes (``sha256``, ``path``, ``rank``, ``host`` ...),
declared per class in ``attributes`` (a keyword that no class in the hierarchy declares
is a ``TypeError`` at the raise site, so a typo cannot hide a field), and survive
pickling, because they cross ranks: a failure on one rank is all-gathered and
re-raised on every other rank.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "ArtifactNameError",
    "ArtifactNotFound",
    "CollectiveTimeout",
    "CommError",
    "ConfigError",
    "DistcacheError",
    "IntegrityError",
    "IpcError",
    "JitCacheError",
    "LaunchError",
    "ManifestError",
    "ManifestMismatchError",
    "OriginError",
    "OriginUnreachable",
    "PeerError",
    "PoolError",
    "PrefetchError",
    "RemoteError",
    "StaleHandleError",
    "WireError",
    "WorkspaceError",
]


def _rebuild(cls: type[DistcacheError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls)
    exc.args = args
    for key, value in state.items():
        setattr(exc, key, value)
    return exc


class DistcacheError(Exception):
    """Base of every error distcache raises on purpose.

    Keyword arguments become attributes (``err.rank``, ``err.sha256`` ...); each class
    declares the ones it takes in ``attributes`` and every declared attribute that was
    not given reads as ``None``. The message is the first positional argument and is
    the whole human-readable text. The keyword-only ``agreed`` sets :attr:`agreed`
    (every subclass takes it); pickling carries it.

    Raises:
        TypeError: a keyword that no class in the hierarchy declares.
    """

    #: Where the error happened; set on any error that crosses ranks.
    attributes: ClassVar[tuple[str, ...]] = ("rank", "host")
    #: True when every rank of a collective raised this same error, so that one rank's
    #: report is the job's: a program prints it on rank 0 only
    #: (:func:`distcache._logging.error_line`).
    agreed: bool = False

    def __init__(self, message: str = "", *, agreed: bool = False, **attrs: Any) -> None:
        super().__init__(message)
        self.agreed = agreed
        known = self.declared()
        unknown = sorted(set(attrs) - known)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} takes the attributes {sorted(known)}; got {unknown}"
            )
        for key in known:
            setattr(self, key, attrs.get(key))

    @classmethod
    def declared(cls) -> frozenset[str]:
        """Every attribute this class and its bases declare."""
        names: set[str] = set()
        for klass in cls.__mro__:
            names.update(vars(klass).get("attributes", ()))
        return frozenset(names)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduce calls cls(*args), which loses keyword attributes and
        # breaks subclasses whose __init__ takes other arguments.
        # Declared attributes are read with getattr: OSError keeps ``errno`` in a slot.
        state = dict(self.__dict__)
        state.update((name, getattr(self, name, None)) for name in self.declared())
        return (_rebuild, (type(self), self.args, state))


class ArtifactNameError(DistcacheError, ValueError):
    """An artifact name was rejected as unsafe. Attributes: ``name``, ``reason``,
    ``line`` (1-based, when the name came from a manifest)."""

    attributes = ("name", "reason", "line")


class ManifestError(DistcacheError, ValueError):
    """A malformed manifest (``sha256sum`` format). Attributes: ``line`` (1-based),
    ``text``."""

    attributes = ("line", "text", "source")


class ConfigError(DistcacheError, ValueError):
    """A bad configuration value. Attributes: ``variable``, ``value``."""

    attributes = ("variable", "value")


class IntegrityError(DistcacheError):
    """Bytes did not match their SHA-256. Attributes: ``sha256`` (expected),
    ``actual``, ``source``."""

    attributes = ("sha256", "actual", "source", "name")


class OriginError(DistcacheError):
    """An origin could not deliver an artifact. Attributes: ``url``, ``status``,
    ``name``, ``failures`` (one error per origin, from a chain), ``timeout``."""

    attributes: ClassVar[tuple[str, ...]] = ("url", "status", "name", "failures", "timeout")


class PoolError(DistcacheError, OSError):
    """The on-disk pool could not be used. Attributes: ``path``, ``errno``."""

    attributes = ("path", "errno")


class PeerError(DistcacheError):
    """A node agent did not serve an artifact: refused (``refused``: no or a wrong
    signature, an object it does not hold), unreachable, or too slow. Attributes:
    ``endpoint``, ``status`` (HTTP, ``None`` without an answer), ``sha256``, ``refused``."""

    attributes = ("endpoint", "status", "sha256", "refused")


class CommError(DistcacheError):
    """A communicator backend failed. Attributes: ``op``, ``rank``, ``backend``."""

    attributes: ClassVar[tuple[str, ...]] = ("op", "rank", "backend", "timeout")


class CollectiveTimeout(CommError, TimeoutError):
    """A collective did not complete within its timeout. Attributes: ``op``,
    ``timeout``, ``rank``."""


class WireError(CommError, ValueError):
    """A collective payload could not cross ranks: the sender holds a value that is not
    plain data (``type_name`` names its type), or a peer's bytes are not a payload of
    this distcache (``peer``: the rank that sent them). Attributes: those of
    :class:`CommError`, ``peer``, ``type_name``."""

    attributes = ("peer", "type_name")


class RemoteError(DistcacheError):
    """An error raised on another rank. Attributes: ``rank``, ``host``,
    ``remote_type`` (the class name of the original error)."""

    attributes = ("rank", "host", "remote_type")


class ManifestMismatchError(DistcacheError):
    """Ranks called a collective with different inputs. Attributes: ``groups``
    (digest -> list of ranks), ``counts`` (digest -> artifacts listed, where known)."""

    attributes = ("groups", "counts")


class PrefetchError(DistcacheError):
    """The collective prefetch failed. Raised identically on every rank.
    Attributes: ``artifact``, ``rank``, ``host``, ``cause``, ``phase``."""

    attributes = ("artifact", "rank", "host", "cause", "phase")


class IpcError(DistcacheError):
    """An IPC pool or feature reference cannot be used. Attributes: ``pool_id``."""

    attributes = ("pool_id",)


class StaleHandleError(IpcError):
    """A feature reference names an epoch of a pool that is no longer mapped."""


class ArtifactNotFound(OriginError):
    """The origin answered that it has no such artifact (an HTTP 404, a missing file in
    a mirror, every member of a chain missing it). Definitive: retrying the same origin
    will not help. Attributes: those of :class:`OriginError`."""


class OriginUnreachable(OriginError):
    """The origin cannot be reached at all: the connection was refused or its host
    name does not resolve. The origin is marked down for a minute (a command's whole
    run), so the remaining artifacts fail at once instead of each being retried.
    Attributes: those of :class:`OriginError`, plus ``cause`` (a short text:
    "connection refused")."""

    attributes: ClassVar[tuple[str, ...]] = ("cause",)


class LaunchError(DistcacheError, ValueError):
    """The launcher environment is missing, malformed or inconsistent.

    Attributes: ``variable`` and ``value`` for a malformed variable; ``conflicts`` (a
    list of ``"field: VAR=v (launcher) vs VAR=w (launcher)"``) for disagreeing sources.
    """

    attributes = ("variable", "value", "conflicts")


class WorkspaceError(DistcacheError, OSError):
    """A workspace slot could not be created or locked. Attributes: ``path``."""

    attributes = ("path",)


class JitCacheError(DistcacheError):
    """A JIT compile cache directory could not be published or materialised: a
    directory owned by another user, an unsafe path, a malformed tree manifest.
    Attributes: ``family``, ``path``."""

    attributes = ("family", "path")
