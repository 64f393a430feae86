"""The sections that say what is trained and how: data, model, actor (policy loss, layout),
rollout, reference, critic, reward and algorithm (estimator, KL, rollout correction)."""

from __future__ import annotations

import importlib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hybrid_engine.config.base import (
    AdvEstimatorName,
    ISLevel,
    KLKind,
    LossAggMode,
    OptimConfig,
    PolicyLossName,
    RolloutBackend,
    Section,
    reads,
)
from hybrid_engine.config.vllm import VLLMSettings
from hybrid_engine.registry import ENVIRONMENTS
from hybrid_engine.specs import load_spec


def import_plugins(modules: list[str]) -> None:
    """Import the modules named in `algorithm.plugins`: their decorators register estimators
    and policy losses (in this process; pool workers call this too)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ValueError(f"algorithm.plugins: cannot import {name!r}: {e}") from None


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
        description="`reasoning_gym:<task>`, `verifiers:<environment>` (the [verifiers] "
        "extra) or a .parquet/.jsonl file of verl-style rows",
    )
    val_source: str | None = Field(
        None,
        description="validation rows, as train_source (a verifiers environment: its eval "
        "split); None = a held-out split of the task generator",
    )
    task_config: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the reasoning-gym generator or of the verifiers "
        "environment's loader",
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
    rollout: RolloutLayout = Field(
        default_factory=RolloutLayout, json_schema_extra=reads("rollout", "update")
    )


class PolicyLossConfig(Section):
    """Which registered policy loss the actor minimises (the reference lists them)."""

    mode: PolicyLossName = Field(
        "vanilla", description="registered policy loss: vanilla (PPO-clip), gspo, cispo, ..."
    )
    tau_pos: float = Field(1.0, gt=0, description="sapo: gate temperature where A > 0")
    tau_neg: float = Field(1.05, gt=0, description="sapo: gate temperature where A <= 0")
    aggregation: LossAggMode | None = Field(
        None, description="its own aggregation (null: actor.loss_agg_mode, the entropy/KL terms')"
    )


class LoraSettings(Section):
    """LoRA adapters on the policy (peft): only the adapters train, the frozen base is also
    the reference policy, checkpoints hold only the adapters. rank 0 = full fine-tuning."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0 = off (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="scaling: the update is alpha / r * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        description="names of the linear layers that get adapters",
    )


class ActorConfig(Section):
    optim: OptimConfig = Field(default_factory=OptimConfig)
    layout: ActorLayout = Field(default_factory=ActorLayout)
    ppo_mini_batch_size: int = Field(
        32,
        gt=0,
        description="samples per optimizer step",
        json_schema_extra=reads("advantage", "update"),
    )
    ppo_micro_batch_size: int = Field(8, gt=0, description="samples per forward/backward")
    ppo_epochs: int = Field(
        1,
        gt=0,
        description="passes over a step's samples",
        json_schema_extra=reads("advantage", "update"),
    )
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip: ratio ≥ 1 - this")
    clip_ratio_high: float = Field(
        0.2, ge=0, description="PPO clip: ratio ≤ 1 + this (DAPO clip-higher: raise it)"
    )
    clip_ratio_c: float = Field(3.0, gt=1, description="dual-clip bound for negative advantages")
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    lora: LoraSettings = Field(
        default_factory=LoraSettings, json_schema_extra=reads("run", "update")
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean",
        description="how token losses reduce to one (token-mean = DAPO; seq-mean-token-sum-norm "
        "= Dr.GRPO); sapo (seq-mean-token-mean) and geo_mean (seq-mean) always use their own",
    )
    loss_scale_factor: float | None = Field(
        None,
        gt=0,
        description="seq-mean-token-sum-norm divides by this; None = the padded response "
        "length (rollout.max_new_tokens; multi-turn: rollout.multi_turn.max_total_tokens)",
    )
    entropy_coeff: float = Field(0.0, description="entropy bonus weight in the policy loss")
    skip_nonfinite_steps: bool = Field(
        False,
        description="a NaN/Inf gradient skips that optimizer step (counted in "
        "actor/nonfinite_skipped); false: the update is refused and the run fails naming it",
    )
    use_kl_loss: bool = Field(
        False,
        description="KL to the reference policy as a loss term (GRPO style)",
        json_schema_extra=reads("advantage", "update"),
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
    max_new_tokens: int | None = Field(None, gt=0, description="None = rollout.max_new_tokens")


class MultiTurnConfig(Section):
    """Multi-turn rollouts: the policy and an environment take turns (`hybrid_engine.rollout.envs`)."""

    enabled: bool = Field(False, description="roll out conversations with an environment")
    environment: str = Field(
        "feedback",
        description="a registered environment, `module:Class`, or `openenv:<server URL or "
        "module.Class>` (the [openenv] extra)",
        json_schema_extra={"registry": "ENVIRONMENTS"},
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment's constructor"
    )
    max_turns: int = Field(3, gt=0, description="assistant turns per trajectory at most")
    max_total_tokens: int = Field(
        256,
        gt=0,
        description="the response (assistant and observation tokens after the prompt) at most; "
        "an observation that would pass it ends the trajectory",
    )
    per_turn_rewards: bool = Field(
        False,
        description="each turn's environment reward on that turn's last token (false: the "
        "last reward, on the last token)",
    )

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, name: str) -> str:
        if name.startswith("openenv:"):  # a server or a class, reached when the run starts
            return name
        if ":" not in name:
            return ENVIRONMENTS.check(name, "rollout.multi_turn.environment")
        cls = load_spec(name, "rollout.multi_turn.environment", "Class")  # raises naming it
        if not (isinstance(cls, type) and callable(getattr(cls, "step", None))):
            raise ValueError(f"environment {name!r} is not a class with reset and step")
        return name


