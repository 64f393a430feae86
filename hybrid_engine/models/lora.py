"""LoRA on the policy with `peft`: low-rank adapters train, the base weights stay frozen.

    W x  ->  W x + (alpha / r) B A x        A: r x in (random), B: out x r (zeros at start)

`add_lora` injects the adapters into the transformers model in place (it stays a
`LlamaForCausalLM`, so generation, packing and FSDP see the same module tree). The frozen base
doubles as the reference policy: `adapters_disabled` switches the adapters off for a forward
pass, so KL to the reference needs no second copy of the weights. Only the adapters are
trainable, so the optimizer state and checkpoints hold only them (the base is rebuilt from
`model.path`). For export, `merged_state_dict` folds the adapters into the base weights under
the plain model's names (`hybrid_engine.export.adapter_files` writes the adapter alone).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from hybrid_engine.config.training import LoraSettings

ADAPTER = "default"  # peft's name of the one adapter


def lora_config(settings: LoraSettings) -> LoraConfig:
    """peft's config from `actor.lora`."""
    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_lora(model: nn.Module, config: LoraConfig, seed: int) -> nn.Module:
    """Inject the adapters (A drawn from `seed`, B zero: the policy starts as the base) and
    freeze everything else. Raises when `target_modules` matches no layer."""
    torch.manual_seed(seed)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:
        raise ValueError(f"actor.lora.target_modules={config.target_modules}: {e}") from None
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model: every adapter off inside the block (the reference policy)."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)  # makes the adapters trainable again


def lora_scaling(config: LoraConfig) -> float:
    return config.lora_alpha / config.r


def merged_state_dict(full: dict[str, torch.Tensor], config: LoraConfig) -> dict[str, torch.Tensor]:
    """Plain model weights from a full state dict with adapters: W + (alpha / r) B A under
    the base layer's own name, adapter tensors dropped."""
    scale = lora_scaling(config)
    out = {}
    for key, value in full.items():
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        if ".base_layer." in key and key.endswith(".weight"):
            prefix = key[: -len("base_layer.weight")]
            a = full[f"{prefix}lora_A.{ADAPTER}.weight"]
            b = full[f"{prefix}lora_B.{ADAPTER}.weight"]
            value = value + (b.float() @ a.float()).to(value.dtype) * scale
        out[name] = value
    return out
