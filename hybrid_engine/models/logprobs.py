"""Log-probs over response tokens: the LM head's log-softmax in row chunks (a custom autograd
function that never holds the full logits), for padded and for packed batches."""

from __future__ import annotations

import torch
from torch import nn
from transformers import (
    PreTrainedModel,
)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


Temperature = float | torch.Tensor  # one for all tokens, or (rows, response_len) per token


def response_log_probs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: Temperature = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_t | x, y_<t) for the last `response_len` tokens, and optionally their entropy,
    at `temperature` (a float, or one per response token).

    The model runs without its LM head; `head_log_probs` applies it to the positions that
    predict response tokens.
    """
    rows, width = input_ids.shape
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=torch.zeros(rows, width, dtype=torch.bool, device=input_ids.device),
        output_hidden_states=True,
        use_cache=False,
    )
    hidden = out.hidden_states[-1][:, -response_len - 1 : -1]  # (rows, response_len, hidden)
    logp, ent = head_log_probs(
        model.get_output_embeddings(),
        hidden.reshape(-1, hidden.shape[-1]),
        input_ids[:, -response_len:].reshape(-1),
        temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else temperature,
        with_entropy,
    )
    return logp.view(rows, response_len), None if ent is None else ent.view(rows, response_len)


def head_log_probs(
    head: nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: Temperature = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z)[target] and H = -sum_v p_v log p_v for z = head(hidden) / temperature,
    per row of `hidden` (tokens, hidden size), `head` being the LM head (a Linear layer), the
    temperature a float or one per row; the entropy keeps its gradient too.

    The same values and gradients as autograd through `log_softmax`, at a fraction of the
    memory traffic: the vocabulary-sized work runs on row chunks that stay in cache, and the
    backward pass writes dL/dz over the saved logits (see `_HeadLogProbs`).
    """
    return _HeadLogProbs.apply(hidden, head.weight, head.bias, targets, temperature, with_entropy)


_CHUNK_ROWS = 32  # 32 x 49k float32 logits = 6 MB: the L2 caches of two cores (bench: 16-64 alike)


class _HeadLogProbs(torch.autograd.Function):
    """z = (h Wᵀ + b) / T;  logp = z[y] - logsumexp(z);  H = -Σ_v p_v log p_v, p = softmax(z).

    Gradients, with E[z] = Σ_v p_v z_v (so z - E[z] = log p + H):
      dlogp/dz = onehot(y) - p          dH/dz = -p (z - E[z])
    so dL/dz = g (onehot(y) - p) - g_H p (z - E[z]), which the backward computes chunk by
    chunk into the saved z (freed afterwards anyway), then dL/dh = dL/dz W / T and
    dL/dW = (dL/dz)ᵀ h / T. A loss that leaves the entropy out (g_H = None) skips its term.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy):
        z = torch.nn.functional.linear(hidden, weight, bias).float()
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(z.device, torch.float32)[:, None]
            z.div_(temperature)
        elif temperature != 1.0:
            z.div_(temperature)
        lse = torch.empty(len(z), device=z.device)
        ent = torch.empty_like(lse) if with_entropy else None
        for c in range(0, len(z), _CHUNK_ROWS):
            zc = z[c : c + _CHUNK_ROWS]
            lse[c : c + _CHUNK_ROWS] = torch.logsumexp(zc, -1)
            if ent is not None:  # H = -Σ p log p, log p = z - lse: no cancellation
                log_p = zc - lse[c : c + _CHUNK_ROWS, None]
                ent[c : c + _CHUNK_ROWS] = -(log_p.exp() * log_p).sum(-1)
        logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
        ctx.save_for_backward(hidden, weight, bias, z, targets, lse, ent)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, z, targets, lse, ent = ctx.saved_tensors
        for c in range(0, len(z), _CHUNK_ROWS):
            rows = slice(c, c + _CHUNK_ROWS)
            zc = z[rows]
            log_p = zc - lse[rows, None]
            p = log_p.exp()
            # autograd calls this with at least one of the two gradients defined
            coef = 0.0 if g_logp is None else -g_logp[rows, None]
            if g_ent is not None:  # z - E[z] = log p + H
                coef = coef - g_ent[rows, None] * log_p.add_(ent[rows, None])
            p.mul_(coef)
            if g_logp is not None:
                p.scatter_add_(-1, targets[rows, None], g_logp[rows, None])
            zc.copy_(p)
        t = ctx.temperature
        scaled = isinstance(t, torch.Tensor) or t != 1.0
        grad_z = (z.div_(t) if scaled else z).to(weight.dtype)
        grad_h = grad_z @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_z.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_b = grad_z.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b, None, None, None


def head_log_probs_against_autograd(
    head: nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    weights: dict[str, torch.Tensor | float],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`head_log_probs`' values and gradients beside plain autograd through `log_softmax`
    (the check the tests and `bench/gpu_check.py` run): {name: (autograd, fused)} for
    logp, entropy, d/dh, d/dW (and d/db), the loss being sum(weights[term] * term)."""
    results = []
    for fused in (False, True):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        if fused:
            logp, ent = head_log_probs(head, h, targets, temperature, with_entropy=True)
        else:
            logp_all = (head(h) / temperature).log_softmax(-1)
            logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
        out = {"logp": logp, "entropy": ent}
        # a term left out is outside the graph: the fused backward gets None for it
        sum((w * out[t]).sum() for t, w in weights.items()).backward()
        grads = [h.grad, head.weight.grad] + ([] if head.bias is None else [head.bias.grad])
        results.append([logp.detach(), ent.detach(), *grads])
    names = ["logp", "entropy", "d/dh", "d/dW", "d/db"]
    return {n: (a, b) for n, a, b in zip(names, *results, strict=False)}


