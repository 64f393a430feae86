"""What a persistent pool saves: cold start vs a second driver's warm re-attach.

    python bench/attach.py [--model tiny] [--drivers 3]

Cold: start the local Ray head and create the pool (processes, imports, model load).
Warm: a new driver process connects to the running head and re-attaches to the named
workers (their weights stay in memory); printed per driver, split into connect and attach.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# A head of the benchmark's own: stopping it never touches the user's pools.
os.environ.setdefault("HYBRIDRL_RAY_STATE", os.path.join(tempfile.gettempdir(), "hrl-bench-ray"))

from hybrid_engine.config import load_config  # noqa: E402
from hybrid_engine.pool.pool import Pool, connect, stop_local_head  # noqa: E402

DRIVER = """
import json, time
t0 = time.perf_counter()
from hybrid_engine.config import load_config
from hybrid_engine.pool.pool import Pool, connect
cfg = load_config("configs/grpo_tiny.yaml", {overrides!r})
t1 = time.perf_counter()
connect(cfg)
t2 = time.perf_counter()
pool = Pool.up(cfg)
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "connect_s": t2 - t1, "attach_s": t3 - t2,
                  "created": pool.created, "version": pool.status()[0]["weights_version"]}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--drivers", type=int, default=3)
    args = ap.parse_args()
    overrides = [f"model.path={args.model}", "trainer.backend=ray", "ray.pool_name=bench-attach"]
    cfg = load_config("configs/grpo_tiny.yaml", overrides)
    stop_local_head()
    try:
        t0 = time.perf_counter()
        connect(cfg)
        t1 = time.perf_counter()
        Pool.up(cfg)
        t2 = time.perf_counter()
        print(f"cold: head start {t1 - t0:.1f} s, pool create {t2 - t1:.1f} s ({args.model})")
        for i in range(args.drivers):
            out = subprocess.run(
                [sys.executable, "-c", DRIVER.format(overrides=overrides)],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"warm driver {i + 1}: connect {r['connect_s']:.2f} s, re-attach "
                f"{r['attach_s']:.2f} s (created={r['created']}), imports {r['import_s']:.1f} s"
            )
    finally:
        stop_local_head()


if __name__ == "__main__":
    main()
