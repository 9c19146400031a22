"""A rank for the run-scope tests: adoptions that share one rendezvous store.

    python -m tests.launchers.scope_prog init MANIFEST CYCLES [LATE_S]
    python -m tests.launchers.scope_prog adopt DELAY_S TIMEOUT_S [crash]

``init``: ``distcache.init(manifests=[MANIFEST])`` (pool and origin from
``DISTCACHE_POOL`` / ``DISTCACHE_ORIGIN``) CYCLES times in this process, closing each,
rank 1 coming LATE_S seconds after the others each time; per cycle it prints ``CYCLE rank size cycle nonce secret-digest objects``.

``adopt``: sleeps DELAY_S, then ``distcache.comm.adopt(timeout=TIMEOUT_S)`` and an
all-gather of ``TORCHELASTIC_RUN_ID``; prints ``MET rank run-id peers' run-ids
seconds nonce`` (the seconds the adoption took), or ``FAILED rank error-type seconds``
when it raised a distcache error. With ``crash`` the process ends without closing
anything, as a worker killed by a restart does.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import distcache
from distcache.comm import adopt
from distcache.errors import DistcacheError


def _init(manifest: str, cycles: int, late: float) -> int:
    for cycle in range(cycles):
        if os.environ["RANK"] == "1":
            time.sleep(late)
        session = distcache.init(manifests=[manifest], integrations=())
        scope = session.comm.scope  # type: ignore[attr-defined]
        assert session.pool is not None
        objects = sum(1 for _ in session.pool.objects())
        # Never print a secret: a digest shows that the ranks agree on it.
        digest = hashlib.sha256(scope.secret).hexdigest()[:12]
        print(f"CYCLE {session.comm.rank} {session.comm.size} {cycle} {scope.nonce} {digest} "
              f"{objects}", flush=True)
        session.close()
    return 0


def _adopt(delay: float, timeout: float, crash: bool) -> int:
    # Imported before the clock starts: on a loaded machine importing torch alone can
    # take seconds, which says nothing about the adoption.
    import torch.distributed  # noqa: F401

    time.sleep(delay)
    rank = os.environ["RANK"]
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    start = time.monotonic()
    try:
        adopted = adopt(timeout=timeout)
        peers = adopted.comm.allgather_object(run, timeout=timeout)
    except DistcacheError as exc:
        print(f"FAILED {rank} {type(exc).__name__} {time.monotonic() - start:.2f} {exc}",
              flush=True)
        return 3
    print(f"MET {rank} {run} {','.join(peers)} {time.monotonic() - start:.2f} "
          f"{adopted.scope.nonce}", flush=True)
    if crash:
        os._exit(0)
    adopted.close()
    return 0


def main() -> int:
    mode, *args = sys.argv[1:]
    if mode == "init":
        return _init(args[0], int(args[1]), float(args[2]) if args[2:] else 0.0)
    return _adopt(float(args[0]), float(args[1]), args[2:] == ["crash"])


if __name__ == "__main__":
    raise SystemExit(main())
