"""GPU check of the `hf` engine path: decode, the fused LM-head log-probs, packing, and the
actor worker (generate + PPO update) on CUDA, with its speed at two batch shapes; then one
LoRA update and one GSPO update of the actor worker in bf16.

    python bench/gpu_check.py --assets DIR [--json FILE] [--cpu]

DIR holds SmolLM2-135M-Instruct's tokenizer files and config.json, no weights: equalities run
on a tiny random Llama, speed on random weights of SmolLM2's shape (the same matmuls as the
real model; the tokens it samples are noise). The actor is the class a pool rank hosts
(`ActorRolloutRef`), built from a config whose `ray.num_gpus_per_rank` puts it on CUDA; Ray
itself is not needed. `--cpu` runs the same code on the CPU at small shapes (a dry run of
the script). Exit 0: every check passed; 1: a check failed; 2: no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as `python bench/gpu_check.py` from the repo root
    sys.path.insert(0, str(ROOT))

SYSTEM = "Answer with a number."
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def arithmetic_rows(count: int) -> list[dict]:
    """Fixed addition questions in the engine's row format (prompt, data_source, ...)."""
    rows = []
    for i in range(count):
        a, b = 3 + 7 * i % 50, 11 + 13 * i % 40
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                "data_source": "gpu_check",
                "reward_model": {"ground_truth": str(a + b)},
                "extra_info": {},
            }
        )
    return rows


