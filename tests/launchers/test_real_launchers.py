"""One program, three real launchers: gloo comes up through launch.init_process_group()."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from tests.launchers.procs import (
    LAUNCH,
    MPIRUN_4,
    PROGRAM,
    PY,
    SRUN_4,
    TORCHRUN_4,
    Result,
    base_env,
    run_group,
)

EXPECTED_SUM = 1 + 2 + 3 + 4


def assert_four_ranks(
    output_rows: list[tuple[str, int, int, int]], launcher: str, log: str
) -> None:
    assert output_rows == [(launcher, r, 4, EXPECTED_SUM) for r in range(4)], log


def test_mpirun_four_ranks_all_reduce() -> None:
    done = run_group([*MPIRUN_4, PY, str(PROGRAM)], base_env())
    assert done.returncode == 0, done.output
    assert_four_ranks(done.results(), "openmpi", done.output)


def test_torchrun_four_ranks_all_reduce() -> None:
    done = run_group([*TORCHRUN_4, str(PROGRAM)], base_env())
    assert done.returncode == 0, done.output
    assert_four_ranks(done.results(), "torchrun", done.output)


def test_srun_four_ranks_all_reduce(slurm_env: dict[str, str]) -> None:
    done = run_group([*SRUN_4, PY, str(PROGRAM)], slurm_env)
    assert done.returncode == 0, done.output
    assert_four_ranks(done.results(), "slurm", done.output)


UNMODIFIED = textwrap.dedent(
    """
    import os, torch, torch.distributed as d
    d.init_process_group("gloo")
    t = torch.tensor([float(d.get_rank() + 1)])
    d.all_reduce(t)
    print("RESULT", "env", d.get_rank(), d.get_world_size(), int(t.item()), flush=True)
    print("SLOT", d.get_rank(), os.environ["DISTCACHE_WORKSPACE"], os.environ["DISTCACHE_POOL"],
          os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], flush=True)
    d.destroy_process_group()
    """
)


def _launch_unmodified(launcher: Sequence[str], env: dict[str, str], tmp_path: Path) -> Result:
    """``UNMODIFIED`` on four ranks of ``launcher`` through ``python -m launch``, with a
    workspace and a pool under ``tmp_path``; asserts it succeeded on every rank."""
    done = run_group(
        [
            *launcher,
            *LAUNCH,
            "--workspace",
            str(tmp_path / "ws"),
            "--pool",
            str(tmp_path / "pool"),
            "--",
            PY,
            "-c",
            UNMODIFIED,
        ],
        env,
    )
    assert done.returncode == 0, done.output
    assert_four_ranks(done.results(), "env", done.output)
    return done


def test_launch_module_runs_an_unmodified_torch_program_under_mpirun(tmp_path: Path) -> None:
    done = _launch_unmodified(MPIRUN_4, base_env(), tmp_path)
    slots = sorted(line.split()[1:] for line in done.output.splitlines() if line.startswith("SLOT"))
    assert [s[1] for s in slots] == [str(tmp_path / "ws" / f"rank-{r}") for r in range(4)]
    assert {s[2] for s in slots} == {str(tmp_path / "pool")}
    # Open MPI may number local ranks in another order than world ranks.
    assert sorted(s[3] for s in slots) == ["0", "1", "2", "3"]
    assert {s[4] for s in slots} == {"4"}


def test_launch_module_propagates_a_failing_rank_under_mpirun() -> None:
    failing = "import os, sys; sys.exit(7 if os.environ['RANK'] == '2' else 0)"
    done = run_group([*MPIRUN_4, *LAUNCH, "--", PY, "-c", failing], base_env())
    assert done.returncode != 0, done.output


def test_launch_module_runs_an_unmodified_torch_program_under_srun(
    slurm_env: dict[str, str], tmp_path: Path
) -> None:
    _launch_unmodified(SRUN_4, slurm_env, tmp_path)
