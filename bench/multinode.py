"""The pool on two Ray nodes vs one: GRPO with 2 FSDP actor ranks, on the tiny model and on
SmolLM2-135M.

    .venv/bin/python bench/multinode.py [--steps 3] [--models tiny,smollm2] [--out bench/results]
    .venv/bin/python bench/multinode.py --report     # multinode.md again from multinode.json

A cluster of the benchmark's own on this machine: a head (2 CPUs) and a node "second" (2 CPUs,
its own raylet, `hybridrl cluster add-node`'s code), both on 127.0.0.1. For each model:

    one node    ray.placement=pack           both ranks on one node
    two nodes   ray.placement=strict_spread  one rank per node
    reference   trainer.backend=local        one rank in this process

Printed and written: the final weights' largest difference between the placements and to the
one-rank reference (the FSDP tests' tolerance is 1e-6), the median step, update and resharding
(FSDP shards -> full rollout weights) times after a warm-up step; then the collectives FSDP runs
per step, timed alone: gloo all-gather and reduce-scatter of the model's parameters between two
Ray actors on one node and on two nodes. Both "nodes" share this machine's loopback, so the
two-node figures measure the topology (two raylets, ranks in two process trees), not a network.
Writes multinode.{json,md} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # reward_fns: the tiny model's length reward
# A head of the benchmark's own: stopping it never touches the user's pools.
os.environ.setdefault("HYBRIDRL_RAY_STATE", os.path.join(tempfile.gettempdir(), "hrl-bench-mn"))
import hybrid_engine  # noqa: E402, F401  (Ray's environment, set before ray is first imported)

MODELS = {  # preset, overrides (2 ranks: mini-batches divide by 2)
    "tiny": (
        "configs/grpo_tiny.yaml",
        ["reward.function=reward_fns:length_score", "rollout.micro_batch_size=8"],
    ),
    "smollm2": (
        "configs/demo_cpu.yaml",
        [
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=16",
            "actor.ppo_micro_batch_size=4",
            "trainer.val_before_train=false",
        ],
    ),
}
PLACEMENTS = {"one node": "pack", "two nodes": "strict_spread"}


def run(model: str, steps: int, placement: str | None) -> tuple[dict, list[dict], dict]:
    """Train `steps` steps; placement None = the one-rank in-process reference."""
    from hybrid_engine.config import load_config
    from hybrid_engine.engine import Engine
    from hybrid_engine.loop import train

    preset, extra = MODELS[model]
    common = [*extra, f"trainer.total_training_steps={steps}"]
    if placement is None:
        cfg = load_config(ROOT / preset, common)
    else:
        cfg = load_config(
            ROOT / preset,
            [
                *common,
                "trainer.backend=ray",
                "actor.layout.dp=2",
                f"ray.pool_name=mn-{placement}",
                f"ray.placement={placement}",
                "ray.call_timeout_s=600",
            ],
        )
    engine = Engine(cfg)
    nodes = {}
    if placement is not None:
        nodes = {w["name"]: w["node_id"][:8] for w in engine.pool.status()}
    _, hist = train(cfg, engine=engine)
    weights = engine.actor.full_state_dict() if placement else engine.actor.policy.state_dict()
    weights = {k: v.detach().clone() for k, v in weights.items()}
    if placement is not None:
        engine.pool.down(stop_head=False)
    return weights, [h for h in hist if h.get("step", 0) >= 1], nodes


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b if k in a)


def timings(hist: list[dict]) -> dict[str, float]:
    rows = hist[1:] or hist  # after the warm-up step
    return {
        name: statistics.median(h[key] for h in rows)
        for name, key in (
            ("step_s", "timing_s/step"),
            ("update_s", "timing_s/update_actor"),
            ("reshard_s", "timing_s/reshard"),
        )
    }


def probe(numel: int, node_ids: list[str], repeats: int = 5) -> dict[str, float]:
    """Median seconds of one all-gather (each rank gives numel/2, receives numel) and one
    reduce-scatter (numel in, numel/2 out) of fp32 between two actors on `node_ids`."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1)
    class Rank:
        def port(self) -> int:
            import socket

            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            return port

        def time(self, init: str, rank: int, numel: int, repeats: int) -> dict[str, float]:
            import torch
            import torch.distributed as dist

            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
            shard, full = torch.ones(numel // 2), torch.empty(numel // 2 * 2)
            out: dict[str, list[float]] = {"all_gather_s": [], "reduce_scatter_s": []}
            for _ in range(repeats + 1):
                dist.barrier()
                t = time.perf_counter()
                dist.all_gather_into_tensor(full, shard)
                out["all_gather_s"].append(time.perf_counter() - t)
                dist.barrier()
                t = time.perf_counter()
                dist.reduce_scatter_tensor(shard, full)
                out["reduce_scatter_s"].append(time.perf_counter() - t)
            dist.destroy_process_group()
            return {k: statistics.median(v[1:]) for k, v in out.items()}

    ranks = [
        Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote()
        for n in node_ids
    ]
    init = f"tcp://127.0.0.1:{ray.get(ranks[0].port.remote())}"
    got = ray.get([r.time.remote(init, i, numel, repeats) for i, r in enumerate(ranks)])
    for r in ranks:
        ray.kill(r)
    return {k: max(g[k] for g in got) for k in got[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--report", action="store_true", help="rewrite multinode.md from its json")
    args = ap.parse_args()
    if args.report:
        out = Path(args.out)
        (out / "multinode.md").write_text(report(json.loads((out / "multinode.json").read_text())))
        return
    import ray

    from hybrid_engine.config import load_config
    from hybrid_engine.pool import cluster as ray_cluster
    from hybrid_engine.pool.pool import connect

    results: dict[str, Any] = {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "steps": args.steps,
        "models": {},
    }
    ray_cluster.stop_local_head()
    try:
        ray_cluster.local_head(start=True, num_cpus=2)
        ray_cluster.add_local_node("second", 2, {"second": 1})
        connect(load_config(ROOT / "configs/grpo_tiny.yaml", ["trainer.backend=ray"]))
        node_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        for model in args.models.split(","):
            t = time.perf_counter()
            ref, ref_hist, _ = run(model, args.steps, None)
            row: dict[str, Any] = {
                "reference": timings(ref_hist) | {"wall_s": time.perf_counter() - t}
            }
            final = {}
            for name, placement in PLACEMENTS.items():
                t = time.perf_counter()
                final[name], hist, nodes = run(model, args.steps, placement)
                row[name] = timings(hist) | {
                    "wall_s": time.perf_counter() - t,
                    "ranks_on": nodes,
                    "vs_reference_max_diff": max_diff(final[name], ref),
                }
                print(f"[multinode] {model} {name}: {row[name]}", flush=True)
            row["one_vs_two_nodes_max_diff"] = max_diff(final["one node"], final["two nodes"])
            numel = sum(v.numel() for v in ref.values())  # what the probe moves
            row["params"] = numel
            row["collectives"] = {
                "one node": probe(numel, [node_ids[0], node_ids[0]]),
                "two nodes": probe(numel, node_ids[:2]),
            }
            print(
                f"[multinode] {model}: one vs two nodes max diff "
                f"{row['one_vs_two_nodes_max_diff']:.3g}; collectives {row['collectives']}",
                flush=True,
            )
            results["models"][model] = row
            del ref, final
    finally:
        ray.shutdown()
        ray_cluster.stop_local_head()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multinode.json").write_text(json.dumps(results, indent=1))
    (out / "multinode.md").write_text(report(results))
    print(report(results))


def report(r: dict[str, Any]) -> str:
    lines = [
        f"# Pool on two Ray nodes vs one ({r['cpu']}, {r['cores']} cores; {r['steps']} "
        "steps, medians after the first)",
        "",
        "| model | placement | step s | update s | reshard s | max diff vs 1 rank |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model, row in r["models"].items():
        for name in ("reference", *PLACEMENTS):
            t = row[name]
            diff = f"{t['vs_reference_max_diff']:.2g}" if name in PLACEMENTS else "-"
            lines.append(
                f"| {model} | {name} | {t['step_s']:.2f} | {t['update_s']:.2f} | "
                f"{t['reshard_s']:.3f} | {diff} |"
            )
    lines += [
        "",
        "| model | fp32 elements moved (state dict; a tied lm_head twice) | one vs two "
        "nodes max diff | all-gather s (1 node / 2) | reduce-scatter s (1 node / 2) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for model, row in r["models"].items():
        c = row["collectives"]
        lines.append(
            f"| {model} | {row['params']:,} | {row['one_vs_two_nodes_max_diff']:.2g} | "
            f"{c['one node']['all_gather_s']:.4f} / {c['two nodes']['all_gather_s']:.4f} | "
            f"{c['one node']['reduce_scatter_s']:.4f} / "
            f"{c['two nodes']['reduce_scatter_s']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