def prepare_smollm2_shape(assets: Path) -> Path:
    """$HYBRIDRL_CACHE/models/smollm2-135m-instruct with random weights of SmolLM2's shape."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cache = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    os.environ["HYBRIDRL_CACHE"] = str(cache)
    target = cache / "models" / "smollm2-135m-instruct"
    shutil.copytree(assets, target)
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(target)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(target)
    return target


def check_equalities(tokenizer) -> dict:  # noqa: ANN001
    """decode = generate (greedy), fused head = autograd, packed = padded, all on CUDA."""
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.data import prompt_batch
    from hybrid_engine.models.loading import load_policy
    from hybrid_engine.models.logprobs import (
        head_log_probs_against_autograd,
        packed_response_log_probs,
        response_log_probs,
    )
    from hybrid_engine.rollout.base import SamplingParams
    from hybrid_engine.rollout.hf import decode

    out: dict = {}
    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0).to(DEVICE)
    batch = prompt_batch(arithmetic_rows(3), tokenizer, 256).repeat_interleave(4)
    ids, mask = batch["prompt_ids"].to(DEVICE), batch["prompt_mask"].to(DEVICE)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ours, _ = decode(model, ids, mask, SamplingParams(12, temperature=0.0), eos, pad)
    ref = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=pad
    )[:, ids.shape[1] :]
    ref = torch.nn.functional.pad(ref, (0, 12 - ref.shape[1]), value=pad)
    ours = torch.nn.functional.pad(ours, (0, 12 - ours.shape[1]), value=pad)
    out["decode_greedy_equals_generate"] = bool(torch.equal(ours, ref))

    torch.manual_seed(0)
    sampled, _ = decode(model, ids, mask, SamplingParams(12, temperature=1.0), eos, pad)
    out["decode_sampled_tokens_in_vocab"] = bool(
        (sampled >= 0).all() and (sampled < model.config.vocab_size).all()
    )

    g = torch.Generator(device=DEVICE).manual_seed(0)
    head = torch.nn.Linear(64, 5000, device=DEVICE)
    hidden = torch.randn(100, 64, device=DEVICE, generator=g)
    targets = torch.randint(0, 5000, (100,), device=DEVICE, generator=g)
    pairs = head_log_probs_against_autograd(head, hidden, targets, 0.7, {"logp": 1, "entropy": 0.1})
    out["head_log_probs_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in pairs.values())

    seq = torch.cat([ids, sampled], 1)
    seq_mask = torch.cat([mask, (sampled != pad).long()], 1)
    results = []
    for fn in (response_log_probs, packed_response_log_probs):
        model.zero_grad()
        logp, _ = fn(model.train(), seq, seq_mask, sampled.shape[1], 1.0)
        (logp * (sampled != pad)).sum().backward()
        results.append((logp * (sampled != pad), [p.grad.clone() for p in model.parameters()]))
    model.eval()
    (la, ga), (lb, gb) = results
    out["packed_vs_padded_logp_max_abs_diff"] = float((la - lb).abs().max().detach())
    out["packed_vs_padded_grad_max_abs_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(ga, gb, strict=True)
    )
    return out


def run_actor(
    tokenizer,
    dtype: str,
    prompts: int,
    n: int,
    new_tokens: int,  # noqa: ANN001
    extra: tuple[str, ...] = (),
) -> dict:
    """Build the actor on CUDA, then per round: generate, score, GRPO advantages, update.
    `extra` overrides make a recipe of it (LoRA, GSPO): then the old log-probs are computed
    up front and the update takes two optimizer steps, so the second one is off-policy."""
    from hybrid_engine.algorithms.advantages import compute_advantage
    from hybrid_engine.config import load_config
    from hybrid_engine.data import prompt_batch
    from hybrid_engine.roles.workers import ActorRolloutRef
    from hybrid_engine.rollout.base import SamplingParams

    rows = prompts * n
    cfg = load_config(
        str(ROOT / "configs/demo_cpu.yaml"),
        [
            f"model.dtype={dtype}",
            "trainer.backend=ray",
            f"ray.num_gpus_per_rank={int(DEVICE == 'cuda')}",
            f"data.train_batch_size={prompts}",
            f"rollout.n={n}",
            f"rollout.max_new_tokens={new_tokens}",
            f"rollout.micro_batch_size={rows}",
            f"actor.ppo_mini_batch_size={rows}",
            f"actor.ppo_micro_batch_size={min(rows, 64)}",
            f"actor.log_prob_micro_batch_size={min(rows, 64)}",
            *(
                [
                    f"actor.ppo_mini_batch_size={rows // 2}",
                    f"actor.ppo_micro_batch_size={min(rows // 2, 64)}",
                ]
                if extra
                else []
            ),
            *extra,
        ],
    )
    assert cfg.device == DEVICE
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    actor = ActorRolloutRef(cfg, tokenizer)
    batch = prompt_batch(arithmetic_rows(prompts), tokenizer, 512).repeat_interleave(n)
    uid = torch.arange(prompts).repeat_interleave(n).tolist()
    before = [p.detach().clone() for p in actor.policy.parameters()]
    timings = []
    for round_ in range(3):  # round 0 warms up (CUDA kernels, allocator)
        sync()
        start = time.perf_counter()
        out = actor.generate(batch, SamplingParams(new_tokens, temperature=1.0, seed=round_))
        sync()
        gen_s = time.perf_counter() - start
        mask = out["response_mask"]
        # reward: the share of response tokens that start a word (a simple format reward
        # that varies on random weights, whose responses all run to full length)
        scores = torch.zeros(mask.shape, dtype=torch.float32)
        last = (mask.sum(-1) - 1).clamp(min=0)
        scores[torch.arange(rows), last] = torch.tensor(
            [
                sum(t.startswith("Ġ") for t in tokenizer.convert_ids_to_tokens(r[m.bool()]))
                / max(int(m.sum()), 1)
                for r, m in zip(out["response_ids"], mask, strict=True)
            ]
        )
        adv, _ = compute_advantage(
            "grpo", token_level_rewards=scores, response_mask=mask, index=uid
        )
        out["advantages"] = adv
        if extra:
            out = out.union(actor.compute_log_prob(out))
            if cfg.use_reference:
                out = out.union(actor.compute_ref_log_prob(out))
        sync()
        start = time.perf_counter()
        metrics = actor.update_actor(out)
        sync()
        update_s = time.perf_counter() - start
        timings.append(
            {
                "gen_s": gen_s,
                "update_s": update_s,
                "tokens": int(mask.sum()),
                "grad_norm": metrics["actor/grad_norm"],
            }
        )
    moved = sum(
        float((a.float() - b.detach().float()).abs().max())
        for a, b in zip(before, actor.policy.parameters(), strict=True)
    )
    frozen_moved = sum(
        float((a.float() - b.detach().float()).abs().max())
        for a, b in zip(before, actor.policy.parameters(), strict=True)
        if not b.requires_grad
    )
    finite = all(bool(torch.isfinite(p).all()) for p in actor.policy.parameters())

    # plain `generate` at the same batch: the rollout baseline
    model = actor.policy.eval()
    ids, pmask = batch["prompt_ids"].to(DEVICE), batch["prompt_mask"].to(DEVICE)
    from plain_generate import plain_generate

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    plain = [
        t / s
        for t, s in (plain_generate(model, ids, pmask, new_tokens, eos, pad, i) for i in range(2))
    ]
    measured = timings[1:]
    return {
        "dtype": dtype,
        "prompts": prompts,
        "samples": n,
        "new_tokens": new_tokens,
        "overrides": list(extra),
        "frozen_weights_moved": frozen_moved,
        "gen_s": [round(t["gen_s"], 3) for t in measured],
        "rollout_tok_s": [round(t["tokens"] / t["gen_s"]) for t in measured],
        "update_s": [round(t["update_s"], 3) for t in measured],
        "plain_generate_tok_s": round(plain[-1]),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if DEVICE == "cuda"
        else None,
        "weights_moved_max_abs_sum": moved,
        "weights_finite": finite,
        "grad_norms": [round(t["grad_norm"], 4) for t in measured],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--assets", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU, small shapes")
    args = ap.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.cpu else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("[gpu_check] no CUDA device")
        sys.exit(2)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"[gpu_check] {name} torch {torch.__version__}", flush=True)
    prepare_smollm2_shape(args.assets)
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.models.loading import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    report: dict = {"device": name, "torch": torch.__version__}
    failed = []
    try:
        eq = check_equalities(tokenizer)
        report["equalities"] = eq
        print(f"[gpu_check] equalities: {eq}", flush=True)
        if not eq["decode_greedy_equals_generate"] or not eq["decode_sampled_tokens_in_vocab"]:
            failed.append("decode")
        if eq["head_log_probs_max_abs_diff"] > 1e-4:
            failed.append("head_log_probs")
        if (
            max(eq["packed_vs_padded_logp_max_abs_diff"], eq["packed_vs_padded_grad_max_abs_diff"])
            > 1e-4
        ):
            failed.append("packing")
    except Exception:
        traceback.print_exc()
        failed.append("equalities raised")
    report["actor"] = []
    for dtype in ("float32", "bfloat16"):
        shapes = ((8, 4, 32), (64, 8, 128)) if DEVICE == "cuda" else ((2, 2, 20),)
        for prompts, n, new_tokens in shapes:
            try:
                r = run_actor(tokenizer, dtype, prompts, n, new_tokens)
            except Exception:
                traceback.print_exc()
                failed.append(f"actor {dtype} {prompts}x{n}x{new_tokens} raised")
                continue
            report["actor"].append(r)
            print(f"[gpu_check] actor: {r}", flush=True)
            if not r["weights_finite"] or r["weights_moved_max_abs_sum"] == 0:
                failed.append(f"actor {dtype} {prompts}x{n}x{new_tokens} update")
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    # the 2026 recipes on the actor worker, bf16: one LoRA update (with the base as the
    # reference of a KL loss) and one GSPO update; each takes two optimizer steps a round
    recipes = {
        "lora": ("actor.lora.rank=16", "actor.lora.alpha=32", "actor.use_kl_loss=true"),
        "gspo": (
            "actor.policy_loss.mode=gspo",
            "actor.clip_ratio_low=3e-4",
            "actor.clip_ratio_high=4e-4",
        ),
    }
    report["recipes"] = {}
    shape = (8, 4, 32) if DEVICE == "cuda" else (2, 2, 20)
    for name, extra in recipes.items():
        try:
            r = run_actor(tokenizer, "bfloat16", *shape, extra=extra)
        except Exception:
            traceback.print_exc()
            failed.append(f"{name} update raised")
            continue
        report["recipes"][name] = r
        print(f"[gpu_check] {name}: {r}", flush=True)
        if not r["weights_finite"] or r["weights_moved_max_abs_sum"] == 0:
            failed.append(f"{name} update")
        if name == "lora" and r["frozen_weights_moved"] != 0:
            failed.append("lora moved frozen weights")
    report["failed"] = failed
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"[gpu_check] {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
