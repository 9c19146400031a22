"""The demo job (the README's first command) runs end to end and its checks hold."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.launchers.procs import REPO, base_env, run_group


def test_demo_job_reports_k_downloads_then_none_and_one_open_per_pool(tmp_path: Path) -> None:
    done = run_group(
        [sys.executable, str(REPO / "scripts" / "demo.py"), "--artifacts", "12",
         "--features", "8", "--work", str(tmp_path / "demo")],
        base_env(PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}"),
        timeout=300,
    )
    assert done.returncode == 0, done.output
    assert done.output.count("[ok]") == 4, done.output
    assert "[ok] run 1: 12 downloads for 4 ranks" in done.output
    assert "[ok] run 2: 0 downloads (warm pools)" in done.output
    assert "tensors still view" not in done.output
