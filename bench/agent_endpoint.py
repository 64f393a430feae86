"""The agent endpoint against the in-process multi-turn loop, on the same task and budget.

Both roll out the same two-turn conversation: the policy answers, is told "Check your
answer. Reply with the final number only.", answers again. The multi-turn loop drives an
environment (`Revise`) from the rollout's thread; the agent (`examples.answer_then_check`)
is a program written against the `openai` client, and its calls go through HTTP to the endpoint, which batches
them into the same backend's generate. Same preset, prompts, seeds, `rollout.n`,
`rollout.max_new_tokens` and model; only the path differs.

Prints, per configuration, the rollout's wall seconds, sampled tokens, tokens/s, the seconds
spent in generate, and what remains (the overhead): for the loop, and for the endpoint at
each `max_concurrency`. One process, one configuration at a time (never two benchmarks at
once on a 2-core machine).

    .venv/bin/python bench/agent_endpoint.py [--preset configs/demo_cpu.yaml] [--steps 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))  # this module: the environment `Revise`

from hybrid_engine.config import load_config  # noqa: E402
from hybrid_engine.data import prompt_batch  # noqa: E402
from hybrid_engine.engine import Engine  # noqa: E402
from hybrid_engine.rollout.agent.runner import agent_rollout  # noqa: E402
from hybrid_engine.rollout.base import SamplingParams, step_seed  # noqa: E402
from hybrid_engine.rollout.envs import Environment, Step  # noqa: E402
from hybrid_engine.rollout.multiturn import env_rollout  # noqa: E402

CHECK = "Check your answer. Reply with the final number only."


class Revise(Environment):
    """Two turns: the answer, then the same follow-up for everyone."""

    def reset(self, row, seed):
        self.turn = 0
        return [dict(m) for m in row["prompt"]]

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            return Step([{"role": "user", "content": CHECK}], None, False, {})
        return Step(None, None, True, {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="configs/demo_cpu.yaml")
    ap.add_argument("--steps", type=int, default=2, help="rollouts per configuration")
    ap.add_argument("--concurrency", default="4,8,16,32", help="max_concurrency values")
    args = ap.parse_args()
    cfg = load_config(args.preset)
    engine = Engine(cfg)
    r, tok = cfg.rollout, engine.tokenizer
    mt = SimpleNamespace(
        environment="agent_endpoint:Revise", env_kwargs={}, max_turns=2, max_total_tokens=512
    )

    def inputs(step: int):
        prompts = prompt_batch(engine.data.step_rows(step), tok, cfg.data.max_prompt_length)
        prompts["uid"] = [str(i) for i in range(len(prompts))]
        seed = step_seed(cfg.trainer.seed, step)
        return prompts.repeat_interleave(r.n), SamplingParams(
            r.max_new_tokens, r.temperature, r.top_p, r.top_k, seed
        )

    def measure(name: str, rollout) -> None:
        wall = gen = tokens = 0.0
        for step in range(1, args.steps + 1):
            prompts, sampling = inputs(step)
            start = time.perf_counter()
            batch = rollout(prompts, sampling)
            wall += time.perf_counter() - start
            gen += batch.meta["gen_seconds"]
            tokens += int(batch["response_mask"].sum())
        print(
            f"{name:<28} {wall:7.1f} s  {tokens:6.0f} tokens  {tokens / wall:6.1f} tok/s  "
            f"generate {gen:6.1f} s  overhead {wall - gen:5.1f} s ({(wall - gen) / wall:5.1%})",
            flush=True,
        )

    print(
        f"{args.preset}: {cfg.data.train_batch_size} prompts x {r.n} samples x 2 turns, "
        f"{r.max_new_tokens} new tokens per turn, {args.steps} rollouts each",
        flush=True,
    )
    generate = engine.actor.generate
    measure("multi-turn loop", lambda p, s: env_rollout(generate, tok, p, s, mt, 4096))
    for c in [int(x) for x in args.concurrency.split(",")]:
        agent = SimpleNamespace(
            function="hybrid_engine.rollout.agent.examples:answer_then_check",
            kwargs={"check": CHECK},
            max_concurrency=c,
            timeout_s=600.0,
            on_fault="zero",
            max_context_tokens=4096,
        )
        measure(
            f"endpoint, max_concurrency={c}",
            lambda p, s, a=agent: agent_rollout(generate, tok, p, s, a, 0),
        )


if __name__ == "__main__":
    main()
