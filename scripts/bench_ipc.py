#!/usr/bin/env python3
"""Per-feature cost of consuming a feature from a shared-memory pool two ways:

* registry: the pool is mapped once (PoolRegistry.exchange); each feature is a
  resolve (checked view) + copy-out + ack;
* per-message: the anti-pattern the registry removes; each feature opens and maps
  the segment, views it, copies out, and unmaps it again.

Writes a table to stdout and bench_ipc.json / bench_ipc.png into --out.

    python scripts/bench_ipc.py --out bench-out [--sizes 4096,262144,4194304] [--iters 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from distcache.comm import ThreadGroup
from distcache.ipc import FeatureRef, PoolRegistry, ShmPool
from distcache.ipc.shm import ShmMapping


def _exchange(pool: ShmPool) -> PoolRegistry:
    """Rank 0 owns ``pool``, rank 1 consumes it; both run as threads of this process."""
    group = ThreadGroup(2, timeout=60)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        out[r] = PoolRegistry.exchange(group.comm(r), [pool] if r == 0 else [])

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    out[0].close()
    registry: PoolRegistry = out[1]
    return registry


def _consume_registry(registry: PoolRegistry, ref: FeatureRef) -> torch.Tensor:
    view = registry.resolve(ref)
    copy = view.clone()
    del view
    registry.ack(ref)
    return copy


def _consume_per_message(pool: ShmPool, ref: FeatureRef) -> torch.Tensor:
    mapping = ShmMapping(pool.descriptor())
    view = (
        mapping.view(ref.offset, ref.nbytes).view(torch.float32).as_strided(ref.shape, ref.strides)
    )
    copy = view.clone()
    del view
    mapping.words.set(ref.slot * (1 + pool.ack_words) + 1, ref.generation)  # the ack
    mapping.close()
    return copy


def _measure(pool: ShmPool, consume: Any, sink: Any, size: int, iters: int) -> list[float]:
    feature = torch.rand(size // 4)
    samples = []
    for _ in range(iters):
        ref = pool.put(feature)
        assert ref is not None, "pool full: acks did not free leases"
        start = time.perf_counter_ns()
        copy = consume(sink, ref)
        samples.append((time.perf_counter_ns() - start) / 1000.0)
        assert copy.numel() == feature.numel()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--sizes", default="4096,262144,4194304", help="feature bytes, comma-separated"
    )
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--pool-mib", type=int, default=64)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    capacity = args.pool_mib << 20

    # Mapped once: the registry path.
    mapped = ShmPool(capacity, name="bench-mapped")
    registry = _exchange(mapped)
    # Mapped per message: its name must stay linked so every message can reopen it.
    reopened = ShmPool(capacity, name="bench-reopened", consumers=[1])
    reopened.bind(owner=0, consumers=[1])

    rows = []
    try:
        for size in sizes:
            once = _measure(mapped, _consume_registry, registry, size, args.iters)
            per = _measure(reopened, _consume_per_message, reopened, size, args.iters)
            rows.append(
                {
                    "feature_bytes": size,
                    "iters": args.iters,
                    "registry_us": statistics.median(once),
                    "per_message_us": statistics.median(per),
                    "speedup": statistics.median(per) / statistics.median(once),
                }
            )
        opens = dict(registry.opens)
    finally:
        registry.close()
        mapped.close()
        reopened.close()

    print(f"{'feature':>10} {'map once (us)':>14} {'open/close per msg (us)':>24} {'x':>6}")
    for row in rows:
        print(
            f"{row['feature_bytes']:>10} {row['registry_us']:>14.1f} "
            f"{row['per_message_us']:>24.1f} {row['speedup']:>6.1f}"
        )
    print(f"registry opens: {opens} (one mapping for {len(sizes) * args.iters} features)")
    result = {"pool_bytes": capacity, "registry_opens": opens, "rows": rows}
    (args.out / "bench_ipc.json").write_text(json.dumps(result, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["registry_us"] for r in rows], 0.4, label="mapped once")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["per_message_us"] for r in rows],
        0.4,
        label="open+close per message",
    )
    ax.set_xticks(list(xs), [f"{r['feature_bytes'] // 1024} KiB" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("median us per feature (resolve + copy-out + ack)")
    ax.set_title(f"host shm pool ({args.pool_mib} MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "bench_ipc.png", dpi=120)
    print(f"wrote {args.out / 'bench_ipc.json'} and {args.out / 'bench_ipc.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
