"""What ``doctor`` says of a pool path that cannot be a pool, and ``pool gc`` given an
empty cap: neither is taken for the ordinary case."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import cli_env, run_cli


@pytest.mark.parametrize(("make", "said"), [
    (lambda p: p.write_text("x"), "NOT USABLE: not a directory"),
    (lambda p: p.symlink_to(p.parent / "missing"), "NOT USABLE: not a directory"),
    (lambda p: p.mkdir(), "not created yet; the directory exists"),
    (lambda p: None, "not created yet"),
], ids=["file", "dangling-link", "empty-dir", "absent"])
def test_doctor_says_what_is_at_the_pool_path(tmp_path: Path, make: Callable[[Path], object],
                                              said: str) -> None:
    path = tmp_path / "pool"
    make(path)
    done = run_cli(cli_env(tmp_path), "--pool", str(path), "doctor")
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("pool:"))
    assert line.endswith(f"{path} ({said})"), line


def test_gc_takes_an_empty_cap_for_a_bad_size(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    pool = tmp_path / "pool"
    (pool / "objects").mkdir(parents=True)
    done = run_cli(env, "--pool", str(pool), "pool", "gc", "--max-bytes", "")
    assert done.returncode == 2, done.stdout
    assert "--max-bytes='' is not a size" in done.stderr


@pytest.mark.parametrize(("rank", "printed"), [(0, True), (1, False)])
def test_a_bad_option_value_every_rank_raised_is_printed_by_rank_0(
        rank: int, printed: bool, capsys: pytest.CaptureFixture[str]) -> None:
    from distcache.cli import _main
    from distcache.errors import ConfigError

    parser = _main.build_parser()
    args = parser.parse_args(["pool", "ls"])
    error = ConfigError("--arch: bad GPU architecture 'hopper'", variable="--arch",
                        value="hopper")
    error.agreed = True  # every rank of the collective command raised it alike

    def run(_: object) -> int:
        raise error

    args.run, args.rank = run, rank
    assert _main._run(parser, args) == 2
    err = capsys.readouterr().err
    assert ("bad GPU architecture 'hopper'" in err) is printed
    assert err.startswith("usage: distcache pool") is printed
