"""Packed log-probs (no padding, each prompt computed once for its samples) equal the padded
batch's, values and gradients, on a tiny model."""

import torch

from hybrid_engine.config import ModelConfig
from hybrid_engine.models.loading import load_policy
from hybrid_engine.models.logprobs import packed_response_log_probs, response_log_probs


def grpo_like_batch(pad: int, eos: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """3 prompts (left-padded, lengths 5, 7, 3) x 4 samples, right-padded responses of 1-6
    tokens, plus one lone prompt with 1 sample: input_ids, attention_mask, response length."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (n,), generator=g) for n in (5, 7, 3, 4)]
    samples = [4, 4, 4, 1]
    width, resp_len = 7, 6
    ids, mask = [], []
    for p, k in zip(prompts, samples, strict=True):
        for _ in range(k):
            n = int(torch.randint(1, resp_len + 1, (1,), generator=g))
            r = torch.randint(3, 90, (n,), generator=g)
            r[-1] = eos if n < resp_len else r[-1]
            left = width - len(p)
            ids.append(
                torch.cat([torch.full((left,), pad), p, r, torch.full((resp_len - n,), pad)])
            )
            mask.append(
                torch.cat(
                    [torch.zeros(left), torch.ones(len(p) + n), torch.zeros(resp_len - n)]
                ).long()
            )
    return torch.stack(ids), torch.stack(mask), resp_len


def test_packed_log_probs_and_gradients_equal_the_padded_ones(tokenizer):
    model = load_policy(ModelConfig(path="tiny"), tokenizer, seed=0).train()
    ids, mask, n = grpo_like_batch(tokenizer.pad_token_id, tokenizer.eos_token_id)
    resp_mask = mask[:, -n:].float()
    results = []
    for fn in (response_log_probs, packed_response_log_probs):
        model.zero_grad()
        logp, ent = fn(model, ids, mask, n, 0.7, True)
        ((logp * resp_mask).sum() + (ent * resp_mask).sum() * 0.1).backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        results.append((logp * resp_mask, ent * resp_mask, grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert torch.allclose(lp_a, lp_b, atol=1e-5), (lp_a - lp_b).abs().max()
    assert torch.allclose(ent_a, ent_b, atol=1e-4), (ent_a - ent_b).abs().max()
    for k in g_a:
        assert torch.allclose(g_a[k], g_b[k], atol=1e-5, rtol=1e-4), (
            k,
            (g_a[k] - g_b[k]).abs().max(),
        )
