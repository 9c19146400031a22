"""What each launcher's variables say, one reader per launcher.

Each reader returns ``None`` when its launcher's marker variable is absent, else a
:class:`Signal`: field -> (value, the variable it came from). Readers only parse; the
agreement rules between launchers live in :mod:`launch._detect`.

1. ``torchrun`` -- the ``env://`` variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
   ``LOCAL_WORLD_SIZE``/``GROUP_RANK``/``GROUP_WORLD_SIZE``, set by torchrun,
   torchelastic or ``python -m launch``. Without ``GROUP_WORLD_SIZE`` the node count is
   ``WORLD_SIZE / LOCAL_WORLD_SIZE`` only where ``TORCHELASTIC_RUN_ID`` says torchrun's
   agent started the process (the same number of workers on every node).
2. ``openmpi`` -- ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``.
3. ``mpich`` -- MPICH/Hydra and Intel MPI: ``PMI_RANK`` (old Hydra: ``PMI_ID``),
   ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
4. ``pmix`` -- ``PMIX_RANK``; PMIx has no standard size variable, so the size comes
   from another source that is present (``srun --mpi=pmix`` sets Slurm's, which
   :mod:`launch._detect` counts only under Slurm's own ``PMIX_NAMESPACE``).
5. ``slurm`` -- an ``srun`` step: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,
   ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_NUM_NODES``,
   ``SLURM_STEP_TASKS_PER_NODE``. Only step-scoped variables count: an ``sbatch``
   script has job-level ``SLURM_*`` variables but no step, and is a single process
   (lightseekorg/tokenspeed PR #873).

:func:`run_id` reads which job and restart attempt this is (``TORCHELASTIC_RUN_ID`` and
``TORCHELASTIC_RESTART_COUNT``, Open MPI's ``OMPI_MCA_ess_base_jobid`` or PMIx's
``PMIX_NAMESPACE``, Slurm's ``SLURM_JOB_ID``, ``SLURM_STEP_ID`` and
``SLURM_RESTART_COUNT``), which scopes every key distcache writes to a shared store.

``OMPI_COMM_WORLD_NODE_RANK`` is not used: it is the process's rank on its node across
all jobs, not the node's index (docs.open-mpi.org, "environment variables").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

from distcache._log import get_logger
from distcache.errors import LaunchError
from launch._nodelist import expand_counts

log = get_logger(__name__)

T = TypeVar("T")

FIELDS = ("rank", "world_size", "local_rank", "local_world_size", "node_rank", "num_nodes")
"""Fields a launcher can report, in the order they are checked and reported."""

_COUNTS = frozenset({"world_size", "local_world_size", "num_nodes"})

_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)
#: The largest integer a launcher variable may hold (a signed 64-bit one).
MAX_INT = (1 << 63) - 1
#: The largest restart count: what the run scope's answer carries (9 digits).
MAX_ATTEMPT = 999_999_999


class Signal(NamedTuple):
    """What one launcher's variables say: field -> (value, variable)."""

    launcher: str
    values: dict[str, tuple[int, str]]

    def get(self, name: str) -> int | None:
        item = self.values.get(name)
        return None if item is None else item[0]


def read_int(env: Mapping[str, str], name: str, *, minimum: int = 0,
             maximum: int = MAX_INT) -> int | None:
    """``env[name]`` as an integer from ``minimum`` to ``maximum``; ``None`` when unset.

    Raises:
        LaunchError: the value is not an integer in ASCII digits or is out of range.
    """
    raw = env.get(name)
    if raw is None:
        return None
    # ASCII digits only: int() would also take "1_0" and other scripts' digits.
    text = raw.strip()
    if _INTEGER.fullmatch(text) is None:
        raise LaunchError(
            f"{name}={raw!r} is not an integer; the launcher environment is malformed",
            variable=name,
            value=raw,
        )
    # Past 18 digits no launcher's figure is meant (and past 4300 int() refuses).
    value = int(text) if len(text.lstrip("+-0")) <= 18 else None
    if value is None or not minimum <= value <= maximum:
        raise LaunchError(
            f"{name}={raw[:40]!r}{'...' * (len(raw) > 40)} must be from {minimum} to "
            f"{maximum}", variable=name, value=raw[:40])
    return value


def parsed(parse: Callable[[str], list[T]], variable: str, text: str) -> list[T]:
    """``parse(text)``, with a failure naming ``variable``.

    Raises:
        LaunchError: ``parse`` rejected the text.
    """
    try:
        return parse(text)
    except LaunchError as exc:
        raise LaunchError(f"{variable}: {exc}", variable=variable, value=text) from exc


