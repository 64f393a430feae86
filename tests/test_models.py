import math

import pytest
import torch

from hybrid_engine.config import ModelConfig
from hybrid_engine.models.loading import load_critic, load_policy, resolve_model_path
from hybrid_engine.models.logprobs import (
    head_log_probs,
    head_log_probs_against_autograd,
    position_ids_from_mask,
    response_log_probs,
)

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


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


@pytest.mark.parametrize("terms", [("logp", "entropy"), ("logp",), ("entropy",)])
def test_head_log_probs_values_and_gradients_equal_autograd(terms):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300)  # with a bias; 70 rows span three chunks of 32
    with torch.no_grad():
        head.weight.copy_(torch.randn(300, 16, generator=g))
    hidden = torch.randn(70, 16, generator=g)
    targets = torch.randint(0, 300, (70,), generator=g)
    weights = {"logp": torch.randn(70, generator=g), "entropy": torch.randn(70, generator=g)}
    pairs = head_log_probs_against_autograd(
        head, hidden, targets, 0.7, {t: weights[t] for t in terms}
    )
    for name, (want, got) in pairs.items():
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
    # the entropy of uniform logits is log(vocab), its maximum
    assert float(pairs["entropy"][1].max()) <= math.log(300) + 1e-5
    zero = torch.nn.Linear(16, 300, bias=False)
    torch.nn.init.zeros_(zero.weight)
    _, uniform = head_log_probs(zero, hidden[:3], targets[:3], with_entropy=True)
    torch.testing.assert_close(uniform, torch.full((3,), math.log(300)))


def test_head_log_probs_cannot_backward_twice():
    """The backward writes dL/dz over the saved logits: a second pass must fail, not lie."""
    head = torch.nn.Linear(4, 10)
    logp, _ = head_log_probs(head, torch.randn(5, 4), torch.zeros(5, dtype=torch.long))
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()
