"""A verifiers environment's dataset as prompt rows (`data.train_source: verifiers:<env>`;
the `[verifiers]` extra, verifiers 0.2), and the environment loader the agent shares
(`hybrid_engine.rollout.agent.verifiers_env:rollout` runs the environment's rollout).

`<env>` is an environment id, loaded with `vf.load_environment(id, **data.task_config)`, or
`module:attribute` naming an `Environment` or a function returning one (called with
`data.task_config`). Rubrics that score a whole group at once are refused. Training rows come
from the environment's dataset, validation rows from its eval_dataset, else its dataset.
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