class AgentConfig(Section):
    """Bring your own agent: a function that talks to the policy through an OpenAI-compatible
    endpoint (`hybrid_engine.rollout.agent`), called once per sample."""

    function: str = Field(
        "",
        description="`module:function` called as `function(client, row, **kwargs)` per sample "
        "(async def: an `openai.AsyncOpenAI` client; def: `openai.OpenAI`, in a thread); "
        "empty = off",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments passed to the agent function"
    )
    max_concurrency: int = Field(64, gt=0, description="agent episodes running at once")
    timeout_s: float = Field(
        120.0, gt=0, description="seconds an episode may take; past it, it is a fault"
    )
    on_fault: Literal["zero", "drop"] = Field(
        "zero",
        description="a faulted episode (raised, timed out, bad return or request, no call): "
        "its sample scored 0 (zero) or left out of the batch (drop)",
    )
    max_context_tokens: int = Field(
        1024,
        gt=0,
        description="tokens a call's prompt may have; a longer one is refused (a fault), and "
        "the widest training sequence is this plus rollout.max_new_tokens",
    )

    @field_validator("function")
    @classmethod
    def _loadable(cls, spec: str) -> str:
        if spec:
            load_spec(spec, "rollout.agent.function")  # raises naming it
        return spec


class RolloutConfig(Section):
    name: RolloutBackend = Field(
        "hf",
        description="rollout backend: a decoding loop on the transformers model (StaticCache), "
        "or vLLM in its own environment (scripts/setup_vllm.sh)",
    )
    n: int = Field(4, gt=0, description="samples per prompt")
    temperature: float = Field(1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; 1 = off")
    top_k: int = Field(0, ge=0, description="0 = off")
    max_new_tokens: int = Field(
        32, gt=0, description="longest response in tokens (multi-turn: per assistant turn)"
    )
    micro_batch_size: int = Field(
        64,
        gt=0,
        description="most sequences decoding at once (vllm: max_num_seqs); hf: one that ends "
        "frees its slot for the next (continuous batching)",
    )
    continuous_batching: bool = Field(
        True,
        description="hf backend: a queued sequence joins as soon as slots are free; false: "
        "once the batch is empty (what runs on different rank counts need to sample the same "
        "tokens: a row's float rounding depends on the rows beside it)",
    )
    prefix_cache_mb: int = Field(
        1024,
        ge=0,
        description="hf backend: MB of keys and values kept between the turns of multi-turn "
        "trajectories, so each turn prefills only its new tokens (least recently used evicted "
        "first; dropped when the weights change); 0 = prefill every turn's whole context",
    )
    val: ValSamplingConfig = Field(default_factory=ValSamplingConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)


class RefConfig(Section):
    log_prob_micro_batch_size: int = Field(
        16, gt=0, description="samples per forward of the reference policy"
    )


class CriticConfig(Section):
    model_path: str | None = Field(
        None,
        description="None = initialise from the policy",
        json_schema_extra=reads("run", "update"),
    )
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = Field(32, gt=0, description="samples per critic optimizer step")
    ppo_micro_batch_size: int = Field(8, gt=0, description="samples per critic forward/backward")
    ppo_epochs: int = Field(1, gt=0, description="critic passes over a step's samples")
    cliprange_value: float = Field(0.5, gt=0, description="value clip around the old values")
    skip_nonfinite_steps: bool = Field(
        False, description="as actor.skip_nonfinite_steps, for the critic's optimizer steps"
    )
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

    @field_validator("function")
    @classmethod
    def _loadable(cls, spec: str | None) -> str | None:
        """Import it now: a missing or broken module is named before anything starts."""
        if spec is not None:
            load_spec(spec, "reward.function")
        return spec

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


class RolloutCorrectionConfig(Section):
    """Train/rollout mismatch correction (verl 0.9, decoupled): the rollout records its own
    log-probs; the advantage stage compares them with the training log-probs and weights
    (IS) or drops (rejection) tokens. Off unless `level` or `rejection_modes` is set."""

    level: ISLevel | None = Field(
        None, description="importance weights per token or per sequence; None = no weights"
    )
    threshold: float | str = Field(
        2.0, description="IS: a number truncates (TIS); 'lower_upper' zeroes outside (IcePop)"
    )
    batch_normalize: bool = Field(False, description="IS: rescale the weights to mean 1")
    rejection_modes: str | None = Field(
        None,
        description="comma-separated registered rejection modes; None = no rejection",
        json_schema_extra={"registry": "REJECTION_MODES"},
    )
    rejection_thresholds: float | str = Field(
        "0.5_2.0",
        description="one per mode or one for all: k1 'lower_upper' ratio band, k2/k3 an upper "
        "bound",
    )

    @property
    def enabled(self) -> bool:
        return self.level is not None or self.rejection_modes is not None

    @model_validator(mode="after")
    def _check(self) -> RolloutCorrectionConfig:
        if not self.enabled:
            return self
        from hybrid_engine.bands import parse_is_threshold, parse_rejection

        if self.level is not None:
            try:
                parse_is_threshold(self.threshold)
            except ValueError as e:
                raise ValueError(f"algorithm.rollout_correction.threshold: {e}") from None
        if self.rejection_modes is not None:
            try:
                parse_rejection(self.rejection_modes, self.rejection_thresholds)
            except ValueError as e:
                raise ValueError(f"algorithm.rollout_correction.rejection_*: {e}") from None
        return self


class FilterGroupsConfig(Section):
    """DAPO dynamic sampling: train only on prompt groups whose samples disagree; roll out
    further generation batches (the next prompts of the data order) until
    data.train_batch_size such groups are found."""

    enabled: bool = Field(False, description="drop prompt groups whose samples all agree")
    metric: Literal["acc", "score"] = Field(
        "acc",
        description="what must vary within a group: acc (scorer says correct) or score "
        "(scorer + overlong penalty)",
    )
    max_num_gen_batches: int = Field(
        0, ge=0, description="generation batches per step at most; 0 = no limit"
    )
    adaptive_rounds: bool = Field(
        True,
        description="each round rolls out, in one generate call, the whole generation "
        "batches that hold the prompts a kept rate says the missing groups take: the first "
        "round the previous step's rate, later ones the step's own so far; at most "
        "rollout.micro_batch_size / rollout.n prompts; false: one batch per round (verl)",
    )
    on_exhausted: Literal["fail", "train"] = Field(
        "fail",
        description="at the limit with too few groups: fail (as verl's DAPO recipe) or train, "
        "filling the batch with filtered-out groups",
    )


class AlgorithmConfig(Section):
    plugins: list[str] = Field(
        default_factory=list,
        description="modules imported before the config is checked (and in every pool worker) "
        "whose decorators register more estimators or policy losses",
    )
    adv_estimator: AdvEstimatorName = Field(
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
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = Field(
        default_factory=FilterGroupsConfig, json_schema_extra=reads("rollout", "advantage")
    )
