"""hybridrl vs TRL's GRPOTrainer: the same GRPO work, side by side, in one invocation.

    .venv/bin/pip install -e '.[bench]'          # TRL 1.16 (accepts torch 2.13)
    .venv/bin/python bench/vs_trl.py [--steps 3] [--rounds 2] [--threads 2] [--out bench/results]

The work (both systems): SmolLM2-135M-Instruct in fp32; the demo's task (reasoning-gym
basic_arithmetic, 2 terms, 1-2 digits, `+ -`, the short-answer system prompt); per step 8
prompts x 4 samples, 32 new tokens at temperature 1.0 (no top-k / top-p); one AdamW update
per step over the 32 samples; lr 1e-5 constant, grad clip 1.0; no KL (TRL `beta=0`, hybridrl
no reference); the same prompts in the same order; the same torch thread count. TRL:
`per_device_train_batch_size=32`, `steps_per_generation=1`, `num_generations=4`,
`num_iterations=1` (one generation batch = one optimizer step), `gradient_checkpointing=False`,
`loss_type="dapo"` (token-mean, like hybridrl's default), `scale_rewards="group"`, and what
`bench/trl_setup.py` forces for every comparison (fp32, the prompts in hybridrl's order,
hybridrl's scorer as the reward). hybridrl: `hybridrl train`'s flow (Prefect, local storage), roles
in-process (`--backend local`, the default) or on the Ray pool (`--backend ray`), without the
demo's overlong penalty (TRL has none) and without tracking.

Each system runs in its own process, alternately (A B A B ...), a warm-up step first and then
`--steps` measured steps; its peak memory is the peak of the summed RSS of every process
involved (sampled every 0.25 s: the child and its descendants, e.g. Prefect's server, plus the
local Ray head's processes for `--backend ray`). Also measured in the same invocation: plain
`model.generate` at the same batch (32 sequences) and an fp32 matmul probe (GFLOP/s), so that
training can be stated as a fraction of this machine's peak: train FLOPs = 6 x parameters x
(prompt + response tokens, padding excluded) for the work done, and with each prompt counted
once per group for what hybridrl computes (it packs shared prompts); training seconds = step -
generation (so they include reward, advantage and orchestration).
Writes `vs_trl.json`, `vs_trl.md` and `vs_trl.png` (step time by stage) to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # hybrid_engine, flows (also when not installed)
from report import write_report  # noqa: E402 - beside this file
from vs_trl_report import plot, table  # noqa: E402 - beside this file

PROMPTS, SAMPLES, NEW_TOKENS, LR = 8, 4, 32, 1e-5
OURS = [
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "tracking.enabled=false",
    "reward.overlong_buffer_len=0",
    f"actor.optim.lr={LR}",
    "actor.optim.warmup_steps=0",
    f"data.train_batch_size={PROMPTS}",
    f"rollout.n={SAMPLES}",
    f"rollout.max_new_tokens={NEW_TOKENS}",
    "rollout.temperature=1.0",
]


def demo_config(overrides: list[str]):  # noqa: ANN201 - HybridConfig, imported late
    from hybrid_engine.config import load_config

    return load_config(ROOT / "configs/demo_cpu.yaml", OURS + overrides)


def emit(record: dict[str, Any]) -> None:
    print("BENCH " + json.dumps(record), flush=True)


# ----------------------------------------------------------------------------- children
def child_hybridrl(steps: int, threads: int, backend: str) -> None:
    """`steps` steps of the `train` flow; per step: flow wall seconds and the engine's timings."""
    from hybrid_engine.roles.workers import reuse_freed_memory

    reuse_freed_memory()  # as `hybridrl train` does before Prefect starts its threads
    from flows.train import train

    with tempfile.TemporaryDirectory(prefix="vs-trl-") as root:  # ~2 GB of weights: removed
        overrides = [
            *OURS,
            f"trainer.total_training_steps={steps}",
            f"trainer.num_threads={threads}",
            f"trainer.backend={backend}",
            f"storage.root={root}",
            "ray.pool_name=vs-trl",
            "trainer.save_freq=0",
        ]
        result = train(config=str(ROOT / "configs/demo_cpu.yaml"), overrides=overrides, run_id="b")
        summary = json.loads((Path(root) / "b/final/summary.json").read_text())
    hist = {h["step"]: h for h in summary["history"] if h["step"] > 0}
    for step, wall in sorted(result["step_wall_s"].items()):
        m = hist[int(step)]
        tokens = m["response_length/mean"] * PROMPTS * SAMPLES
        emit(
            {
                "step": int(step),
                "step_s": wall,
                "gen_s": m["timing_s/gen"],
                "gen_tokens": tokens,
                "prompt_tokens": m["prompt_length/mean"] * PROMPTS * SAMPLES,
                "reward_s": m.get("timing_s/reward", 0.0),
                "update_s": m.get("timing_s/update_actor", 0.0),
            }
        )


