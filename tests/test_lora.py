"""LoRA on the actor (peft): only the adapters train, the frozen base is the reference,
checkpoints hold only the adapters, the export offers merged weights and the adapter."""

import math

import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_engine import SIGNAL, params

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.export import adapter_files
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.logprobs import response_log_probs

LORA = [SIGNAL, "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2"]


def engine_with(*extra):
    return Engine(load_config("configs/grpo_tiny.yaml", [*LORA, *extra]))


def test_only_adapters_train_and_the_frozen_base_is_the_reference():
    engine = engine_with("actor.use_kl_loss=true")
    actor = engine.actor
    assert actor.ref is None  # no second copy of the weights
    trainable = [n for n, p in actor.policy.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert actor.info()["trainable_params"] < actor.info()["local_params"] / 20
    before = params(actor.policy)
    batch = engine.advantage(engine.reward(engine.rollout(1)))
    # the reference log-probs are the base model's: a fresh copy of it gives the same numbers
    base = load_policy(engine.cfg.model, engine.tokenizer, engine.cfg.trainer.seed)
    n = batch["response_mask"].shape[1]
    want, _ = response_log_probs(base, batch["input_ids"], batch["attention_mask"], n)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["ref_log_prob"][mask], want[mask], atol=1e-5, rtol=0)
    metrics = engine.update(batch).meta["metrics"]
    assert math.isfinite(metrics["actor/kl_loss"])
    after = params(actor.policy)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == {k for k in trainable if ".lora_A." in k or ".lora_B." in k}
    # B starts at zero, so the first step moved B; the reference stays the base afterwards
    again = engine.advantage(engine.reward(engine.rollout(2)))
    want2, _ = response_log_probs(
        base, again["input_ids"], again["attention_mask"], again["response_mask"].shape[1]
    )
    m2 = again["response_mask"].bool()
    torch.testing.assert_close(again["ref_log_prob"][m2], want2[m2], atol=1e-5, rtol=0)
    assert not torch.allclose(again["old_log_probs"][m2], again["ref_log_prob"][m2])


def test_adapter_only_checkpoint_round_trip_continues_exactly(tmp_path):
    a = engine_with()
    a.step(1)
    files = a.actor.save(str(tmp_path / "ckpt"))
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert saved and all(".lora_" in k for k in saved)  # only the adapters
    optim = load_file(tmp_path / "ckpt" / "optim.safetensors")
    assert all(".lora_" in k for k in optim)
    b = engine_with()
    assert b.actor.load(str(tmp_path / "ckpt"), expected=files) == 1
    a.step(2), b.step(2)
    wa, wb = params(a.actor.policy), params(b.actor.policy)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_export_merges_the_adapters_and_writes_peft_files(tmp_path):
    engine = engine_with()
    engine.step(1)
    model, state = engine.export()
    assert not any("lora" in k for k in model.state_dict())  # a plain transformers model
    batch = engine.rollout(2)
    n = batch["response_mask"].shape[1]
    live, _ = response_log_probs(
        engine.actor.policy, batch["input_ids"], batch["attention_mask"], n
    )
    merged, _ = response_log_probs(model, batch["input_ids"], batch["attention_mask"], n)
    torch.testing.assert_close(merged, live, atol=1e-5, rtol=0)
    adapter_files(str(tmp_path), state, engine.cfg.actor.lora)
    base = load_policy(engine.cfg.model, engine.tokenizer, engine.cfg.trainer.seed)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path))
    again, _ = response_log_probs(
        peft_model.base_model.model, batch["input_ids"], batch["attention_mask"], n
    )
    torch.testing.assert_close(again, live, atol=1e-5, rtol=0)
