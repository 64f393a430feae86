"""The sections that say what is trained and how: data, model, actor (policy loss, layout),
rollout, reference, critic, reward and algorithm (estimator, KL, rollout correction)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hybrid_engine.config.base import KLKind, LossAggMode, OptimConfig, Section


class TinyModelConfig(Section):
    """Shape of the tiny random Llama used by tests (`model.path: tiny`)."""

    hidden_size: int = Field(64, gt=0, description="width of the tiny model")
    intermediate_size: int = Field(128, gt=0, description="MLP width of the tiny model")
    num_hidden_layers: int = Field(2, gt=0, description="layers of the tiny model")
    num_attention_heads: int = Field(4, gt=0, description="attention heads of the tiny model")
    num_key_value_heads: int = Field(2, gt=0, description="key/value heads of the tiny model (GQA)")
    max_position_embeddings: int = Field(
        1024, gt=0, description="longest sequence of the tiny model"
    )


class DataConfig(Section):
    train_source: str = Field(
        "reasoning_gym:basic_arithmetic",
        description="`reasoning_gym:<task>` or a .parquet/.jsonl file of verl-style rows",
    )
    val_source: str | None = Field(
        None, description="validation rows; None = a held-out split of the task generator"
    )
    task_config: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the reasoning-gym generator"
    )
    train_size: int = Field(2000, gt=0, description="prompts generated for training (one epoch)")
    val_size: int = Field(64, ge=0, description="held-out prompts for validation")
    train_seed: int = Field(1000, description="generator seed of the training prompts")
    val_seed: int = Field(
        900_000, description="generator seed of the validation split (keep it far from train)"
    )
    system_prompt: str | None = Field(
        None, description="system message put before every prompt (chat template)"
    )
    prompt_suffix: str = Field("", description="text appended to every prompt")
    train_batch_size: int = Field(8, gt=0, description="prompts per step")
    max_prompt_length: int = Field(
        256, gt=0, description="longest prompt in tokens; a longer one is an error naming its row"
    )


class ModelConfig(Section):
    path: str = Field(
        "tiny",
        description="a local HF directory, `smollm2-135m-instruct` (packaged), or `tiny`",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="parameter dtype (CPU: float32)"
    )


class RolloutLayout(Section):
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per rollout replica (vllm only)")
    dp: int | None = Field(
        None, ge=1, description="rollout replicas; None = one per training rank (colocated)"
    )
    separate_copy: bool = Field(
        False,
        description="keep a persistent full rollout copy of the weights instead of sharing "
        "(1 rank) or gathering-then-releasing them (FSDP); the baseline of bench/memory.py",
    )


class ActorLayout(Section):
    """Per-stage layout of the actor group (3D-HybridEngine): train sharded, generate whole."""

    update: Literal["fsdp"] = Field(
        "fsdp", description="training layout: FSDP2 over `dp` ranks (1 rank = plain model)"
    )
    dp: int = Field(1, ge=1, description="data-parallel ranks of the actor group")
    rollout: RolloutLayout = Field(default_factory=RolloutLayout)


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    layout: ActorLayout = Field(default_factory=ActorLayout)
    ppo_mini_batch_size: int = Field(32, gt=0, description="samples per optimizer step")
    ppo_micro_batch_size: int = Field(8, gt=0, description="samples per forward/backward")
    ppo_epochs: int = Field(1, gt=0, description="passes over a step's samples")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio ≥ 1 - this")
    clip_ratio_high: float = Field(
        0.2, ge=0, description="PPO clip: ratio ≤ 1 + this (DAPO clip-higher: raise it)"
    )
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages")
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="how token losses average into one (token-mean = DAPO)"
    )
    entropy_coeff: float = Field(0.0, description="entropy bonus weight in the policy loss")
    use_kl_loss: bool = Field(
        False, description="KL to the reference policy as a loss term (GRPO style)"
    )
    kl_loss_coef: float = Field(0.001, ge=0, description="weight of that KL loss")
    kl_loss_type: KLKind = Field("low_var_kl", description="KL estimator of that loss")
    log_prob_micro_batch_size: int = Field(
        16, gt=0, description="samples per forward when computing old log-probs"
    )
    pack_prompts: bool = Field(
        True,
        description="log-probs without padding, each prompt computed once for its rollout.n "
        "samples (one packed row per prompt group, block attention mask)",
    )


class ValSamplingConfig(Section):
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    max_new_tokens: int | None = Field(None, description="None = rollout.max_new_tokens")


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field(
        "hf",
        description="rollout backend: a decoding loop on the transformers model (StaticCache), "
        "or vLLM (GPU, [vllm] extra)",
    )
    n: int = Field(4, gt=0, description="samples per prompt")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 = off")
    top_k: int = Field(0, ge=0, description="0 = off")
    max_new_tokens: int = Field(32, gt=0, description="longest response in tokens")
    micro_batch_size: int = Field(64, gt=0, description="sequences decoded together")
    val: ValSamplingConfig = Field(default_factory=ValSamplingConfig)


class RefConfig(Section):
    log_prob_micro_batch_size: int = Field(
        16, gt=0, description="samples per forward of the reference policy"
    )


class CriticConfig(Section):
    model_path: str | None = Field(None, description="None = initialise from the policy")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = Field(32, gt=0, description="samples per critic optimizer step")
    ppo_micro_batch_size: int = Field(8, gt=0, description="samples per critic forward/backward")
    ppo_epochs: int = Field(1, gt=0, description="critic passes over a step's samples")
    cliprange_value: float = Field(0.5, gt=0, description="value clip around the old values")
    loss_agg_mode: LossAggMode = Field(
        "token-mean", description="how token value losses average into one"
    )


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="`module:function` scoring (prompts, completions, rows) -> floats; "
        "None = the task's own scorer (reasoning-gym) or the numeric rule scorer (rows)",
    )
    answer_format: Literal["last_number", "hashes"] = Field(
        "last_number", description="how the rule scorer extracts the final answer"
    )
    overlong_buffer_len: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment: responses longer than "
        "rollout.max_new_tokens - this lose up to overlong_penalty_factor; 0 = off",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="largest overlong penalty (at rollout.max_new_tokens)"
    )
    model_path: str | None = Field(
        None,
        description="a sequence-classification reward model (local HF dir, or `tiny` for a "
        "random one in tests); its score replaces the rule/function score; None = off",
    )
    model_micro_batch_size: int = Field(16, gt=0, description="samples per reward-model forward")


class KLControlConfig(Section):
    type: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed coefficient, or adaptive towards target_kl"
    )
    kl_coef: float = Field(0.001, ge=0, description="(initial) KL-in-reward coefficient")
    target_kl: float = Field(
        0.1, gt=0, description="adaptive: the KL the coefficient steers towards"
    )
    horizon: int = Field(
        10000, gt=0, description="adaptive: samples over which the coefficient adapts"
    )


class AlgorithmConfig(Section):
    adv_estimator: Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "remax"] = Field(
        "grpo", description="registered advantage estimator (gae = PPO with a critic)"
    )
    gamma: float = Field(1.0, ge=0, le=1, description="discount (gae, reinforce_plus_plus)")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="divide GRPO advantages by the group's std (false: the Dr. GRPO variant)"
    )
    use_kl_in_reward: bool = Field(
        False, description="subtract a KL penalty to the reference from the token rewards"
    )
    kl_penalty: KLKind = Field("kl", description="KL estimator of that penalty")
    kl_ctrl: KLControlConfig = Field(default_factory=KLControlConfig)
