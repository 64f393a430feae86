"""verifiers environments as hybridrl data and agents (the `[verifiers]` extra: verifiers 0.2,
whose `Environment`, `SingleTurnEnv`, `MultiTurnEnv` and `ToolEnv` score with a `Rubric`).

    data.train_source: verifiers:<env>     the environment's dataset (validation: its
                                           eval_dataset, else its dataset)
    data.val_source: verifiers:<env>       its eval_dataset, else its dataset
    rollout.agent.function: hybrid_engine.rollout.agent.verifiers_env:rollout

The dataset side (rows, the environment loader) lives in `hybrid_engine.verifiers_data`.
`<env>` is an environment id, loaded with `vf.load_environment(id, **data.task_config)`, or
`module:attribute` naming an `Environment` or a function returning one (called with
`data.task_config`). The agent runs the environment's own rollout (`run_rollout`: its
conversation rules, turns and tools) against the policy's endpoint through verifiers' OpenAI
chat client; the rubric's reward is the sample's reward and its metrics the sample's info.
Rubrics that score a whole group at once are refused.
"""

from __future__ import annotations

from typing import Any

from hybrid_engine.verifiers_data import PREFIX, load_env


async def rollout(client: Any, row: dict[str, Any], **_: Any) -> dict[str, Any]:
    """The agent: the row's environment runs its rollout with `client`; its rubric scores."""
    from verifiers.clients import OpenAIChatCompletionsClient

    meta = row["extra_info"].get("verifiers") if isinstance(row["extra_info"], dict) else None
    if meta is None:
        raise ValueError(f"row {row.get('uid')} is not from a {PREFIX} data source")
    env = load_env(meta["spec"], meta["env_args"])
    given = {"prompt": row["prompt"], "example_id": meta["example_id"]}
    given |= {"answer": row["ground_truth"], "info": meta["info"]}
    if meta.get("task"):
        given["task"] = meta["task"]
    out = await env.run_rollout(given, OpenAIChatCompletionsClient(client), "hybridrl", {})
    if out.get("error"):
        raise RuntimeError(f"the verifiers rollout failed: {out['error']}")
    metrics = {
        k: float(v)
        for k, v in (out.get("metrics") or {}).items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return {"reward": float(out["reward"]), "info": metrics}
