"""Which launcher started this process, and where it sits in the job.

:func:`detect` reads only the environment (and the host name) and returns a frozen
:class:`LaunchInfo`. It never imports torch or mpi4py: importing ``mpi4py.MPI`` calls
``MPI_Init``, which hangs or aborts outside an MPI launch (Lightning-AI/pytorch-lightning
#20049, h5py PR #1544).

Sources, in order of precedence (the first one present is ``launcher``; the variables
each reads are listed in :mod:`launch._sources`): ``torchrun``, ``openmpi``, ``mpich``,
``pmix``, ``slurm``, and ``single`` when none is present (rank 0 of 1; but a size above
1 with no rank, or ``SLURM_PROCID`` above 0 outside a step, is a launcher that came half
through, and raises: :func:`launch._sources.check_half_set`). torchrun comes
first because it is always the innermost launcher: torchrun runs inside Slurm
allocations and MPI jobs.

Agreement rules. Every source present must agree with the others on every value they
both give; a disagreement raises :class:`LaunchError` listing the variables. Two
nestings are normal and are not errors:

* Slurm under MPI: ``mpirun`` in an allocation starts its daemons with ``srun``, so
  the ranks inherit the daemons' step (one task per node). Under Open MPI's variables a
  Slurm step is always ignored; under MPICH's (which ``srun --mpi=pmi2`` sets beside the
  step) a step that differs from them in any field describes that parent and is
  ignored. Beside PMIx's alone, which give a rank and no size (so agreeing on the rank
  proves nothing: ``prterun``'s ranks match the daemons' step wherever ``PMIX_RANK``
  equals ``SLURM_PROCID``), a step counts only where ``PMIX_NAMESPACE`` is Slurm's own
  for it, ``slurm.pmix.<SLURM_JOB_ID>.<SLURM_STEP_ID>`` (``srun --mpi=pmix``); otherwise
  no variable gives the world size and every rank raises alike.
* Anything under torchrun: when ``TORCHELASTIC_RUN_ID`` is set, torchrun's agent
  spawned this process, and Slurm or MPI variables that disagree describe the agent;
  they are ignored. One that counts more processes than torchrun's workers more likely
  started this process inside a torchrun worker: that is logged as a warning. Without
  ``TORCHELASTIC_RUN_ID``, ``RANK`` disagreeing with another launcher is almost always
  a stale ``export RANK=...``, and raises.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from distcache._log import get_logger
from distcache._record import Record
from distcache.errors import LaunchError
from launch import _sources
from launch._nodelist import expand_nodelist
from launch._sources import FIELDS, Signal, parsed, read_int

LAUNCHERS = ("torchrun", "openmpi", "mpich", "pmix", "slurm", "single")
MPI_LAUNCHERS = frozenset({"openmpi", "mpich", "pmix"})

log = get_logger(__name__)

class LaunchInfo(Record):
    """Where this process sits in its job, as the launcher describes it."""

    _FIELDS = ("launcher", "rank", "world_size", "local_rank", "local_world_size",
                 "node_rank", "num_nodes", "node_id", "master_addr", "master_port", "source")
    __slots__ = _FIELDS
    launcher: str
    """One of :data:`LAUNCHERS`: the innermost launcher that set variables."""
    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int | None
    """Rank among the processes on this node; ``None`` when no variable says."""
    local_world_size: int | None
    """Number of processes on this node; ``None`` when no variable says."""
    node_rank: int | None
    """Index of this node in the job, as the launcher counts; ``None`` when unknown."""
    num_nodes: int | None
    """Number of nodes in the job, as the launcher counts; ``None`` when unknown."""
    node_id: str
    """``DISTCACHE_NODE_ID`` unless blank, else the host name. Ranks with equal ``node_id``
    are treated as sharing a node (and its node-local files)."""
    master_addr: str | None
    """Rendezvous host; ``None`` when it must be agreed at run time (under MPI)."""
    master_port: int | None
    """Rendezvous port; ``None`` when it must be agreed at run time."""
    source: tuple[str, ...]
    """The environment variables the values above came from."""

    def __init__(self, launcher: str, rank: int, world_size: int, local_rank: int | None,
                 local_world_size: int | None, node_rank: int | None, num_nodes: int | None,
                 node_id: str, master_addr: str | None, master_port: int | None,
                 source: tuple[str, ...] = ()) -> None:
        self._assign(launcher, rank, world_size, local_rank, local_world_size, node_rank,
                     num_nodes, node_id, master_addr, master_port, source)

    @property
    def is_mpi(self) -> bool:
        """True when an MPI runtime launched this process (mpi4py will work)."""
        return self.launcher in MPI_LAUNCHERS

    @property
    def single_node(self) -> bool:
        """True when the launcher says every rank runs on this node."""
        return self.num_nodes == 1 or self.local_world_size == self.world_size


def _describe(sig: Signal, name: str) -> str:
    value, var = sig.values[name]
    return f"{var}={value} ({sig.launcher})"


def _disagreements(a: Signal, b: Signal) -> list[str]:
    return [
        f"{name}: {_describe(a, name)} vs {_describe(b, name)}"
        for name in FIELDS
        if name in a.values and name in b.values and a.get(name) != b.get(name)
    ]


_WARNED: set[str] = set()


def _warn_if_inside_a_worker(torchrun: Signal, outer: list[Signal]) -> None:
    """Warn (once per process) when a launcher around torchrun's agent counts more
    processes than torchrun has workers: an agent starts at least one worker, so that
    launcher more likely started this process inside a torchrun worker, whose
    variables it inherited."""
    world = torchrun.get("world_size")
    for sig in outer:
        size = sig.get("world_size")
        if world is None or size is None or size <= world:
            continue
        message = (
            f"{_describe(sig, 'world_size')} is larger than {_describe(torchrun, 'world_size')}: "
            f"{sig.launcher} probably started this process inside a torchrun worker, whose "
            f"TORCHELASTIC_RUN_ID, RANK and WORLD_SIZE it inherited; it runs as torchrun "
            f"rank {torchrun.get('rank')} of {world}, not as {sig.launcher} rank "
            f"{sig.get('rank')} of {size}. Unset the torchrun variables before starting "
            f"{sig.launcher} inside a worker"
        )
        if message not in _WARNED:
            _WARNED.add(message)
            log.warning("%s", message)


def slurm_pmix_namespace(env: Mapping[str, str]) -> str | None:
    """The ``PMIX_NAMESPACE`` Slurm's pmix plugin gives the ranks of the step in ``env``
    (``slurm.pmix.<SLURM_JOB_ID>.<SLURM_STEP_ID>``); ``None`` outside a step."""
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    return None if job is None or step is None else f"slurm.pmix.{job}.{step}"


def _slurm_is_this_step(inner: list[Signal], slurm: Signal, env: Mapping[str, str]) -> bool:
    """Whether an ``srun`` step describes the processes the inner launchers started."""
    mpi = [s for s in inner if s.launcher in MPI_LAUNCHERS]
    if any(s.launcher == "openmpi" for s in mpi):
        # Open MPI's mpirun started the ranks itself: a step around them is the one
        # that started its daemons (or an outer srun), whichever fields happen to match.
        return False
    if [s.launcher for s in mpi] == ["pmix"]:
        # PMIx gives a rank and no size, so agreement proves nothing: prterun's ranks
        # agree with the daemons' step wherever PMIX_RANK equals SLURM_PROCID. Only
        # Slurm's own namespace for this step (srun --mpi=pmix) makes it the ranks' step,
        # and that holds or fails on every rank alike.
        namespace = env.get("PMIX_NAMESPACE")
        return namespace is not None and namespace == slurm_pmix_namespace(env)
    if mpi:
        # srun --mpi=pmi2 gives the step and the MPI variables one meaning; a step that
        # differs anywhere is a launcher's daemon step, on every rank alike.
        return not _disagreements(mpi[0], slurm)
    # Alone, or under RANK without torchrun's agent: a stale RANK disagreeing with a
    # real step must not pass.
    return True


def _merge(env: Mapping[str, str]) -> tuple[str, dict[str, tuple[int, str]]]:
    inner = [s for s in (read(env) for read in _sources.INNER) if s]
    slurm = _sources.slurm(env)
    elastic = "TORCHELASTIC_RUN_ID" in env
    if inner and inner[0].launcher == "torchrun" and elastic:
        # torchrun's agent spawned us; other launchers' variables describe the agent.
        outer = inner[1:] + ([slurm] if slurm else [])
        _warn_if_inside_a_worker(inner[0], outer)
        accepted = [inner[0]] + [s for s in outer if not _disagreements(inner[0], s)]
    else:
        accepted = list(inner)
        if slurm is not None and _slurm_is_this_step(inner, slurm, env):
            accepted.append(slurm)
    if not accepted:
        _sources.check_half_set(env)
        return "single", {}
    conflicts: list[str] = []
    for i, a in enumerate(accepted):
        for b in accepted[i + 1 :]:
            conflicts.extend(_disagreements(a, b))
    if conflicts:
        raise LaunchError(
            "launcher variables disagree: " + "; ".join(conflicts)
            + ". Unset the stale variables (e.g. an exported RANK) or the outer launcher's",
            conflicts=conflicts,
        )
    merged: dict[str, tuple[int, str]] = {}
    for sig in accepted:
        for name, item in sig.values.items():
            merged.setdefault(name, item)
    return accepted[0].launcher, merged


def _check_bounds(values: Mapping[str, tuple[int, str]], pairs: list[tuple[str, str]]) -> None:
    for low, high in pairs:
        if low in values and high in values and values[low][0] >= values[high][0]:
            (lv, lvar), (hv, hvar) = values[low], values[high]
            raise LaunchError(
                f"{lvar}={lv} must be < {hvar}={hv}", variable=lvar, value=str(lv)
            )


#: Ports derived from a Slurm job id: ``[SLURM_PORT_LOW, SLURM_PORT_HIGH]``, so that the
#: port and distcache's store one above it (:data:`launch._rendezvous.PORT_OFFSET`) both
#: stay below Linux's ephemeral range (32768-60999 by default,
#: ``net.ipv4.ip_local_port_range``): a port in that range may already be the local end
#: of any outgoing connection on rank 0's node, and its bind then fails at random.
SLURM_PORT_LOW = 10000
SLURM_PORT_HIGH = 32766


def slurm_port(job: str, step: str = "0") -> int:
    """The port every rank of Slurm job ``job``, step ``step`` derives, with no
    communication (as Lightning and submitit do); hashing spreads concurrent jobs on
    one node over ``[SLURM_PORT_LOW, SLURM_PORT_HIGH]``."""
    key = f"{job}.{step}".encode()
    span = SLURM_PORT_HIGH - SLURM_PORT_LOW + 1
    return SLURM_PORT_LOW + int.from_bytes(hashlib.sha256(key).digest()[:4], "big") % span


def _slurm_port(env: Mapping[str, str]) -> int | None:
    job = env.get("SLURM_JOB_ID")
    if job is None:
        return None
    return slurm_port(job, env.get("SLURM_STEP_ID", "0"))


def _master(
    env: Mapping[str, str], launcher: str, single_node: bool
) -> tuple[str | None, int | None, list[str]]:
    used: list[str] = []
    addr = env.get("MASTER_ADDR") or None
    if addr is not None:
        # A host name or an address (IPv6 in brackets or not, a zone after %), nothing
        # else: a blank or a trailing comment would be looked up as a name, after waiting.
        if len(addr) > 253 or not addr.isascii() or not all(
                c.isalnum() or c in "-._:%[]" for c in addr):
            raise LaunchError(f"MASTER_ADDR={addr[:200]!r} is not a host name or address",
                              variable="MASTER_ADDR", value=addr[:200])
        used.append("MASTER_ADDR")
    port = read_int(env, "MASTER_PORT", minimum=1, maximum=65535)  # a TCP port
    if port is not None:
        used.append("MASTER_PORT")
    if launcher == "slurm":
        if addr is None and single_node:
            addr = "127.0.0.1"
        elif addr is None and not (
            "arbitrary" in env.get("SLURM_DISTRIBUTION", "") or "SLURM_HOSTFILE" in env
        ):
            # With an arbitrary distribution the first host is not rank 0's
            # (Lightning-AI/pytorch-lightning#17228): leave it to the caller.
            nodes = env.get("SLURM_STEP_NODELIST")
            if nodes is not None:
                addr = parsed(expand_nodelist, "SLURM_STEP_NODELIST", nodes)[0]
                used.append("SLURM_STEP_NODELIST")
        if port is None:
            port = _slurm_port(env)
            if port is not None:
                used.append("SLURM_JOB_ID")
    elif launcher == "single":
        addr = "127.0.0.1" if addr is None else addr
    return addr, port, used


def _no_world_size(env: Mapping[str, str], values: Mapping[str, tuple[int, str]]) -> LaunchError:
    var = values["rank"][1] if "rank" in values else "rank"
    why = ""
    if var == "PMIX_RANK":
        why = "; PMIx sets none"
        if _sources.slurm(env) is not None:
            why += (f", and the Slurm step here (SLURM_STEP_NUM_TASKS="
                    f"{env.get('SLURM_STEP_NUM_TASKS')}) is not these ranks' (PMIX_NAMESPACE="
                    f"{env.get('PMIX_NAMESPACE')!r}, not Slurm's {slurm_pmix_namespace(env)!r}"
                    "): it started the launcher's daemons")
        why += (". Launch with srun --mpi=pmix or Open MPI's mpirun, or set "
                "RANK=$PMIX_RANK and WORLD_SIZE for each rank")
    return LaunchError(
        f"{var} is set but no variable gives the world size "
        "(expected WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE or SLURM_STEP_NUM_TASKS)" + why,
        variable=var,
        value=env.get(var, ""),
    )


def detect(environ: Mapping[str, str] = os.environ, *, hostname: str | None = None) -> LaunchInfo:
    """Describe this process's place in its job from the environment alone.

    ``hostname`` replaces the host name, ``os.uname().nodename`` (for tests).

    Raises:
        LaunchError: a launcher variable is not an integer or out of range (rank not
            below the world size, negative values), a rank is given without any size
            or a size above 1 without any rank (:func:`launch._sources.check_half_set`),
            or two launchers disagree (the message lists the variables).
    """
    launcher, values = _merge(environ)
    if launcher != "single" and "world_size" not in values:
        raise _no_world_size(environ, values)
    _check_bounds(
        values,
        [("rank", "world_size"), ("local_rank", "local_world_size"), ("node_rank", "num_nodes"),
         ("local_rank", "world_size"), ("node_rank", "world_size")],
    )
    if "local_world_size" in values and "world_size" in values:
        (lv, lvar), (wv, wvar) = values["local_world_size"], values["world_size"]
        if lv > wv:
            raise LaunchError(f"{lvar}={lv} exceeds {wvar}={wv}", variable=lvar, value=str(lv))

    def get(name: str, default: int | None = None) -> int | None:
        return values[name][0] if name in values else default

    world = get("world_size", 1)
    # One process in all (no launcher, or RANK=0 WORLD_SIZE=1) is alone on its node:
    # PROGRAM gets LOCAL_RANK and LOCAL_WORLD_SIZE, and the terminal, as under no launcher.
    alone = launcher == "single" or world == 1
    local_world = get("local_world_size", 1 if alone else None)
    num_nodes = get("num_nodes", 1 if alone else None)
    node_rank = get("node_rank", 0 if alone else None)
    if num_nodes is None and local_world is not None and local_world == world:
        num_nodes = 1
    if num_nodes == 1 and node_rank is None:
        node_rank = 0
    source = [item[1] for item in values.values()]

    # Blank is unset, as distcache's settings read it: both name the node alike.
    node_id = environ.get("DISTCACHE_NODE_ID", "")
    if node_id.strip():
        source.append("DISTCACHE_NODE_ID")
    else:
        node_id = hostname if hostname is not None else os.uname().nodename

    single_node = num_nodes == 1 or (local_world is not None and local_world == world)
    addr, port, used = _master(environ, launcher, single_node)
    source.extend(used)
    assert world is not None  # world_size is always filled for every launcher
    return LaunchInfo(
        launcher=launcher,
        rank=get("rank", 0) or 0,
        world_size=world,
        local_rank=get("local_rank", 0 if alone else None),
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        node_id=node_id,
        master_addr=addr,
        master_port=port,
        source=tuple(dict.fromkeys(source)),
    )


#: Prefixes of the MPI launchers' variables a process may inherit from another job.
_MPI_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_", "PMIX_", "MPI_LOCAL")


def check_mpi_place(info: LaunchInfo, rank: int, size: int,
                    environ: Mapping[str, str] | None = None) -> None:
    """Raise unless MPI's ``rank`` and ``size`` are where the launcher's variables
    place this process.

    Raises:
        LaunchError: they differ (mpi4py linked to another MPI than the one that
            started the job runs every rank alone, as rank 0 of 1; so does a process
            no launcher started that inherited another job's MPI variables).
    """
    if (rank, size) == (info.rank, info.world_size):
        return
    why = "mpi4py is probably linked to a different MPI than the mpirun that started this job"
    if size == 1 < info.world_size:
        env = os.environ if environ is None else environ
        stale = sorted({v for v in (*info.source, *env) if v.startswith(_MPI_PREFIXES)
                        and v in env}) or list(info.source)
        why = (f"either {why}, or no launcher started this process and the "
               f"OMPI_*/PMI_*/PMIX_* variables are left from another job (a shell or "
               f"parent process inside an MPI job); if so, unset {' '.join(stale)}")
    raise LaunchError(
        f"the environment says rank {info.rank} of {info.world_size} ({info.launcher}) "
        f"but MPI says rank {rank} of {size}; {why}",
        variable=info.source[0] if info.source else "",
        value=str(info.rank),
    )
