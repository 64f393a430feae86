"""verifiers environments as hybridrl data and agents (the `[verifiers]` extra: verifiers 0.2,
whose `Environment`, `SingleTurnEnv`, `MultiTurnEnv` and `ToolEnv` score with a `Rubric`).

    data.train_source: verifiers:<env>     the environment's dataset (validation: its
                                           eval_dataset, else its dataset)
    data.val_source: verifiers:<env>       its eval_dataset, else its dataset
    rollout.agent.function: hybrid_engine.rollout.agent.verifiers_env:rollout

`<env>` is an environment id, loaded with `vf.load_environment(id, **data.task_config)`, or
`module:attribute` naming an `Environment` or a function returning one (called with
`data.task_config`). The agent runs the environment's own rollout (`run_rollout`: its
conversation rules, turns and tools) against the policy's endpoint through verifiers' OpenAI
chat client; the rubric's reward is the sample's reward and its metrics the sample's info.
Rubrics that score a whole group at once are refused.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

PREFIX = "verifiers:"
_ENVS: dict[tuple[str, str], Any] = {}


def load_env(spec: str, env_args: dict[str, Any]) -> Any:
    """The environment `spec` names (loaded once per process and arguments)."""
    key = (spec, json.dumps(env_args, sort_keys=True))
    if key in _ENVS:
        return _ENVS[key]
    import verifiers as vf

    where = f"data.train_source={PREFIX}{spec}"
    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{where}: cannot load {spec!r}: {e}") from None
        env = obj if isinstance(obj, vf.Environment) else obj(**env_args)
    else:
        env = vf.load_environment(spec, **env_args)
    if not isinstance(env, vf.Environment):
        raise ValueError(f"{where}: {type(env).__name__} is not a verifiers Environment")
    if env.requires_group_rollouts:
        raise ValueError(f"{where}: its rubric scores whole groups, which is not supported")
    _ENVS[key] = env
    return env


def verifiers_rows(
    spec: str, size: int, seed: int, env_args: dict[str, Any], split: str
) -> list[dict[str, Any]]:
    """verl-style rows from the environment's dataset (`split`: train or eval)."""
    env = load_env(spec, env_args)
    ds = env.get_dataset(size, seed) if split == "train" else env.get_eval_dataset(size, seed)
    rows = []
    for r in ds:
        info = r.get("info") or {}
        rows.append(
            {
                "prompt": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
                "data_source": PREFIX + spec,
                "reward_model": {"ground_truth": str(r.get("answer") or "")},
                "extra_info": {
                    "verifiers": {
                        "spec": spec,
                        "env_args": env_args,
                        "example_id": r["example_id"],
                        "info": json.loads(info) if isinstance(info, str) else info,
                        "task": r.get("task"),
                    }
                },
            }
        )
    return rows


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