def repeats_previous_row(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(rows,) True where a row's tokens and mask equal the row before it (GRPO's samples of
    one prompt sit in consecutive rows)."""
    same = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    same[1:] = (ids[1:] == ids[:-1]).all(-1) & (mask[1:] == mask[:-1]).all(-1)
    return same


def packed_response_log_probs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: Temperature = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` without padding inside a group, each prompt computed once.

    Rows (left-padded prompt | right-padded response) that repeat the prompt of the row before
    them (GRPO's n samples) form a group, and each group becomes one packed row: its prompt's
    real tokens, then each sample's real response tokens, with positions that restart after
    the prompt for every response. A block attention mask lets a response see its prompt and
    its own earlier tokens, nothing else; packed rows are right-padded to the longest one, so
    attention costs groups x length² rather than (all tokens)². The LM head runs only on the
    positions that predict a response token (`head_log_probs`); a response's first token is
    predicted from its prompt's last position, shared by the group. Returns the
    same (rows, response_len) tensors as `response_log_probs` (0 where the response is pad)."""
    device = input_ids.device
    rows, width = input_ids.shape
    p_len = width - response_len
    prompt, p_mask = input_ids[:, :p_len], attention_mask[:, :p_len]
    resp, r_mask = input_ids[:, p_len:], attention_mask[:, p_len:].bool()
    new_group = ~repeats_previous_row(prompt, p_mask)
    ids: list[list[torch.Tensor]] = []  # per group: token pieces
    pos: list[list[torch.Tensor]] = []
    owner: list[list[torch.Tensor]] = []  # per token: its response's row, -1 on the prompt
    src_of = []  # per row: (group, position in the group) predicting each response token
    for r in range(rows):
        if new_group[r]:
            real = prompt[r][p_mask[r].bool()]
            ids.append([real])
            pos.append([torch.arange(len(real), device=device)])
            owner.append([torch.full((len(real),), -1, device=device)])
            n_prompt = start = len(real)
        toks = resp[r][r_mask[r]]
        ids[-1].append(toks)
        pos[-1].append(n_prompt + torch.arange(len(toks), device=device))
        owner[-1].append(torch.full((len(toks),), r, device=device))
        before = start - 1 + torch.arange(len(toks), device=device)  # the previous token
        before[:1] = n_prompt - 1  # the first response token follows the prompt
        src_of.append(torch.stack([torch.full_like(before, len(ids) - 1), before]))
        start += len(toks)
    length = max(sum(len(t) for t in g) for g in ids)

    def packed(pieces: list[list[torch.Tensor]], pad: int) -> torch.Tensor:
        rows = [torch.cat(g) for g in pieces]
        return torch.stack(
            [torch.nn.functional.pad(t, (0, length - len(t)), value=pad) for t in rows]
        )

    ids_t, pos_t, row = packed(ids, 0), packed(pos, 0), packed(owner, -2)  # -2: padding
    # a token sees the earlier tokens of its packed row that are the prompt or its own response
    # (a padding token sees the prompt and the padding: nothing real reads it)
    visible = (row[:, None, :] == -1) | (row[:, :, None] == row[:, None, :])
    mask4d = (visible & torch.ones_like(visible[0]).tril())[:, None]
    srcs = torch.cat(src_of, 1)
    out = model(
        input_ids=ids_t,
        attention_mask=mask4d,
        position_ids=pos_t,
        logits_to_keep=torch.zeros_like(row, dtype=torch.bool),
        output_hidden_states=True,
        use_cache=False,
    )
    hidden = out.hidden_states[-1][srcs[0], srcs[1]]  # one row per response token
    head = model.get_output_embeddings()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature[r_mask]
    lp, ent = head_log_probs(head, hidden, resp[r_mask], temperature, with_entropy)
    logp = torch.zeros(rows, response_len, dtype=lp.dtype, device=device).masked_scatter(r_mask, lp)
    entropy = None if ent is None else torch.zeros_like(logp).masked_scatter(r_mask, ent)
    return logp, entropy
