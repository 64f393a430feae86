"""What leaves the engine as files for other tools: the LoRA adapter as peft saves it
(`PeftModel.from_pretrained(base, dir)` loads it back). `storage/` writes a run's final
policy with it, without reaching into `models/`."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from hybrid_engine.config.training import LoraSettings
from hybrid_engine.models.lora import ADAPTER, lora_config


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
