"""The one way any caller gets a communicator: :func:`adopt`.

``comm.auto()``, ``distcache.init``, ``python -m launch --prefetch`` and ``distcache
prefetch`` all come here; :func:`choose` is the whole policy, so a new kind of
communicator is a change to that one function.

Every communicator made here is distcache's own, never the engine's:

* MPI (an MPI runtime launched several ranks, or mpi4py is already imported in a
  single process): a ``Dup`` of the world, made after every rank has reported in, so
  an abandoned collective of distcache's can never be matched by one of the engine's;
* torch (the engine initialised torch.distributed, or torchrun/srun started several
  ranks): a private gloo group built on the job's rendezvous store under a prefix of
  its own (:func:`launch.find_store`). The default process group is never initialised,
  adopted or destroyed here, whether the engine made it before or after;
* one rank: a world-size-1 :class:`~distcache.comm.LocalCommunicator`.

Every adoption agrees on a :class:`~distcache.comm._scope.RunScope` (the launcher's
job id, the restart attempt, a nonce, a secret of the run): :attr:`Adopted.scope`. Keys
and names distcache derives from it never meet another adoption's.

:meth:`Adopted.close` discards what :func:`adopt` made; the engine's communicators are
untouched by it, by a distcache timeout and by a distcache failure.

Nothing here imports torch or mpi4py to find out: importing torch costs seconds, and
importing ``mpi4py.MPI`` calls ``MPI_Init``, which hangs or aborts outside an MPI
launch. torch is consulted only when it is already in ``sys.modules``; MPI is detected
from launcher variables.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

from distcache._log import get_logger
from distcache.comm._base import Communicator, hostname
from distcache.comm._local import LocalCommunicator
from distcache.comm._mpi import MpiCommunicator
from distcache.comm._scope import RunScope, StoreLost, drawn, fresh, scope_of
from distcache.config import settings
from distcache.errors import DistcacheError
from launch import LaunchInfo, detect, run_id

__all__ = ["Adopted", "Choice", "adopt", "auto", "choose", "launcher_is_mpi",
           "torch_is_initialised"]

log = get_logger(__name__)

_OPTIONS = frozenset({"timeout", "chunk_bytes", "node_id"})

#: ``"mpi"``: a duplicate of the MPI world; ``"gloo"``: a private gloo group on the
#: job's rendezvous store; ``"local"``: one rank.
Choice = Literal["mpi", "gloo", "local"]


def torch_is_initialised() -> bool:
    """True when torch is already imported and its default process group is up."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def launcher_is_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when an MPI runtime launched this process (so ``MPI_Init`` will succeed).

    Raises:
        LaunchError: the launcher variables contradict each other.
    """
    return detect(os.environ if environ is None else environ).is_mpi


def choose(info: LaunchInfo) -> Choice:
    """Which communicator this process gets: the whole policy, pure but for looking at
    ``sys.modules``."""
    if info.is_mpi and info.world_size > 1:
        return "mpi"
    if "mpi4py.MPI" in sys.modules and info.world_size == 1 and not torch_is_initialised():
        return "mpi"
    if torch_is_initialised() or info.world_size > 1:
        return "gloo"
    return "local"


class Adopted(NamedTuple):
    """A communicator of distcache's own and how it was chosen.

    Call :meth:`close` when done: it frees the communicator (and the groups split off
    it) and nothing of the engine's.
    """

    comm: Communicator
    choice: Choice
    #: What every rank agreed on for this adoption; keys and names derive from it, and
    #: its secret (never logged) authenticates peers of this run.
    scope: RunScope
    #: Where a gloo group met ("the engine's default store", ...); "" otherwise.
    rendezvous: str = ""

    def close(self) -> None:
        """Discard distcache's communicator; idempotent."""
        close = getattr(self.comm, "close", None)
        if close is not None:
            close()


