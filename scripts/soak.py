#!/usr/bin/env python3
"""The long fault-injection soak: ``python -m scripts.soak --rounds 500``.

Runs collective prefetches under ``mpirun -n 4`` against a loopback origin while
faults are drawn at random per round (seeded), checks the pool invariants after every
round, prints a table and writes the figures as JSON. The machinery is the CI soak's
(``tests/soak``); see ``tests/support/soak.py`` for what is injected and checked.
Run as root to include the full-disk fault (it mounts a 2 MiB tmpfs).

Run it from the repository root, as a module: the soak machinery is the test
harness's (``tests.support``), which is importable from there and is not part of the
installed library.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

try:
    from tests.support.soak import SoakConfig, run_soak
except ModuleNotFoundError as exc:
    if exc.name != "tests":
        raise
    raise SystemExit("run this from the repository root: python -m scripts.soak ...") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.soak", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=500, help="fault rounds (default 500)")
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed")
    parser.add_argument("--json", type=Path, default=Path("soak.json"), help="figures out")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--artifacts", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=8.0, help="DISTCACHE_TIMEOUT")
    parser.add_argument("--rounds-per-job", type=int, default=25)
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"soak: {args.rounds} fault rounds, seed {seed}", flush=True)

    def log(message: str) -> None:
        if not args.quiet:
            print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    config = SoakConfig(rounds=args.rounds, seed=seed, workdir=args.workdir,
                        artifacts=args.artifacts, timeout=args.timeout,
                        rounds_per_job=args.rounds_per_job, keep=args.keep)
    result = run_soak(config, log=log)
    print(result.table())
    for line in result.violations[:50]:
        print(line)
    args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    print(f"figures written to {args.json}")
    return 0 if result.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
