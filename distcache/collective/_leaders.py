"""What a collective run by node leaders alone (:mod:`distcache._delegate`) reports,
in the job's terms: the leaders' communicator counts its own ranks, ``0`` to the
number of nodes; the job's ranks are what every rank of the job is told."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from distcache.errors import DistcacheError, ManifestMismatchError

if TYPE_CHECKING:
    from distcache.comm import NodeTree


def in_job_terms(error: BaseException, tree: NodeTree, leaders: list[int]) -> BaseException:
    """``error`` with the ranks it names (the leaders' own) as ranks of the job: its
    ``rank``, and every ``rank i/n`` (``n`` leaders) in its message and its ``cause``."""
    given = getattr(error, "groups", None)
    if isinstance(error, ManifestMismatchError) and isinstance(given, dict):
        groups = {digest: sorted(r for i in ranks for r in tree.node_of(leaders[i]))
                  for digest, ranks in given.items()}
        counts = getattr(error, "counts", None)
        counts = counts if isinstance(counts, dict) else {}
        parts = "; ".join(
            f"ranks {ranks} have {digest[:12]}"
            + (f" ({counts[digest]} artifacts)" if digest in counts else "")
            for digest, ranks in groups.items())
        mapped = ManifestMismatchError(
            f"ranks called prefetch with different artifact lists: {parts}; every rank "
            "must pass the same list", groups=groups, counts=counts, agreed=error.agreed)
        return mapped
    if not isinstance(error, DistcacheError):
        return error
    rank = getattr(error, "rank", None)
    if type(rank) is int and 0 <= rank < len(leaders):
        setattr(error, "rank", leaders[rank])  # noqa: B010 (declared, set at run time)
    error.args = (job_ranks(error.message, tree.size, leaders), *error.args[1:])
    cause = getattr(error, "cause", None)
    if isinstance(cause, str):
        setattr(error, "cause", job_ranks(cause, tree.size, leaders))  # noqa: B010
    return error


def job_ranks(text: str, size: int, leaders: list[int]) -> str:
    """``text`` with every ``rank i/n`` of the ``n`` leaders' communicator as
    ``rank j/size``, ``j`` the job's rank of leader ``i``."""
    def mapped(found: re.Match[str]) -> str:
        index = int(found[1])
        return f"rank {leaders[index]}/{size}" if index < len(leaders) else found[0]

    return re.sub(rf"\brank (\d+)/{len(leaders)}\b", mapped, text)
