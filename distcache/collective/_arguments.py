"""The arguments of the public collectives (:func:`distcache.prefetch`,
:func:`distcache.sync`), checked before the first round: a wrong kind of value fails
with a :class:`~distcache.errors.ConfigError` naming it and what to pass, on this rank
at once (told to the others where the communicator can), instead of an
``AttributeError`` deep inside, or in the fetch phase after every rank has planned."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, BinaryIO

from distcache.artifact import Artifact
from distcache.comm._announce import tell_others
from distcache.errors import ConfigError, OriginError

#: What a value must offer to serve as each argument (the protocols' methods the
#: collectives call first; test stand-ins offer them too).
_NEEDS = {
    "comm": ("rank", "size", "allgather_object"),
    "pool": ("pool_id", "has", "get", "put", "batch"),
    "origin": ("describe", "fetch"),
}
_HOW = {
    "comm": "a distcache communicator (distcache.comm.from_mpi(), from_torch(), local())",
    "pool": "an ArtifactPool (distcache.ArtifactPool(path))",
    "origin": "an origin (distcache.HttpOrigin(url), distcache.DirOrigin(path))",
}


def checked(what: str, comm: Any, pool: Any, *, origin: Any = None, state: Any = None,
            state_type: type | None = None, artifacts: Iterable[Any] | None = None
            ) -> list[Artifact]:
    """Refuse a ``comm``, ``pool``, ``origin`` (given for a prefetch), ``state`` (a
    sync's, a ``state_type``) or ``artifacts`` of the wrong kind for the collective
    ``what``; the artifacts as a list.

    Raises:
        ConfigError: naming the argument, what it is and what to pass.
    """
    try:
        given = {"comm": comm, "pool": pool} | (
            {} if artifacts is None or origin is None else {"origin": origin})
        for name, value in given.items():
            lacking = [attr for attr in _NEEDS[name] if not hasattr(value, attr)]
            if lacking:
                raise ConfigError(
                    f"{what}'s {name}={value!r:.80} is not {_HOW[name]} (it has no "
                    f"{', '.join(lacking)})", variable=name, value=repr(value)[:80])
        if state is not None and state_type is not None and not isinstance(state, state_type):
            raise ConfigError(f"{what}'s state={state!r:.80} is not a SyncState (pass "
                              "distcache.collective.SyncState() and keep it between syncs)",
                              variable="state", value=repr(state)[:80])
        return [] if artifacts is None else _artifacts(what, artifacts)
    except ConfigError as exc:
        tell_others(comm, exc)  # they would wait for this rank until their timeout
        raise


def _artifacts(what: str, artifacts: Iterable[Any]) -> list[Artifact]:
    if isinstance(artifacts, str | bytes | os.PathLike):
        raise ConfigError(
            f"{what}'s artifacts={artifacts!r:.80} is a path, not a list of Artifacts; "
            "read it with distcache.artifact.read_manifest(path), or pass it to "
            "distcache.init(manifests=[path])", variable="artifacts",
            value=repr(artifacts)[:80])
    try:
        listed = list(artifacts)
    except TypeError:
        raise ConfigError(f"{what}'s artifacts={artifacts!r:.80} is not a list of "
                          "Artifacts", variable="artifacts",
                          value=repr(artifacts)[:80]) from None
    for index, item in enumerate(listed):
        if not isinstance(item, Artifact):
            raise ConfigError(
                f"{what}'s artifacts[{index}]={item!r:.80} is not an Artifact; build one "
                "with distcache.Artifact(name, sha256), or read a manifest with "
                "distcache.artifact.read_manifest(path)", variable="artifacts",
                value=repr(item)[:80])
    return listed


class NoneGiven:
    """The origin of a prefetch given ``origin=None``: what the pools hold moves
    between them; an artifact none holds fails the prefetch naming it, on every rank."""

    def describe(self) -> str:
        return "no origin (origin=None)"

    def fetch(self, artifact: Artifact) -> bytes:
        raise OriginError(f"{artifact.name} is in no pool and the prefetch was given no "
                          "origin (origin=None); pass one to fetch it",
                          name=artifact.name)

    def fetch_into(self, artifact: Artifact, out: BinaryIO) -> int:
        return len(self.fetch(artifact))
