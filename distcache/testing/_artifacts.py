"""Synthetic kernel artifacts laid out like FlashInfer's cubin repository.

Names follow the repository's shape (``<pin>/fmha/trtllm-gen/<Kernel>.cubin``,
``<pin>/batched_gemm-…/<Kernel>.cubin``) so tests exercise nested directories, and
``checksums.txt`` is ``sha256sum`` output, the format FlashInfer publishes.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from distcache.artifact import Artifact, manifest_text

_FAMILIES = (
    ("fmha/trtllm-gen", "fmhaSm100aKernel_QkvE4m3OBfloat16H{h}PagedKv{p}Causal{c}Tile{t}"),
    ("batched_gemm-fe08bc1-9f05022", "BatchedGemmKernel_Bfloat16_E2m1_Fp32_t{t}x{h}x{p}_s{c}"),
    ("gemm-145d1b1-9b1ff8d", "GemmKernel_Fp16_E4m3_Fp32_tile{t}x{h}_cluster{p}x{c}"),
)


def _pin(rng: random.Random) -> str:
    return rng.randbytes(20).hex()


def make_artifacts(
    root: str | Path,
    count: int,
    *,
    min_size: int = 50_000,
    max_size: int = 600_000,
    seed: int = 0,
    prefix: str = "cubins",
) -> list[Artifact]:
    """Write ``count`` deterministic pseudo-random files under ``root`` and
    ``root/checksums.txt`` (names relative to ``root``).

    The same ``seed`` gives the same names and bytes; different seeds give different
    bytes. Every artifact's bytes are distinct.

    Raises:
        ValueError: ``count`` < 0 or the size bounds are inconsistent.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not 1 <= min_size <= max_size:
        raise ValueError(f"need 1 <= min_size <= max_size, got {min_size} and {max_size}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    pins = [_pin(rng) for _ in _FAMILIES]
    artifacts: list[Artifact] = []
    for index in range(count):
        family = index % len(_FAMILIES)
        subdir, pattern = _FAMILIES[family]
        kernel = pattern.format(
            h=rng.choice((64, 128, 256)),
            p=rng.randint(1, 64),
            c=rng.choice((0, 1)),
            t=rng.choice((64, 128)),
        )
        name = f"{pins[family]}/{subdir}/{kernel}_{index:05d}.cubin"
        if prefix:
            name = f"{prefix.strip('/')}/{name}"
        # The index is mixed into the bytes so two files can never share content.
        size = rng.randint(min_size, max_size)
        data = (index.to_bytes(8, "little") + rng.randbytes(max(0, size - 8)))[:size]
        path = root.joinpath(*name.split("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        artifacts.append(Artifact(name, hashlib.sha256(data).hexdigest(), len(data)))
    (root / "checksums.txt").write_text(manifest_text(artifacts), encoding="utf-8")
    return artifacts
