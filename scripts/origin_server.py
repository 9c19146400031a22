#!/usr/bin/env python3
"""Serve a directory as a loopback artifact origin (the CDN stand-in for tests and demos).

    python scripts/origin_server.py --root DIR [--generate N] [--port-file FILE]

Prints the URL on stdout, writes the port to --port-file (atomically, so a waiting
process never reads half a number) and serves until SIGINT/SIGTERM. Counters are at
GET /_stats; POST /_reset clears them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from distcache.testing import LoopbackOrigin, make_artifacts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="directory to serve")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    parser.add_argument("--port-file", type=Path, help="write the bound port to this file")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to each answer")
    parser.add_argument("--bandwidth", type=float, help="total bytes/second across connections")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="first write N synthetic artifacts and checksums.txt under --root")
    parser.add_argument("--seed", type=int, default=0, help="seed for --generate")
    parser.add_argument("--min-size", type=int, default=50_000, help="smallest generated file")
    parser.add_argument("--max-size", type=int, default=600_000, help="largest generated file")
    args = parser.parse_args(argv)

    if args.generate is not None:
        made = make_artifacts(args.root, args.generate, min_size=args.min_size,
                              max_size=args.max_size, seed=args.seed)
        print(f"generated {len(made)} artifacts under {args.root}", file=sys.stderr)
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a directory")

    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    with LoopbackOrigin(args.root, latency=args.latency, bandwidth=args.bandwidth,
                        host=args.host, port=args.port) as server:
        if args.port_file is not None:
            tmp = args.port_file.with_name(f".{args.port_file.name}.{os.getpid()}")
            tmp.write_text(f"{server.port}\n")
            os.replace(tmp, args.port_file)
        print(server.url, flush=True)
        done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