def _read(env: Mapping[str, str], launcher: str, names: Mapping[str, tuple[str, ...]]) -> Signal:
    values: dict[str, tuple[int, str]] = {}
    for fld, candidates in names.items():
        for var in candidates:
            value = read_int(env, var, minimum=1 if fld in _COUNTS else 0)
            if value is not None:
                values[fld] = (value, var)
                break
    return Signal(launcher, values)


def torchrun(env: Mapping[str, str]) -> Signal | None:
    """torchrun's ``env://`` variables, or ``None`` without ``RANK``."""
    # RANK is the marker: a lone LOCAL_RANK is exported by many wrappers for device
    # selection and says nothing about the job.
    if "RANK" not in env:
        return None
    sig = _read(
        env,
        "torchrun",
        {
            "rank": ("RANK",),
            "world_size": ("WORLD_SIZE",),
            "local_rank": ("LOCAL_RANK",),
            "local_world_size": ("LOCAL_WORLD_SIZE",),
            "node_rank": ("GROUP_RANK",),
            "num_nodes": ("GROUP_WORLD_SIZE",),
        },
    )
    world, local = sig.get("world_size"), sig.get("local_world_size")
    elastic = "TORCHELASTIC_RUN_ID" in env
    if elastic and "num_nodes" not in sig.values and world and local and world % local == 0:
        # torchrun runs the same number of workers on every node. Other launchers that
        # export these variables (``python -m launch`` under srun or mpirun) need not.
        sig.values["num_nodes"] = (world // local, "WORLD_SIZE/LOCAL_WORLD_SIZE")
    return sig


def openmpi(env: Mapping[str, str]) -> Signal | None:
    """Open MPI's ``OMPI_COMM_WORLD_*`` variables, or ``None``."""
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    return _read(
        env,
        "openmpi",
        {
            "rank": ("OMPI_COMM_WORLD_RANK",),
            "world_size": ("OMPI_COMM_WORLD_SIZE",),
            "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
            "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        },
    )


def mpich(env: Mapping[str, str]) -> Signal | None:
    """MPICH/Hydra and Intel MPI's ``PMI_*`` variables, or ``None``."""
    if "PMI_RANK" not in env and "PMI_ID" not in env:
        return None
    return _read(
        env,
        "mpich",
        {
            "rank": ("PMI_RANK", "PMI_ID"),
            "world_size": ("PMI_SIZE",),
            "local_rank": ("MPI_LOCALRANKID",),
            "local_world_size": ("MPI_LOCALNRANKS",),
        },
    )


def pmix(env: Mapping[str, str]) -> Signal | None:
    """PMIx's ``PMIX_RANK`` (and a non-standard ``PMIX_SIZE``), or ``None``."""
    if "PMIX_RANK" not in env:
        return None
    return _read(env, "pmix", {"rank": ("PMIX_RANK",), "world_size": ("PMIX_SIZE",)})


def slurm(env: Mapping[str, str]) -> Signal | None:
    """An ``srun`` step's ``SLURM_*`` variables, or ``None`` outside a step.

    Raises:
        LaunchError: a variable is malformed, ``SLURM_NODEID`` is past the nodes
            ``SLURM_STEP_TASKS_PER_NODE`` names, or that gives a node no tasks.
    """
    # srun sets the SLURM_STEP_* variables; an sbatch script has only job-level ones.
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return None
    sig = _read(
        env,
        "slurm",
        {
            "rank": ("SLURM_PROCID",),
            "world_size": ("SLURM_STEP_NUM_TASKS",),
            "local_rank": ("SLURM_LOCALID",),
            "node_rank": ("SLURM_NODEID",),
            "num_nodes": ("SLURM_STEP_NUM_NODES",),
        },
    )
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE")
    node = sig.get("node_rank")
    if per_node is not None and node is not None:
        counts = parsed(expand_counts, "SLURM_STEP_TASKS_PER_NODE", per_node)
        if node >= len(counts):
            raise LaunchError(
                f"SLURM_NODEID={node} but SLURM_STEP_TASKS_PER_NODE={per_node!r} "
                f"names only {len(counts)} nodes",
                variable="SLURM_STEP_TASKS_PER_NODE",
                value=per_node,
            )
        if min(counts) < 1:
            raise LaunchError(
                f"SLURM_STEP_TASKS_PER_NODE={per_node!r} gives a node no tasks",
                variable="SLURM_STEP_TASKS_PER_NODE",
                value=per_node,
            )
        sig.values["local_world_size"] = (counts[node], "SLURM_STEP_TASKS_PER_NODE")
    return sig


INNER = (torchrun, openmpi, mpich, pmix)
"""The readers of launchers that start ranks directly, innermost first."""

#: Each launcher's size variable and the rank variables it comes with.
_SIZES = (("WORLD_SIZE", ("RANK",)), ("OMPI_COMM_WORLD_SIZE", ("OMPI_COMM_WORLD_RANK",)),
          ("PMI_SIZE", ("PMI_RANK", "PMI_ID")), ("SLURM_STEP_NUM_TASKS", ("SLURM_PROCID",)))
_NOTED: set[str] = set()


def check_half_set(env: Mapping[str, str]) -> None:
    """Where no launcher's rank variable is present: refuse what only a launcher whose
    variables came half through sets (a size above 1; ``SLURM_PROCID`` above 0 outside
    a step), which would otherwise run this process alone as rank 0 of 1.

    ``SLURM_PROCID=0`` without a step is ``sbatch``'s script, one process: logged once.

    Raises:
        LaunchError: a size above 1 without its rank, or ``SLURM_PROCID`` above 0
            without ``SLURM_STEP_NUM_TASKS``.
    """
    for size_var, ranks in _SIZES:
        size = read_int(env, size_var, minimum=1)
        if size is not None and size > 1:
            raise LaunchError(
                f"{size_var}={size} is set but {' or '.join(ranks)} is not: no rank for "
                f"this process in a job of {size}, which would run alone as rank 0 of 1 "
                f"(a launcher's variables came half through, or {size_var} is left from "
                f"another job); set {ranks[0]} for each rank, or unset {size_var} to run "
                "one process", variable=size_var, value=env[size_var])
    procid = read_int(env, "SLURM_PROCID")
    if procid:
        raise LaunchError(
            f"SLURM_PROCID={procid} is set but SLURM_STEP_NUM_TASKS is not: not a task of "
            "an srun step (sbatch's script is SLURM_PROCID=0), so this rank cannot be "
            "placed; start it with srun, or unset SLURM_PROCID to run one process",
            variable="SLURM_PROCID", value=env["SLURM_PROCID"])
    if procid == 0:
        note = ("SLURM_PROCID=0 without SLURM_STEP_NUM_TASKS: sbatch's script, not an srun "
                f"step; running as one process (job {env.get('SLURM_JOB_ID', '?')}, "
                f"SLURM_NTASKS={env.get('SLURM_NTASKS', 'unset')}); start the ranks with srun")
        if note not in _NOTED:
            _NOTED.add(note)
            log.info("%s", note)


#: Variables that name a job, innermost launcher first, and the variable that counts
#: its restarts. Only the innermost present one counts: an outer launcher's variables
#: under torchrun describe the agent, and may differ between nodes of one run.
_JOB_VARIABLES = (
    ("torchrun", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
    ("openmpi", "OMPI_MCA_ess_base_jobid", None),  # Open MPI 4
    ("pmix", "PMIX_NAMESPACE", None),  # Open MPI 5 (PRRTE), srun --mpi=pmix
    ("slurm", "SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
)


def run_id(env: Mapping[str, str]) -> tuple[str, int, tuple[str, ...]]:
    """``(job, attempt, variables)``: the launcher's name for this job (every rank of a
    run reads the same; ``""`` when no launcher names one), the restart attempt (``0``
    unless the launcher counts restarts) and the variables both came from.

    Raises:
        LaunchError: a restart count is not an integer >= 0.
    """
    for launcher, job_var, attempt_var in _JOB_VARIABLES:
        job = env.get(job_var)
        if not job:
            continue
        used = [job_var]
        if launcher == "slurm":
            # Every srun step is a run of its own, with its own ranks.
            job = f"{job}.{env.get('SLURM_STEP_ID', '0')}"
            used += ["SLURM_STEP_ID"] if "SLURM_STEP_ID" in env else []
        attempt = (0 if attempt_var is None
                   else read_int(env, attempt_var, maximum=MAX_ATTEMPT))
        if attempt_var is not None and attempt is not None:
            used.append(attempt_var)
        return f"{launcher}:{job}", attempt or 0, tuple(used)
    return "", 0, ()
