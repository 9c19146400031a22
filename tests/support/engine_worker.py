"""A stand-in for an engine's process that never calls distcache.

``python engine_worker.py vllm|plain CHECKSUMS [UNKNOWN_NAME UNKNOWN_SHA]``: with
``vllm``, first call the ``vllm.general_plugins`` entry points the way vLLM's
``load_general_plugins`` does (``VLLM_PLUGINS`` filters by name); then ask FlashInfer's
real ``get_artifact`` for every artifact of CHECKSUMS, and for the unknown one if
given. Prints one JSON line: whether every answer matched its sha256, the loader's
type, its statistics when it has any, and the unknown artifact's error.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from importlib.metadata import entry_points
from typing import Any


def load_general_plugins() -> list[str]:
    allowed = os.environ.get("VLLM_PLUGINS")
    names = None if allowed is None else [n.strip() for n in allowed.split(",") if n.strip()]
    loaded = []
    for plugin in entry_points(group="vllm.general_plugins"):
        if names is None or plugin.name in names:
            plugin.load()()
            loaded.append(plugin.name)
    return loaded


def lookups(checksums: str, unknown: list[str]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import flashinfer.jit.cubin_loader as loader_module
    matched = []
    with open(checksums, encoding="utf-8") as lines:
        for line in lines:
            sha, name = line.split(maxsplit=1)
            data = loader_module.get_artifact(name.strip(), sha)
            matched.append(hashlib.sha256(data).hexdigest() == sha)
    error = None
    if unknown:
        try:
            answer = loader_module.get_artifact(unknown[0], unknown[1])
            error = f"answered {len(answer)} bytes"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    get_artifact = loader_module.get_artifact
    stats = getattr(get_artifact, "stats", None)
    return {
        "all_matched": bool(matched) and all(matched),
        "count": len(matched),
        "loader": type(get_artifact).__name__,
        "stats": {k: v for k, v in vars(stats).items() if k != "failures"} if stats else None,
        "cubin_dir": str(loader_module.FLASHINFER_CUBIN_DIR),
        "unknown_error": error,
    }


def main() -> None:
    mode, checksums, *unknown = sys.argv[1:]
    plugins = load_general_plugins() if mode == "vllm" else []
    result = lookups(checksums, unknown)
    result["plugins"] = plugins
    result["rank"] = os.environ.get("OMPI_COMM_WORLD_RANK")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
