"""What a run needs, checked in seconds before Prefect's server and the engine start (which
take 20-50 s): the model directories, the data files (each row), a user reward function on a
few training rows, the storage root. Each problem is one line naming the key, the file or
the row."""

from __future__ import annotations

from hybrid_engine.config import ConfigError, HybridConfig
from hybrid_engine.data import PromptData
from hybrid_engine.models.loading import SMOLLM2, TINY, resolve_model_path
from hybrid_engine.rewards import RewardError, RewardScorer
from storage.probe import check_storage


def preflight(cfg: HybridConfig) -> None:
    models = {"model.path": cfg.model.path}
    if cfg.use_critic and cfg.critic.model_path:
        models["critic.model_path"] = cfg.critic.model_path
    if cfg.use_reward_model and cfg.reward.model_path:
        models["reward.model_path"] = cfg.reward.model_path
    for key, path in models.items():
        check_model(key, path)
    data = PromptData(cfg.data)  # files exist and parse, every row has its fields
    if cfg.reward.function:
        probe_reward(cfg, data)
    check_storage(cfg.storage)


def probe_reward(cfg: HybridConfig, data: PromptData) -> None:
    """Call `reward.function` once on the first 4 training rows, each answered with its own
    ground truth: a function that raises, returns a non-finite value or the wrong number of
    scores fails here, named, instead of after the first rollout."""
    rows = data.train[:4]
    prompts = [r["prompt"][-1]["content"] for r in rows]
    completions = [f"The answer is {r['reward_model']['ground_truth']}." for r in rows]
    scored = [
        {
            "data_source": r["data_source"],
            "ground_truth": r["reward_model"]["ground_truth"],
            "extra_info": r["extra_info"],
            "prompt": r["prompt"],
        }
        for r in rows
    ]
    scorer = RewardScorer(cfg.reward.function, cfg.reward.answer_format, cfg.data.task_config)
    try:
        scorer.score(prompts, completions, scored)
    except RewardError as e:
        raise ConfigError(
            f"reward.function={cfg.reward.function!r}, tried on {len(rows)} training rows "
            f"answered with their ground truth: {e}"
        ) from None


def check_model(key: str, path: str) -> None:
    """A Hugging Face model directory whose config.json transformers can read."""
    if path in (TINY, SMOLLM2):
        return
    from transformers import AutoConfig

    where = resolve_model_path(path, key)  # no directory / no config.json: names the key
    try:
        AutoConfig.from_pretrained(where)
    except Exception as e:  # a broken JSON, an unknown model_type, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{key}={path!r}: its config.json cannot be read ({reason})") from None