def child_trl(steps: int, threads: int) -> None:
    """`steps` GRPOTrainer steps on the same prompts; generation timed around `generate`."""
    import torch

    torch.set_num_threads(threads)
    from transformers import TrainerCallback
    from trl_setup import trl_trainer

    from hybrid_engine.rollout.base import response_mask_from_ids

    timing = {"gen_s": 0.0, "gen_tokens": 0, "prompt_tokens": 0}

    def timed(model, tokenizer) -> None:  # noqa: ANN001
        generate, eos = model.generate, tokenizer.eos_token_id

        def timed_generate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            timing["gen_s"] += time.perf_counter() - start
            completion = out[:, kwargs["input_ids"].shape[1] :]
            timing["gen_tokens"] += int(response_mask_from_ids(completion, eos).sum())
            timing["prompt_tokens"] += int(kwargs["attention_mask"].sum())
            return out

        model.generate = timed_generate

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):  # noqa: ANN002, ANN003, ANN202
            self.start = time.perf_counter()
            timing.update(gen_s=0.0, gen_tokens=0, prompt_tokens=0)

        def on_step_end(self, args, state, *_, **__):  # noqa: ANN001, ANN002, ANN003, ANN202
            emit({"step": state.global_step, "step_s": time.perf_counter() - self.start, **timing})

    out_dir = tempfile.mkdtemp(prefix="vs-trl-trl-")  # save_strategy="no": logs only, removed
    settings = {  # the equal work (the module docstring); the rest is TRL's default
        "per_device_train_batch_size": PROMPTS * SAMPLES,
        "steps_per_generation": 1,
        "num_generations": SAMPLES,
        "num_iterations": 1,
        "beta": 0.0,
        "gradient_checkpointing": False,
        "max_completion_length": NEW_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "learning_rate": LR,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "loss_type": "dapo",
        "scale_rewards": "group",
    }
    trainer = trl_trainer(demo_config([]), steps, settings, [Steps()], out_dir, timed)
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def child_generate(threads: int, repeats: int = 3) -> None:
    """Plain `model.generate` on the step's 32 sequences: tokens/s (the rollout baseline)."""
    import torch

    torch.set_num_threads(threads)
    cfg = demo_config([])
    from hybrid_engine.data import PromptData, prompt_batch
    from hybrid_engine.models.loading import load_policy, load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    model = load_policy(cfg.model, tokenizer, cfg.trainer.seed)
    rows = PromptData(cfg.data).step_rows(1)
    batch = prompt_batch(rows, tokenizer, cfg.data.max_prompt_length).repeat_interleave(SAMPLES)
    eos = tokenizer.eos_token_id
    from plain_generate import plain_generate

    for i in range(repeats + 1):  # the first call warms up
        ids, mask = batch["prompt_ids"], batch["prompt_mask"]
        tokens, seconds = plain_generate(
            model, ids, mask, NEW_TOKENS, eos, tokenizer.pad_token_id, seed=i
        )
        if i:
            emit({"gen_s": seconds, "gen_tokens": tokens})


def child_matmul(threads: int, n: int = 2048, repeats: int = 10) -> None:
    """fp32 GEMM GFLOP/s at this thread count: the machine's practical training peak."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        emit({"gflops": 2 * n**3 / (time.perf_counter() - start) / 1e9})


# ----------------------------------------------------------------------------- parent
def tree_rss(pid: int, extra: Any) -> int:
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    procs += extra()
    total = 0
    for p in {p.pid: p for p in procs}.values():
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def ray_processes() -> list[Any]:
    """The local Ray head's processes (its daemons and our workers), if a head is running."""
    from hybrid_engine.pool import pool

    state = pool.state_dir() / "head.json"
    if not state.is_file():
        return []
    return pool.head_processes(json.loads(state.read_text())["temp_dir"])


def run_child(kind: str, args: argparse.Namespace, extra=lambda: []) -> dict[str, Any]:  # noqa: ANN001
    cmd = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--steps",
        str(args.steps + 1),
        "--threads",
        str(args.threads),
        "--backend",
        args.backend,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(args.threads),
    }
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            peak[0] = max(peak[0], tree_rss(proc.pid, extra))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    records, tail = [], []
    for line in proc.stdout:
        if line.startswith("BENCH "):
            records.append(json.loads(line[6:]))
        else:
            tail = (tail + [line.rstrip()])[-30:]
    proc.wait()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"{kind} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return {
        "records": records,
        "peak_rss_gb": peak[0] / 1024**3,
        "wall_s": time.perf_counter() - start,
    }


