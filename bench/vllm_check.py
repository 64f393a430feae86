"""GPU check of the `vllm` rollout backend: generate, sleep/wake, weights loaded in place.

    python bench/vllm_check.py [--model DIR] [--tokenizer DIR] [--tp 1] [--max-new-tokens 16]

Without --model it saves a tiny random Llama (on SmolLM2's tokenizer, or --tokenizer DIR) to a
temporary directory. Prints tokens/s, the GPU memory sleep frees, and whether greedy outputs
change after perturbed weights are pushed in place and come back with the original weights.
Exit 0: every check passed; 1: a check failed; 2: no vllm / no GPU / no model (message says).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from hybrid_engine.config import ModelConfig, TinyModelConfig

# head_dim 64 (256 / 4 heads): every vLLM attention backend takes it
VLLM_TINY = ModelConfig(tiny=TinyModelConfig(hidden_size=256, intermediate_size=512))

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable as `python bench/vllm_check.py` from the repo root
    sys.path.insert(0, str(ROOT))

QUESTIONS = [
    "What is 1+1?",
    "Add 13 and 29, please, and explain.",
    "Name three colors.",
    "Write one sentence about the sea.",
]
GiB = 2**30


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path is None:
        from hybrid_engine.models.loading import ensure_smollm2

        path = str(ensure_smollm2())
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tiny_llama(tokenizer, directory: Path) -> None:
    from hybrid_engine.models.loading import save_tiny_model

    save_tiny_model(VLLM_TINY, tokenizer, directory, seed=0, initializer_range=0.1)


def prompts_batch(tokenizer):
    import torch

    from hybrid_engine.batch import Batch

    ids = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        if tokenizer.chat_template is not None:
            tok = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            tok = tok["input_ids"] if hasattr(tok, "keys") else tok
        else:
            tok = tokenizer(q)["input_ids"]
        ids.append(list(tok))
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], dtype=torch.long)
    prompt_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask})


def responses(out) -> list[list[int]]:
    rows = zip(out["response_ids"], out["response_mask"], strict=True)
    return [r[m.bool()].tolist() for r, m in rows]


def load_state_dict(model_dir: Path):
    """The checkpoint's tensors by HF name (safetensors files), on CPU."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    state = {}
    for f in files:
        state |= load_file(f)
    return state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: a tiny random Llama)")
    ap.add_argument("--tokenizer", help="tokenizer directory (default: SmolLM2's)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (slower start)")
    args = ap.parse_args()

    import torch

    from hybrid_engine.rollout.base import SamplingParams
    from hybrid_engine.rollout.vllm import VLLMRollout

    if not torch.cuda.is_available():
        print("FAIL: no CUDA GPU visible; this check needs one", file=sys.stderr)
        return 2
    tmp = None
    try:
        if args.model:
            model_dir = Path(args.model)
            tokenizer = load_tokenizer(args.tokenizer or args.model)
        else:
            tokenizer = load_tokenizer(args.tokenizer)
            tmp = tempfile.TemporaryDirectory(prefix="vllm-check-")
            model_dir = Path(tmp.name)
            build_tiny_llama(tokenizer, model_dir)
            print(f"tiny random Llama saved to {model_dir}")
        original = load_state_dict(model_dir)
    except (FileNotFoundError, OSError) as e:
        print(f"FAIL: no model/tokenizer: {e}", file=sys.stderr)
        return 2

    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    start = time.perf_counter()
    try:
        rollout = VLLMRollout(
            str(model_dir),
            tensor_parallel_size=args.tp,
            pad_token_id=pad,
            eos_token_id=eos,
            gpu_memory_utilization=args.gpu_memory_utilization,
            dtype=args.dtype,
            enforce_eager=not args.cuda_graphs,
        )
    except RuntimeError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 2
    print(f"engine up in {time.perf_counter() - start:.1f} s (tp={args.tp}, {args.dtype})")

    batch = prompts_batch(tokenizer)
    greedy = SamplingParams(args.max_new_tokens, temperature=0.0)
    failures = []

    out = rollout.generate(batch, greedy)  # warm-up
    out = rollout.generate(batch, greedy)
    first = responses(out)
    print(
        f"greedy, {len(batch)} prompts: {out.meta['gen_tokens']} tokens in "
        f"{out.meta['gen_seconds']:.3f} s = {out.meta['gen_tokens_per_s']:.1f} tok/s"
    )
    sampled = rollout.generate(batch, SamplingParams(args.max_new_tokens, 1.0, seed=1))
    lp = sampled["rollout_log_probs"][sampled["response_mask"].bool()]
    print(f"sampled: rollout_log_probs mean {lp.mean():.3f}, min {lp.min():.3f}")

    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    rollout.wake_up()
    free_woken = torch.cuda.mem_get_info()[0]
    freed = (free_asleep - free_awake) / GiB
    print(
        f"sleep freed {freed:.2f} GiB (free: awake {free_awake / GiB:.2f}, asleep "
        f"{free_asleep / GiB:.2f}, woken {free_woken / GiB:.2f} GiB)"
    )
    if freed <= 0:
        failures.append("sleep freed no GPU memory")
    if responses(rollout.generate(batch, greedy)) != first:
        failures.append("greedy outputs differ after sleep + wake_up")

    gen = torch.Generator().manual_seed(1)
    noisy = {
        k: v.float() + torch.randn(v.shape, generator=gen) * v.float().std()
        for k, v in original.items()
    }
    rollout.sleep()
    start = time.perf_counter()
    n = rollout.load_weights(noisy.items())  # while asleep: wakes weights, loads, wakes KV
    print(f"loaded {n}/{len(original)} perturbed tensors in {time.perf_counter() - start:.2f} s")
    perturbed = responses(rollout.generate(batch, greedy))
    changed = perturbed != first
    print(f"greedy outputs changed after perturbed weights: {changed}")
    if not changed:
        failures.append("outputs did not change after loading perturbed weights")

    start = time.perf_counter()
    n = rollout.load_weights(original.items())  # while awake
    print(f"loaded {n}/{len(original)} original tensors in {time.perf_counter() - start:.2f} s")
    restored = responses(rollout.generate(batch, greedy))
    same = restored == first
    print(f"greedy outputs equal the first generation after restoring: {same}")
    if not same:
        failures.append("outputs differ from the first generation after restoring weights")
    if n != len(original):
        failures.append(f"load_weights reported {n} tensors, expected {len(original)}")

    if tmp is not None:
        tmp.cleanup()
    if failures:
        for f in failures:
            print(f"FAIL: {f}", file=sys.stderr)
        return 1
    print("OK: all vLLM backend checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
