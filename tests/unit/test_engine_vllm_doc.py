"""The engine check's committed figures: the JSON records the check of its runs, and the
check rewrites the engines page's figures block (which ``test_readme_figures.py``
checks against ``docs/bench/engine_vllm.json``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from scripts import engine_vllm

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "docs" / "bench" / "engine_vllm.json"


def result() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RESULT.read_text())
    return data


def test_the_check_rewrites_the_figures_block_of_the_engines_page() -> None:
    # That the block is the committed JSON rendered is test_readme_figures.py's check;
    # this one, that the engine check's own rewrite after a run targets that block.
    text = (REPO / "docs" / "engines.md").read_text()
    block = re.search(r"<!-- figures:engine_vllm -->\n(.*?)<!-- /figures:engine_vllm -->",
                      text, re.DOTALL)
    assert block is not None and engine_vllm.doc_table(text) == block.group(1)


def test_the_committed_run_records_the_checks_of_its_runs() -> None:
    data = result()
    checks = data["checks"]
    # The verdicts are the check's rule applied to the committed runs: the fresh node's
    # target on the time from the command, whichever way it went.
    runs = {run["run"]: run for run in data["runs"]}
    assert checks == engine_vllm.check(runs, checks["origin_requests"])
    assert checks["fresh_over_local_warm_judged_on"] == "wall_s"
    assert checks["fresh_within_1_3x"] == (checks["fresh_over_local_warm"] <= 1.3)
    assert [r["run"] for r in data["runs"]] == ["tp2-off", "tp2", "cold", "warm-local",
                                                "warm-fresh"]
    assert set(checks["tp2_roles"]) >= {"main", "EngineCore", "VllmWorker-0", "VllmWorker-1"}
    assert checks["tp2_event_in_every_process"] and checks["tp2_off_no_events"]
    assert checks["tp2_same_tokens_with_and_without"]
    assert checks["fresh_materialised_files"] > 0 and checks["cold_published_files"] > 0
    assert checks["origin_requests"] == 0 and checks["jit_errors"] == 0
    assert data["venv"]["startup_hook"] and data["venv"]["entry_point"] == (
        "distcache.integrations.vllm:register")


def test_the_check_reads_vllms_init_engine_line() -> None:
    cpu = ("(EngineCore pid=1) INFO 12-02 05:05:07 [core.py:402] init engine (profile, "
           "create kv cache, warmup model) took 33.60 s")
    gpu = cpu.replace("33.60 s", "41.20 s (compilation: 27.05 s)")
    first, second = engine_vllm.INIT_ENGINE.search(cpu), engine_vllm.INIT_ENGINE.search(gpu)
    assert first is not None and first.group(1) == "33.60" and first.group(2) is None
    assert second is not None and second.groups() == ("41.20", "27.05")


def test_the_check_fails_on_a_slow_fresh_node_or_missing_worker() -> None:
    runs: dict[str, dict[str, Any]] = {}
    for name in ("tp2-off", "tp2", "cold", "warm-local", "warm-fresh"):
        runs[name] = {"tokens": [[1, 2]], "processes": [], "hook_events": 0,
                      "init_engine_s": 10.0, "wall_s": 40.0, "jit_written_files": 3,
                      "jit_published_files": 3, "jit_errors": []}
    runs["tp2"]["processes"] = [["main", "x"], ["EngineCore", "x"], ["VllmWorker-0", "x"]]
    # The target is judged on the time from the command: an "init engine" as fast as
    # the local warm run's does not make up for the rest of the command.
    runs["warm-fresh"]["wall_s"] = 54.0
    checks = engine_vllm.check(runs, requests=0)
    assert checks["tp2_event_in_every_process"] is False
    assert checks["fresh_over_local_warm_init_engine"] == 1.0
    assert checks["fresh_over_local_warm"] == 1.35 and checks["fresh_within_1_3x"] is False
    runs["tp2"]["processes"].append(["VllmWorker-1", "x"])
    runs["warm-fresh"]["wall_s"] = 48.0
    checks = engine_vllm.check(runs, requests=0)
    assert checks["tp2_event_in_every_process"] and checks["fresh_within_1_3x"]
