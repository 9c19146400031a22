"""One rank of the JIT cache launches: ``init(jit_caches=["inductor"])``, a tiny model
under ``torch.compile`` on CPU, Inductor's own cache counters, and (``--sync``)
``session.sync()`` after the first call. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import time

import distcache
from distcache.jit import Family


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    session = distcache.init(integrations=(), jit_caches=["inductor"])
    init_s = time.perf_counter() - started
    import torch
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = torch.compile(model)
    begin = time.perf_counter()
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    first_call_s = time.perf_counter() - begin
    published = None
    if args.sync:
        session.sync()
        published = [i.report.published for i in session.integrations
                     if isinstance(i, Family)]
    filled = [i.report.placed.written for i in session.integrations
              if isinstance(i, Family)]
    print(json.dumps({
        "rank": session.comm.rank, "node": session.comm.node_id,
        "hit": counters["inductor"]["fxgraph_cache_hit"],
        "miss": counters["inductor"]["fxgraph_cache_miss"],
        "filled": filled, "published": published, "init_s": init_s,
        "first_call_s": first_call_s, "cache_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"],
    }), flush=True)
    session.close()


if __name__ == "__main__":
    main()
