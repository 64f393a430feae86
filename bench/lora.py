"""LoRA against full fine-tuning on the same batch: peak RSS, step time, checkpoint size,
optimizer state and what an asynchronous run publishes to its rollout replicas per weights
version, each variant in a process of its own (the demo preset, SmolLM2-135M).

.venv/bin/python bench/lora.py [--steps 4] [overrides...]

Both variants keep a reference policy (actor.use_kl_loss=true): full fine-tuning holds a
frozen copy of the weights for it, LoRA switches its adapters off instead.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "full fine-tuning": ["actor.use_kl_loss=true"],
    "LoRA r=16": [
        "actor.use_kl_loss=true",
        "actor.lora.rank=16",
        "actor.lora.alpha=32",
        "actor.optim.lr=1e-4",
    ],
}


def one(steps: int, overrides: list[str]) -> dict:
    from safetensors.torch import load_file

    from hybrid_engine.config import load_config
    from hybrid_engine.engine import Engine
    from hybrid_engine.step_metrics import peak_rss_gb

    engine = Engine(load_config("configs/demo_cpu.yaml", overrides))
    times = [engine.step(s)["timing_s/step"] for s in range(1, steps + 1)]
    with tempfile.TemporaryDirectory() as d:
        engine.actor.save(d)
        sizes = {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)}
        optim_numel = sum(
            t.numel() for t in load_file(os.path.join(d, "optim.safetensors")).values()
        )
    info = engine.actor.info()
    peak = peak_rss_gb()  # before the publish round trips below hold a second copy
    published, publish_s = publish_round_trip(engine.actor)
    return {
        "median_step_s": statistics.median(times[1:] or times),
        "step_s": times,
        "peak_rss_gb": peak,
        "published_mb": published / 2**20,
        "publish_s": publish_s,
        "checkpoint_mb": sum(sizes.values()) / 2**20,
        "weights_file_mb": sizes["model.safetensors"] / 2**20,
        "optimizer_state_mb": sizes["optim.safetensors"] / 2**20,
        "optimizer_state_numbers": optim_numel,
        "trainable_params": info["trainable_params"],
        "params": info["local_params"],
        "reference_copy": engine.actor.ref is not None,
    }


def publish_round_trip(actor) -> tuple[int, float]:
    """Bytes of what `publish` sends a replica per version (`replica_state_dict`), and the
    median seconds to gather and serialise it, then deserialise and load it in place (what
    Ray's object store and `RolloutReplica.receive` do, here in one process; tensors only,
    read back with `weights_only=True`)."""
    import torch

    times = []
    for _ in range(3):
        start = time.perf_counter()
        blob = io.BytesIO()
        torch.save(actor.replica_state_dict(), blob)
        blob.seek(0)
        actor.policy.load_state_dict(torch.load(blob, weights_only=True), strict=False)
        times.append(time.perf_counter() - start)
    return blob.getbuffer().nbytes, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="bench/results/lora.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.one:
        Path(args.out).write_text(json.dumps(one(args.steps, json.loads(args.one))))
        return
    results = {}
    for name, overrides in VARIANTS.items():
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            cmd = [
                sys.executable,
                __file__,
                "--steps",
                str(args.steps),
                "--out",
                tmp.name,
                "--one",
                json.dumps([*overrides, *args.overrides]),
            ]
            subprocess.run(cmd, check=True)
            results[name] = json.loads(Path(tmp.name).read_text())
        print(name, json.dumps(results[name]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    keys = [
        "trainable_params",
        "median_step_s",
        "peak_rss_gb",
        "checkpoint_mb",
        "weights_file_mb",
        "optimizer_state_mb",
        "published_mb",
        "publish_s",
        "reference_copy",
    ]
    print("\n| | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    for k in keys:
        cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for r in results.values()]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
