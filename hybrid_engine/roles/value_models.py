"""The roles on a scalar-head model: `Critic` (values, trained on the returns with a clipped
value loss) and `RewardModel` (frozen, scores whole sequences). Like the actor role
(`roles.workers`) each owns its model (and optimizer), runs on one rank of its group and
saves/loads its state at an fsspec URL."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from hybrid_engine.algorithms.losses import value_loss
from hybrid_engine.algorithms.utils import masked_mean
from hybrid_engine.batch import Batch
from hybrid_engine.config import CriticConfig, HybridConfig
from hybrid_engine.models.loading import load_critic, load_reward_model
from hybrid_engine.models.logprobs import position_ids_from_mask
from hybrid_engine.models.sharding import (
    full_state_dict,
    is_sharded,
    load_state,
    local_numel,
    save_state,
    shard_model,
)
from hybrid_engine.roles.updates import make_optimizer, micro_batches, model_device, ppo_updates
from hybrid_engine.roles.workers import update_settings


class Critic:
    """Value model V(s_t) trained on the returns with a clipped value loss."""

    def __init__(self, cfg: HybridConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.cfg: CriticConfig = cfg.critic
        self.model = load_critic(cfg.model, cfg.critic.model_path, tokenizer, cfg.trainer.seed)
        shard_model(self.model.to(cfg.device))
        params, steps = list(self.model.parameters()), cfg.optimizer_steps(cfg.critic)
        self.optimizer, self.scheduler = make_optimizer(params, cfg.critic.optim, steps)
        self.configure(cfg)

    def configure(self, cfg: HybridConfig) -> None:
        self.cfg = cfg.critic
        self.log_prob_micro_batch_size = cfg.actor.log_prob_micro_batch_size
        # seq-mean-token-sum-norm's constant, as the actor's
        self.loss_scale_factor = cfg.actor.loss_scale_factor or cfg.max_response_length

    def _values(self, mb: Batch) -> torch.Tensor:
        n = mb["response_mask"].shape[1]
        am = mb["attention_mask"]
        v = self.model(mb["input_ids"], am, position_ids_from_mask(am), keep=n + 1)[:, :-1]
        return v * mb["response_mask"]

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        return micro_batches(
            batch,
            self.log_prob_micro_batch_size,
            lambda mb: {"values": self._values(mb)},
            model_device(self.model),
        )

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value regression onto the returns."""
        c, scale = self.cfg, self.loss_scale_factor

        def loss_fn(micro: Batch, small: Batch, keep: int) -> tuple[list, dict]:
            vpreds = self._values(small)
            vf_loss, vf_clipfrac = value_loss(
                vpreds,
                micro["values"][:, :keep],
                micro["returns"][:, :keep],
                small["response_mask"],
                c.cliprange_value,
                c.loss_agg_mode,
                scale,
            )
            vpred_mean = masked_mean(vpreds.detach(), small["response_mask"])
            return [(vf_loss, c.loss_agg_mode)], {
                "critic/vf_loss": vf_loss,
                "critic/vf_clipfrac": vf_clipfrac,
                "critic/vpred_mean": vpred_mean,
            }

        return ppo_updates(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            loss_fn,
            prefix="critic",
            **update_settings(c),
        )

    def save(self, url: str, storage_options: dict | None = None) -> dict[str, str]:
        return save_state(url, self.model, self.optimizer, self.scheduler, {}, storage_options)

    def load(
        self, url: str, storage_options: dict | None = None, expected: dict | None = None
    ) -> int:
        load_state(url, self.model, self.optimizer, self.scheduler, storage_options, expected)
        return 0

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def info(self) -> dict:
        return {"sharded": is_sharded(self.model), "local_params": local_numel(self.model)}


class RewardModel:
    """A sequence classifier: the score of a sample is its logit at the last real token."""

    def __init__(self, cfg: HybridConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = shard_model(
            load_reward_model(cfg.reward.model_path, tokenizer, cfg).to(cfg.device)
        )
        self.micro_batch_size = cfg.reward.model_micro_batch_size

    def configure(self, cfg: HybridConfig) -> None:
        self.micro_batch_size = cfg.reward.model_micro_batch_size

    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        """`rm_scores`: one float per sample."""
        out = []
        for mb in batch.select(["input_ids", "attention_mask"], meta=False).split(
            self.micro_batch_size
        ):
            mb = mb.to(model_device(self.model))
            am = mb["attention_mask"]
            scores = self.model(mb["input_ids"], am, position_ids_from_mask(am))
            last = am.shape[1] - 1 - am.flip(-1).argmax(-1)  # last real token of each row
            out.append(scores[torch.arange(len(last)), last].cpu())
        return Batch({"rm_scores": torch.cat(out)})

    def save(self, url: str, storage_options: dict | None = None) -> dict[str, str]:
        return save_state(url, self.model, None, None, {}, storage_options)

    def load(
        self, url: str, storage_options: dict | None = None, expected: dict | None = None
    ) -> int:
        load_state(url, self.model, None, None, storage_options, expected)
        return 0

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def info(self) -> dict:
        return {"sharded": is_sharded(self.model), "local_params": local_numel(self.model)}
