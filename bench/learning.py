"""The learning benchmark: hybridrl's presets against TRL's GRPOTrainer on the same held-out
questions, over seeds, with the per-step signals that explain a curve.

    .venv/bin/pip install -e '.[bench]'          # TRL 1.16 (accepts torch 2.13)
    .venv/bin/python bench/learning.py [--frameworks hybridrl,trl] [--presets grpo]
        [--seeds 1,2,3] [--steps 60] [--every 10] [--val-size 500] [--threads 2]
        [--out bench/results/learning.json] [--set KEY=VALUE ...] [--trl KEY=VALUE ...]

For each (framework, preset, seed), one at a time and each in a process of its own: train
`--steps` steps and score the policy on the held-out questions at step 0, every `--every`
steps and at the last step. A preset is a recipe name of `bench/recipes.py` (`grpo` is the
demo, configs/demo_cpu.yaml); `--set` overrides hybridrl's preset, `--trl` TRL's settings.

The held-out set and scorer, the same for both frameworks: the preset's validation rows
(`data.val_source`, else its training task at `data.val_seed`), built once in this process,
without any question that occurs in training and without repeats, the first `--val-size` of
them (an error if there are fewer). Both policies answer greedily through the same code,
`hybrid_engine.evaluation.greedy_heldout`: the preset's prompt template, hybridrl's `hf`
decode at the preset's validation length, the preset's scorer. Answer-correct = scored 1;
format-correct = `hybrid_engine.rewards.format_correct` (the scorer can read a final answer:
for the demo a plain number, what its system prompt asks for).

Per step, both frameworks: sampled reward (the scorer's mean, without hybridrl's overlong
penalty), mean token entropy, clip fractions of the PPO band by side (low: r < 1 - eps with
A < 0; high: r > 1 + eps with A > 0), KL to the reference where the run has one (hybridrl
`actor/kl_loss`, TRL `kl`; None without), mean response length, step seconds.

hybridrl: the preset as it is (plain in-process loop, `trainer.backend=local`) with
`trainer.seed`, `trainer.total_training_steps` and `trainer.num_threads` set from the
command line. TRL (`bench/trl_setup.py` forces fp32, the preset's prompts in hybridrl's step
order, hybridrl's scorer as the reward, the seed) is at GRPOConfig's defaults except what
equals the preset: `num_generations` = `rollout.n`, `max_completion_length` =
`rollout.max_new_tokens`, prompts per step = `data.train_batch_size` (TRL's default
`per_device_train_batch_size=8`, `gradient_accumulation_steps` = prompts x n / 8, so one
generation batch is one optimizer step), `learning_rate` = `actor.optim.lr`, `temperature`
= `rollout.temperature`. TRL's own defaults kept (1.16): `beta=0` (no reference, no KL),
`loss_type="dapo"`, `scale_rewards="group"`, `epsilon=0.2`, `num_iterations=1`,
`lr_scheduler_type="linear"` (decays to 0 at `--steps`; the demo's lr is constant),
`warmup_steps=0`, `max_grad_norm=1.0`, `gradient_checkpointing=True`, AdamW (fused),
`weight_decay=0`, `top_p=1`, `top_k=0`, no overlong penalty (the demo has one).

Each finished run is appended to `--out` (so a long benchmark spans sessions, one seed at a
time); a run already there with the same settings is skipped. Then prints the learning table
(`bench/learning_report.py`: before / best / final answer-correct as mean ± sd [95% interval]
over seeds) and writes it beside the JSON (`.md`) with the curves (`.png`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from learning_report import plot, table  # noqa: E402 - beside this file
from recipes import preset  # noqa: E402
from report import cpu_model  # noqa: E402

FRAMEWORKS = ("hybridrl", "trl")
# the per-step record's fields, and each framework's metric for them
SIGNALS = {
    "hybridrl": {
        "reward": "critic/score/mean",
        "entropy": "actor/entropy",
        "clip_low": "actor/pg_clipfrac_low",
        "clip_high": "actor/pg_clipfrac_high",
        "kl_ref": "actor/kl_loss",
        "response_length": "response_length/mean",
    },
    "trl": {
        "reward": "reward",
        "entropy": "entropy",
        "clip_low": "clip_ratio/low_mean",
        "clip_high": "clip_ratio/high_mean",
        "kl_ref": "kl",
        "response_length": "completions/mean_length",
    },
}


def signals(framework: str, metrics: dict[str, Any]) -> dict[str, float | None]:
    return {k: metrics.get(name) for k, name in SIGNALS[framework].items()}


def config(name: str, seed: int, steps: int, threads: int, overrides: list[str]) -> Any:
    from hybrid_engine.config import load_config

    return load_config(
        ROOT / preset(name),
        [
            f"trainer.seed={seed}",
            f"trainer.total_training_steps={steps}",
            f"trainer.num_threads={threads}",
            "trainer.backend=local",
            *overrides,
        ],
    )


def heldout_rows(cfg: Any, size: int) -> list[dict[str, Any]]:
    """The first `size` distinct held-out questions of the preset, none in its training
    rows (see the module docstring)."""
    from hybrid_engine.data import PromptData

    data_cfg = cfg.data.model_copy(update={"val_size": max(cfg.data.val_size, 2 * size)})
    rows, seen = [], set()
    for row in PromptData(data_cfg).val:  # already without the training questions
        key = json.dumps(row["prompt"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    if len(rows) < size:
        raise ValueError(
            f"--val-size {size}: the preset has only {len(rows)} distinct held-out questions "
            f"not in training (from data.val_size={data_cfg.val_size})"
        )
    return rows[:size]


def due(step: int, every: int, steps: int) -> bool:
    return step == 0 or step == steps or (every > 0 and step % every == 0)


# ----------------------------------------------------------------------------- children
def child_hybridrl(cfg: Any, rows: list[dict], every: int) -> dict[str, Any]:
    from hybrid_engine.engine import Engine
    from hybrid_engine.evaluation import greedy_heldout

    engine, steps = Engine(cfg), cfg.trainer.total_training_steps
    per_step, evals, eval_s = [], [], 0.0

    def evaluate(step: int) -> None:
        nonlocal eval_s
        start = time.perf_counter()
        evals.append(
            {"step": step, **greedy_heldout(engine.export()[0], engine.tokenizer, rows, cfg)}
        )
        eval_s += time.perf_counter() - start
        print(f"  [hybridrl] step {step} held-out {evals[-1]['answer_correct']:.3f}", flush=True)

    evaluate(0)
    for step in range(1, steps + 1):
        m = engine.step(step)
        per_step.append({"step": step, **signals("hybridrl", m), "step_s": m["timing_s/step"]})
        if due(step, every, steps):
            evaluate(step)
    return {"per_step": per_step, "evals": evals, "eval_s": eval_s}


def child_trl(cfg: Any, rows: list[dict], every: int, trl_overrides: dict) -> dict[str, Any]:
    import shutil

    from transformers import TrainerCallback
    from trl_setup import trl_trainer

    from hybrid_engine.evaluation import greedy_heldout

    steps, r = cfg.trainer.total_training_steps, cfg.rollout
    per_device = 8  # GRPOConfig's default
    completions = cfg.data.train_batch_size * r.n
    if completions % per_device:
        raise ValueError(f"prompts x n = {completions} is not a multiple of {per_device}")
    settings = {
        "num_generations": r.n,
        "max_completion_length": r.max_new_tokens,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": completions // per_device,
        "learning_rate": cfg.actor.optim.lr,
        "temperature": r.temperature,
        **trl_overrides,
    }
    per_step, evals, eval_s = {}, [], [0.0]
    tokenizer = []

    def evaluate(model: Any, step: int) -> None:
        start = time.perf_counter()
        evals.append({"step": step, **greedy_heldout(model, tokenizer[0], rows, cfg)})
        eval_s[0] += time.perf_counter() - start
        print(f"  [trl] step {step} held-out {evals[-1]['answer_correct']:.3f}", flush=True)

    class Record(TrainerCallback):
        def on_step_begin(self, *_, **__):  # noqa: ANN002, ANN003, ANN202
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **_):  # noqa: ANN001, ANN202
            step = state.global_step
            per_step.setdefault(step, {})["step_s"] = time.perf_counter() - self.start
            if due(step, every, steps):
                evaluate(model, step)

        def on_log(self, args, state, control, logs=None, **_):  # noqa: ANN001, ANN202
            if logs and "entropy" in logs:  # a training step's log (not the final summary)
                per_step.setdefault(state.global_step, {}).update(signals("trl", logs))

    out_dir = tempfile.mkdtemp(prefix="learning-trl-")
    try:
        trainer = trl_trainer(
            cfg, steps, settings, [Record()], out_dir, lambda m, t: tokenizer.append(t)
        )
        evaluate(trainer.model, 0)
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    rows_out = [{"step": s, **per_step[s]} for s in sorted(per_step)]
    return {"per_step": rows_out, "evals": evals, "eval_s": eval_s[0], "trl_settings": settings}


# ----------------------------------------------------------------------------- parent
def commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


SAME = ("preset", "steps", "every", "threads", "questions_sha", "settings")  # one table's


def key_of(r: dict[str, Any]) -> tuple:
    return tuple(json.dumps(r[k], sort_keys=True) for k in SAME + ("framework", "seed"))


def run_one(job: dict[str, Any], rows_file: str, args: argparse.Namespace) -> dict | None:
    """One (framework, preset, seed) in a child process; its result, or None if it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        spec = {**job, "rows": rows_file, "out": out.name}
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        env |= {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
            return None
        got = json.loads(Path(out.name).read_text())
    wall = (time.perf_counter() - start) / 60
    return {**job, **got, "wall_min": wall, "eval_min": got.pop("eval_s") / 60}


def child(spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    s = spec["settings"]
    cfg = config(spec["preset"], spec["seed"], spec["steps"], spec["threads"], s["set"])
    rows = json.loads(Path(spec["rows"]).read_text())
    if spec["framework"] == "hybridrl":
        got = child_hybridrl(cfg, rows, spec["every"])
    else:
        got = child_trl(cfg, rows, spec["every"], s["trl"])
    Path(spec["out"]).write_text(json.dumps(got))


def parse_pairs(pairs: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"{flag} {p!r}: expected KEY=VALUE")
        k, v = p.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--presets", default="grpo")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--val-size", type=int, default=500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench/results/learning.json"))
    ap.add_argument("--set", action="append", default=[], help="hybridrl preset override")
    ap.add_argument("--trl", action="append", default=[], help="TRL GRPOConfig KEY=VALUE")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one run, spec as JSON
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    frameworks = args.frameworks.split(",")
    if unknown := set(frameworks) - set(FRAMEWORKS):
        raise SystemExit(f"--frameworks: unknown {sorted(unknown)}; known {list(FRAMEWORKS)}")
    settings = {"set": args.set, "trl": parse_pairs(args.trl, "--trl")}
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"results": []}
    done = {key_of(r) for r in doc["results"]}
    chosen: list[dict[str, Any]] = []  # this invocation's runs and the matching earlier ones
    for name in args.presets.split(","):
        cfg = config(name, 1, args.steps, args.threads, args.set)
        rows = heldout_rows(cfg, args.val_size)
        sha = hashlib.sha256(json.dumps([r["prompt"] for r in rows]).encode()).hexdigest()[:16]
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(rows, f)
        try:
            for seed in [int(s) for s in args.seeds.split(",")]:
                for framework in frameworks:
                    job = {
                        "framework": framework,
                        "preset": name,
                        "seed": seed,
                        "steps": args.steps,
                        "every": args.every,
                        "threads": args.threads,
                        "questions_sha": sha,
                        "settings": settings,
                    }
                    if key_of(job) in done:
                        print(f"{framework} {name} seed {seed}: in {out} already", flush=True)
                        continue
                    print(f"{framework} {name} seed {seed}: {args.steps} steps", flush=True)
                    result = run_one(job, f.name, args)
                    if result is None:
                        print(f"{framework} {name} seed {seed}: failed (see above)", flush=True)
                        continue
                    result |= {
                        "task": cfg.data.train_source.split(":")[-1],
                        "questions": len(rows),
                        "machine": f"{cpu_model()}, {args.threads} threads",
                        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
                        "commit": commit(),
                    }
                    doc["results"].append(result)
                    done.add(key_of(result))
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(doc, indent=1))
            wanted = {k: json.dumps(job[k], sort_keys=True) for k in SAME}
            chosen += [
                r
                for r in doc["results"]
                if all(json.dumps(r[k], sort_keys=True) == v for k, v in wanted.items())
            ]
        finally:
            os.unlink(f.name)
    if not chosen:
        return
    report = table(chosen)
    out.with_suffix(".md").write_text(report)
    plot(chosen, out.with_suffix(".png"))
    print("\n" + report)


if __name__ == "__main__":
    main()
