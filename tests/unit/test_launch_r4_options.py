"""``python -m launch`` refuses an option given twice with different values, naming
the option and both values; the same value twice is taken."""

from __future__ import annotations

from pathlib import Path

import pytest

import launch.__main__ as wrapper


@pytest.fixture(autouse=True)
def _logging_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() sets up distcache's logging for the process it runs in; in-process here,
    # that set-up would outlive the test.
    monkeypatch.setattr(wrapper, "configure_logging", lambda verbose, rank: lambda: None)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        wrapper.main(argv)
    assert done.value.code == wrapper.EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("option", "first", "second"),
    [("--pool", "pool-a", "pool-b"),
     ("--workspace", "ws-a", "ws-b"),
     ("--prefetch", "a.txt", "b.txt"),
     ("--materialize", "m-a", "m-b")],
)
def test_an_option_given_twice_with_different_values_is_refused(
    option: str, first: str, second: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, second = str(tmp_path / first), str(tmp_path / second)
    line = _usage_error([option, first, f"{option}={second}", "--", "true"], capsys)
    assert not list(tmp_path.iterdir())  # refused before anything was made
    assert option in line and repr(first) in line and repr(second) in line, line
    assert "once" in line, line


def test_an_abbreviated_repeat_is_refused_under_the_full_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    first, second = str(tmp_path / "pool-a"), str(tmp_path / "pool-b")
    line = _usage_error(["--pool", first, "--poo", second, "--", "true"], capsys)
    assert "--pool" in line and repr(first) in line and repr(second) in line, line


def test_the_same_value_twice_is_taken(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It gets past the options: the error that stops it is the missing PROGRAM.
    pool = str(tmp_path / "pool")
    line = _usage_error(["--pool", pool, f"--pool={pool}", "--peers", "--peers", "-v", "-v"],
                        capsys)
    assert "no PROGRAM given" in line, line
