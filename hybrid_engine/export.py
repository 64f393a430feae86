"""What leaves the engine for other tools: the policy as a plain transformers module
(`policy_module`), and the LoRA adapter as peft saves it (`adapter_files`;
`PeftModel.from_pretrained(base, dir)` loads it back). `storage/` writes a run's final
policy with them, without reaching into `models/`."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file

from hybrid_engine.config import HybridConfig
from hybrid_engine.config.training import LoraSettings
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.lora import ADAPTER, lora_config, merged_state_dict


def policy_module(
    cfg: HybridConfig, actor: Any, tokenizer: Any
) -> tuple[torch.nn.Module, dict[str, torch.Tensor] | None]:
    """The policy `actor` holds as a plain HF module in this process (for saving), and with
    LoRA the full state dict whose adapter tensors `adapter_files` writes (the module then
    holds the adapters merged into the base weights). A local actor without LoRA hands over
    its own module; a pool's is rebuilt here from its gathered state dict."""
    lora = cfg.actor.lora
    if cfg.trainer.backend != "ray" and not lora.rank:
        return actor.policy, None
    state = actor.full_state_dict()
    model = load_policy(cfg.model, tokenizer, cfg.trainer.seed)
    if not lora.rank:
        model.load_state_dict(state)
        return model, None
    model.load_state_dict(merged_state_dict(state, lora_config(lora)))
    return model, state


def adapter_files(
    directory: str,
    model_state: dict[str, torch.Tensor],
    settings: LoraSettings,
    base_model: str | None = None,
) -> None:
    """`adapter_config.json` + `adapter_model.safetensors` as `PeftModel.save_pretrained`
    writes them, from the adapter tensors of a full state dict (renamed as peft names them:
    a `base_model.model.` prefix, no adapter name); `base_model` is recorded as the base."""
    config = lora_config(settings)
    config.base_model_name_or_path = base_model
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    tensors = {
        f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": v.contiguous()
        for k, v in model_state.items()
        if ".lora_" in k
    }
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