def summarize(name: str, runs: list[dict[str, Any]], params: float) -> dict[str, Any]:
    steps = [r for run in runs for r in run["records"] if r["step"] > 1]  # step 1 warms up
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    train_s = statistics.median(r["step_s"] - r["gen_s"] for r in steps)
    tokens = statistics.median(r["gen_tokens"] + r["prompt_tokens"] for r in steps)
    # what the hardware computes: hybridrl packs each prompt once for its samples
    shared = SAMPLES if name == "hybridrl" else 1
    computed = statistics.median(r["gen_tokens"] + r["prompt_tokens"] / shared for r in steps)
    return {
        "train_tokens_computed": computed,
        "train_gflops_computed": 6 * params * computed / train_s / 1e9,
        "records": steps,
        "system": name,
        "steps_measured": len(steps),
        "step_s": med("step_s"),
        "steps_per_hour": 3600 / med("step_s"),
        "gen_s": med("gen_s"),
        "rollout_tokens_per_s": statistics.median(r["gen_tokens"] / r["gen_s"] for r in steps),
        "train_s": train_s,
        "train_tokens": tokens,
        "train_gflops": 6 * params * tokens / train_s / 1e9,
        "peak_rss_gb": max(run["peak_rss_gb"] for run in runs),
        "step_s_all": [round(r["step_s"], 2) for r in steps],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (+1 warm-up)")
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", choices=["local", "ray"], default="local")
    ap.add_argument("--out", default=str(ROOT / "bench/results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        {
            "hybridrl": lambda: child_hybridrl(args.steps, args.threads, args.backend),
            "trl": lambda: child_trl(args.steps, args.threads),
            "generate": lambda: child_generate(args.threads),
            "matmul": lambda: child_matmul(args.threads),
        }[args.child]()
        return

    from safetensors import safe_open

    from hybrid_engine.models.loading import ensure_smollm2

    with safe_open(ensure_smollm2() / "model.safetensors", "pt") as f:
        params = float(sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()))  # noqa: SIM118
    extra = ray_processes if args.backend == "ray" else (lambda: [])
    print(
        f"[bench] {PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, "
        f"{args.threads} threads, {params / 1e6:.1f}M parameters; {args.rounds} rounds of "
        f"hybridrl ({args.backend}) / TRL, {args.steps} measured steps each",
        flush=True,
    )
    probe = run_child("matmul", args)
    gflops_peak = statistics.median(r["gflops"] for r in probe["records"])
    print(f"[bench] fp32 matmul: {gflops_peak:.1f} GFLOP/s", flush=True)
    runs: dict[str, list] = {"hybridrl": [], "trl": []}
    for i in range(args.rounds):
        order = ["hybridrl", "trl"] if i % 2 == 0 else ["trl", "hybridrl"]
        for name in order:
            got = run_child(name, args, extra if name == "hybridrl" else (lambda: []))
            runs[name].append(got)
            s = [round(r["step_s"], 1) for r in got["records"]]
            print(
                f"[bench] round {i + 1} {name}: steps {s} s, peak {got['peak_rss_gb']:.2f} GB, "
                f"process {got['wall_s']:.0f} s",
                flush=True,
            )
        if args.backend == "ray":
            subprocess.run(
                [sys.executable, "-m", "flows.cli", "pool", "down", "--pool", "vs-trl"],
                cwd=ROOT,
                capture_output=True,
                timeout=300,
            )
    gen = run_child("generate", args)
    plain = statistics.median(r["gen_tokens"] / r["gen_s"] for r in gen["records"])
    ours, trl = (
        summarize("hybridrl", runs["hybridrl"], params),
        summarize("trl", runs["trl"], params),
    )
    for s in (ours, trl):
        s["train_fraction_of_peak"] = s["train_gflops"] / gflops_peak
        s["train_computed_fraction_of_peak"] = s["train_gflops_computed"] / gflops_peak
    report = {
        "work": {
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "new_tokens": NEW_TOKENS,
            "threads": args.threads,
            "backend": args.backend,
            "lr": LR,
        },
        "matmul_gflops": gflops_peak,
        "plain_generate_tokens_per_s": plain,
        "hybridrl": ours,
        "trl": trl,
        "ratios": {
            "steps_per_hour": ours["steps_per_hour"] / trl["steps_per_hour"],
            "rollout_tokens_per_s": ours["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"],
            "rollout_vs_plain_generate": ours["rollout_tokens_per_s"] / plain,
            "peak_rss": ours["peak_rss_gb"] / trl["peak_rss_gb"],
        },
    }
    write_report(args.out, "vs_trl", report, table, plot)


if __name__ == "__main__":
    main()
