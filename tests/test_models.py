import pytest
import torch

from hybrid_engine.config import ModelConfig
from hybrid_engine.models import (
    load_critic,
    load_policy,
    position_ids_from_mask,
    resolve_model_path,
    response_log_probs,
)


def test_local_directory_policy_and_critic_initialised_from_it(tmp_path, tokenizer):
    tiny = load_policy(ModelConfig(path="tiny"), tokenizer, seed=3)
    tiny.save_pretrained(tmp_path)
    cfg = ModelConfig(path=str(tmp_path))
    policy = load_policy(cfg, tokenizer, seed=0)
    for k, v in tiny.state_dict().items():
        assert torch.equal(v, policy.state_dict()[k]), k
    critic = load_critic(cfg, None, tokenizer, seed=0)
    backbone = critic.backbone.state_dict()
    for k, v in tiny.model.state_dict().items():
        assert torch.equal(v, backbone[k]), k
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones_like(ids)
    values = critic(ids, mask, position_ids_from_mask(mask), keep=3)
    assert values.shape == (2, 3) and values.dtype == torch.float32


def test_bad_model_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path="):
        resolve_model_path(str(tmp_path))


def test_response_log_probs_match_a_full_forward(tokenizer):
    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0)
    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on row 0
    logp, ent = response_log_probs(model, ids, mask, response_len=4, with_entropy=True)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask))
    ref = full.logits.log_softmax(-1)[:, -5:-1].gather(-1, ids[:, -4:, None]).squeeze(-1)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    p = full.logits[:, -5:-1].softmax(-1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=1e-4, atol=1e-4)
    assert torch.equal(position_ids_from_mask(mask)[0, 3:], torch.arange(6))