def adopt(
    info: LaunchInfo | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **options: Any,
) -> Adopted:
    """Make this process's own communicator (see :func:`choose`). Collective: every
    rank of the job calls it.

    Args:
        info: the launch (default: :func:`launch.detect` of ``environ``).
        environ: the environment to detect from and to read ``DISTCACHE_*`` settings
            from (default ``os.environ``).
        options: ``timeout``, ``chunk_bytes``, ``node_id`` for the backend chosen
            (each overrides its ``DISTCACHE_*`` variable); a local communicator uses
            only ``node_id``. ``timeout`` also bounds making the communicator: a
            rank that does not come raises, it does not hang. Under MPI it starts once
            ``MPI_Init`` returned (the engine's ``import mpi4py.MPI``, else distcache's):
            Open MPI's ``MPI_Init`` itself waits for every rank of the job to call it.

    Raises:
        TypeError: an unknown option.
        CommError: the backend chosen cannot be used (mpi4py missing, the rendezvous
            store unreachable).
        CollectiveTimeout: not every rank came to make the communicator (and agree
            on the run scope) in time.
        LaunchError: the launcher variables contradict each other or MPI's rank and
            size, or the rendezvous address is missing.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    env = os.environ if environ is None else environ
    if info is None:
        info = detect(env)
    choice = choose(info)
    job, attempt, _ = run_id(env)
    # The settings of ``env``, not of this process's environment, resolved once: each
    # communicator made here takes them explicitly.
    conf = settings(env, **options)
    wait = conf.timeout
    options = {"timeout": conf.timeout, "chunk_bytes": conf.chunk_bytes,
               "node_id": conf.node_id if conf.node_id is not None else hostname()}
    # One deadline for the whole adoption: reaching the store, agreeing on the scope,
    # making the group and sharing the secret all fit in the timeout together.
    until = time.monotonic() + wait
    if choice == "mpi":
        log.debug("communicator: a duplicate of the MPI world")
        # Rank 0's scope reaches every rank with the arrival check before Dup: no
        # collective of its own.
        mpi = MpiCommunicator(announce=drawn(), **options)
        try:
            _check_mpi_world(info, mpi, env)
            scope = scope_of(mpi.announced, job, attempt, mpi.rank)
        except DistcacheError:
            mpi.close()
            raise
        return Adopted(mpi, choice, scope)
    if choice == "gloo":
        gloo, source = _gloo(info, env, (job, attempt), wait, until, options)
        log.debug("run scope: job %r, attempt %d, nonce %s", gloo.scope.job,
                  gloo.scope.attempt, gloo.scope.nonce)
        return Adopted(gloo, choice, gloo.scope, source)
    return Adopted(LocalCommunicator(options["node_id"]), choice, fresh(job, attempt))


def _check_mpi_world(info: LaunchInfo, mpi: MpiCommunicator,
                     env: Mapping[str, str]) -> None:
    """Raise unless MPI places this process where the launcher's variables do
    (:func:`launch._detect.check_mpi_place`; LaunchError)."""
    if info.is_mpi:
        from launch._detect import check_mpi_place

        check_mpi_place(info, mpi.rank, mpi.size, env)


def _gloo(info: LaunchInfo, env: Mapping[str, str], run: tuple[str, int], wait: float,
          until: float, options: Mapping[str, Any]) -> tuple[Any, str]:
    """distcache's gloo group on the job's store, and where it met.

    Where rank 0 hosts the store for one adoption (``srun``, ``python -m launch``), a
    client that is quick to its next adoption can reach the previous one's store in
    the moment before rank 0 closes it: the connection then drops in the middle of the
    meeting (:class:`~distcache.comm._scope.StoreLost`) and this rank dials the port
    again, now answered by the store of the adoption rank 0 is making, until the
    deadline. ``wait`` is the whole timeout, ``until`` its deadline.
    """
    from distcache.comm._gloo import GlooCommunicator
    from launch import find_store

    dialled = False
    while True:
        meeting = find_store(info, max(until - time.monotonic(), 0.001), env)
        log.debug("communicator: distcache's own gloo group on %s", meeting.source)
        try:
            gloo = GlooCommunicator(meeting.store, meeting.rank, meeting.world_size,
                                    run=run, until=until, **options)
        except StoreLost as exc:
            if not meeting.replaceable or time.monotonic() >= until:
                raise
            log.info("rank %d: the %s closed under this adoption (an earlier adoption's, "
                     "replaced by rank 0's next); dialling it again: %s", meeting.rank,
                     meeting.source, exc)
            dialled = True
            time.sleep(0.05)
            continue
        if dialled:
            # Dialled with what was left of the deadline: the group's later store calls
            # get the whole timeout again.
            from datetime import timedelta

            meeting.store.set_timeout(timedelta(seconds=wait))
        return gloo, meeting.source


def auto(**options: Any) -> Communicator:
    """A communicator of distcache's own for this process: see :func:`adopt`.

    Raises:
        TypeError: an unknown option.
        CommError: MPI was detected but mpi4py cannot be used.
        LaunchError: the launcher variables contradict each other.
        ConfigError: a ``DISTCACHE_*`` variable has a bad value.
    """
    return adopt(**options).comm
