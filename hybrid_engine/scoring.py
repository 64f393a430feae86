"""The reward stage's work on a batch, shared by training (`Engine.reward`) and validation
(`evaluation.validate`): a score per sample (the reward model's, else the scorer's on the
decoded text), multi-turn environment rewards, DAPO's overlong penalty, and each score
placed on its response's last token."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.rewards import (
    RewardScorer,
    overlong_penalty,
    score_responses,
    token_level_scores,
)
from hybrid_engine.rollout.multiturn import multi_turn_scores
from hybrid_engine.step_metrics import timer


class BatchScoring:
    """Scores batches for a run with config `cfg`; `reward_model` (a role with `score`, or
    None) is set by the Engine whenever it (re)builds its roles."""

    def __init__(self, cfg: HybridConfig, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.scorer = RewardScorer(
            cfg.reward.function, cfg.reward.answer_format, cfg.data.task_config
        )
        self.reward_model: Any = None

    def score(
        self, batch: Batch, ids_key: str = "response_ids", mask_key: str = "response_mask"
    ) -> list[float]:
        """One score per sample, of the responses under `ids_key` / `mask_key`."""
        return score_responses(
            batch, ids_key, mask_key, self.tokenizer, self.scorer, self.reward_model
        )

    def turn_scores(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Multi-turn: (scores, acc, token-level scores) from the environment's rewards, the
        scorer's where it gave none."""
        need = [i for i, r in enumerate(batch["env_reward"]) if r is None]
        scored = self.score(batch.take(need)) if need else []
        per_turn = self.cfg.rollout.multi_turn.per_turn_rewards
        return multi_turn_scores(batch, dict(zip(need, scored, strict=True)), per_turn)

    def overlong(self, response_mask: torch.Tensor) -> torch.Tensor:
        """DAPO's soft overlong penalty per row (`reward.overlong_buffer_len`; 0 when off)."""
        rc = self.cfg.reward
        return overlong_penalty(
            response_mask.sum(-1),
            self.cfg.rollout.max_new_tokens,
            rc.overlong_buffer_len,
            rc.overlong_penalty_factor,
        )

    def reward(self, batch: Batch) -> Batch:
        """`scores` (the scorer's), `acc` (score >= 1) and `token_level_scores` (plus the
        overlong penalty, on the last response token). A batch that dynamic sampling scored
        already keeps its scores."""
        metrics: dict[str, float] = {}
        with timer(metrics, "reward"):
            if "token_level_scores" not in batch and "turns" in batch:
                batch["scores"], batch["acc"], batch["token_level_scores"] = self.turn_scores(batch)
            elif "token_level_scores" not in batch:
                raw = torch.tensor(self.score(batch))
                shaped = raw + self.overlong(batch["response_mask"])
                batch["scores"], batch["acc"] = raw.float(), (raw >= 1.0).float()
                batch["token_level_scores"] = token_level_scores(shaped, batch["response_mask"])
            if "baseline_response_ids" in batch and "reward_baselines" not in batch:
                base = self.score(batch, "baseline_response_ids", "baseline_response_mask")
                batch["reward_baselines"] = torch.tensor(base) + self.overlong(
                    batch["baseline_response_mask"]
                )
        scores = batch["scores"].tolist()
        metrics["critic/score/mean"] = sum(scores) / len(scores)
        metrics["critic/score/max"] = max(scores)
        metrics["critic/score/min"] = min(scores)
        if self.cfg.reward.overlong_buffer_len:
            penalty = self.overlong(batch["response_mask"])
            metrics["critic/overlong_penalty/mean"] = float(penalty.mean())
        batch.meta["metrics"] = {**batch.meta.get("metrics", {}), **metrics}
        return batch
