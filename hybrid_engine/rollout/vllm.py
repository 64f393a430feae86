"""The `vllm` rollout backend: `generate(batch, sampling) -> Batch` on a colocated vLLM engine.

Same contract as `HFRollout.generate` (see `rollout.py`), plus `rollout_log_probs`: vLLM's own
log-prob of every sampled token (0 on padding). For the hybrid engine it also offers
- `sleep()` / `wake_up()`: level-1 sleep offloads the weights to CPU and drops the KV cache, so
  the trainer has the GPU memory between rollouts;
- `load_weights(named_tensors)`: pushes full, HF-named tensors into the running engine in place
  (no disk, no reload); vLLM's own `model.load_weights` shards them for tensor parallelism.

vLLM is imported lazily: this module imports without it (the CPU environment cannot hold vLLM,
which pins a CUDA torch). Written against vLLM's V1 engine (~0.33) from its source, see the notes
at each call; it is not verified on a GPU in this repo unless `bench/vllm_check.py` or the GPU
tests in `tests/test_rollout_vllm.py` have been run on one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from hybrid_engine.batch import Batch
from hybrid_engine.config import HybridConfig
from hybrid_engine.models.loading import resolve_model_path
from hybrid_engine.registry import ROLLOUT_BACKENDS
from hybrid_engine.rollout.base import SamplingParams, response_mask_from_ids, with_responses

# Weights travel to the engine in buckets of at most this many bytes (one RPC per bucket).
BUCKET_BYTES = 512 * 2**20


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


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """Log-prob of each sampled token from a vLLM `CompletionOutput.logprobs` (0 if absent).

    `logprobs` is one mapping token id -> `Logprob` (with `.logprob`) per position, a list of
    dicts or vLLM's `FlatLogprobs`, which indexes the same way.
    """
    if logprobs is None:
        return [0.0] * len(token_ids)
    return [float(logprobs[i][tok].logprob) for i, tok in enumerate(token_ids)]


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int, to_cpu: bool
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of (name, tensor) of at most `max_bytes` (a larger tensor goes alone).

    With `to_cpu` each tensor is detached into its own contiguous CPU copy (what pickling to
    another process needs); otherwise tensors are passed as they are (no copy).
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        t = tensor.detach()
        if to_cpu:
            t = t.to("cpu", copy=True).contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (via `LLM.collective_rpc`): load HF-named tensors in place.

    `worker.get_model()` is what `LLM.apply_model` uses (`vllm/v1/worker/worker_base.py`,
    `WorkerBase.apply_model`; `WorkerWrapperBase.__getattr__` forwards to the worker). vLLM's
    `model.load_weights(iterable of (name, tensor))` maps HF names onto its fused, TP-sharded
    parameters and copies into them, so CUDA graphs keep pointing at the same storage.
    """
    model = worker.get_model()
    with torch.no_grad():
        model.load_weights(iter(weights))
    return len(weights)


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(
            "rollout.name=vllm needs the `vllm` package (GPU extra: pip install 'hybridrl[vllm]' "
            "on a CUDA machine); use rollout.name=hf otherwise"
        ) from e
    if not torch.cuda.is_available():
        raise RuntimeError(
            "rollout.name=vllm needs a CUDA GPU and none is visible; use rollout.name=hf"
        )
    return vllm


# --------------------------------------------------------------------------- the backend
@ROLLOUT_BACKENDS.register("vllm", in_place=False, tensor_parallel=True, separate_group=False)
class VLLMRollout:
    """A vLLM engine colocated with the trainer: generate, sleep/wake, weights pushed in place.

    vLLM API relied on (read in vllm-project/vllm, V1 engine):
    - `vllm/entrypoints/llm.py`: `LLM(model, tensor_parallel_size, dtype, seed,
      gpu_memory_utilization, **EngineArgs)` with `enable_sleep_mode=True`;
      `LLM.generate(prompts, sampling_params, use_tqdm=)` (a list of params pairs one-to-one
      with the prompts; outputs come back in prompt order); `LLM.sleep(level=1)` (resets the
      prefix cache, offloads weights, discards the KV cache); `LLM.wake_up(tags=)` with tags
      in ("weights", "kv_cache"); `LLM.collective_rpc(fn, args=)`; `LLM.reset_prefix_cache()`.
    - `vllm/v1/worker/gpu_worker.py`: `Worker.sleep` / `Worker.wake_up` (CuMemAllocator pools
      tagged "weights" and "kv_cache"); only one sleep-mode engine per process.
    - `vllm/v1/executor/uniproc_executor.py` + `vllm/v1/serial_utils.py::run_method`: with the
      engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and one worker,
      `collective_rpc(fn, args)` calls `fn(worker, *args)` directly: tensors are passed by
      reference. With the default multiprocess engine core, utility-call arguments go through
      msgpack (`MsgpackDecoder` does not rebuild untyped tensors, and functions need
      VLLM_ALLOW_INSECURE_SERIALIZATION=1), so this backend forces the in-process core.
    - `vllm/v1/executor/multiproc_executor.py` (TP > 1): `collective_rpc` cloudpickles the
      function and pickles the arguments to each worker process, so weights are sent as CPU
      copies in buckets.
    """

    @classmethod
    def build(cls, cfg: HybridConfig, module: Any, tokenizer: Any) -> VLLMRollout:
        """The backend of `rollout.name: vllm`: an engine started from the model's files
        (the trainer's weights are pushed in later), asleep until the first rollout."""
        tp = cfg.actor.layout.rollout.tp
        engine = cls(
            str(resolve_model_path(cfg.model.path)),
            tp,
            tokenizer.pad_token_id,
            tokenizer.eos_token_id,
            dtype=cfg.model.dtype,
            seed=cfg.trainer.seed,
            distributed_executor_backend="external_launcher" if tp > 1 else None,
        )
        engine.sleep()  # the trainer has the GPU until the first rollout
        return engine

    def __init__(
        self,
        model_path: str,
        tensor_parallel_size: int,
        pad_token_id: int,
        eos_token_id: int,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "bfloat16",
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine on `model_path` (a HF directory with tokenizer files).

        `engine_kwargs` go to `vllm.LLM` over these defaults: `enable_sleep_mode=True`,
        `logprobs_mode="processed_logprobs"` (log-probs after temperature / top-k / top-p, the
        distribution actually sampled from); a value of None drops a key.
        """
        vllm = _import_vllm()
        # The engine core must live in this process for collective_rpc to pass tensors and
        # functions by reference (see the class docstring). Read when the engine starts.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs: dict[str, Any] = {
            "enable_sleep_mode": True,
            "logprobs_mode": "processed_logprobs",
            **engine_kwargs,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        llm = vllm.LLM(
            model=str(model_path),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            seed=seed,
            **kwargs,
        )
        # One worker in this process (TP=1, or one rank of an external launcher): in-process.
        in_process = (
            tensor_parallel_size == 1
            or kwargs.get("distributed_executor_backend") == "external_launcher"
        )
        self._attach(llm, vllm.SamplingParams, pad_token_id, eos_token_id, in_process)

    def _attach(
        self,
        llm: Any,
        sampling_params_cls: Callable[..., Any],
        pad_token_id: int,
        eos_token_id: int,
        in_process: bool,
    ) -> None:
        self.llm = llm
        self._sampling_params_cls = sampling_params_cls
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.in_process = in_process
        self.sleeping = False

    # ------------------------------------------------------------------ rollout
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """One response per row (rows already repeated n times). Wakes the engine if asleep."""
        self.wake_up()
        pad, eos = self.pad_token_id, self.eos_token_id
        prompts = strip_left_padding(batch["prompt_ids"], batch["prompt_mask"])
        row_offset = int(batch.meta.get("row_offset", 0))
        params = [
            self._sampling_params_cls(**kw)
            for kw in vllm_sampling_kwargs(sampling, eos, row_offset, len(prompts))
        ]
        if "row_seed" in batch and not sampling.greedy:  # the agent endpoint's own seeds
            for p, seed in zip(params, batch["row_seed"].tolist(), strict=True):
                p.seed = seed
        start = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        seconds = time.perf_counter() - start
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")

        token_lists, logprob_lists = [], []
        for out in outputs:
            completion = out.outputs[0]
            toks = [int(t) for t in completion.token_ids]
            token_lists.append(toks)
            logprob_lists.append(sampled_logprobs(toks, completion.logprobs))
        response_ids, response_mask, rollout_log_probs = assemble_outputs(
            token_lists, logprob_lists, pad, eos
        )
        out = with_responses(
            batch, response_ids, response_mask, rollout_log_probs=rollout_log_probs
        )
        tokens = int(response_mask.sum())
        out.meta.update(
            gen_tokens=tokens,
            gen_seconds=seconds,
            gen_tokens_per_s=tokens / max(seconds, 1e-9),
        )
        return out

    # ------------------------------------------------------------- sleep / wake
    def sleep(self) -> None:
        """Level-1 sleep: weights offloaded to CPU memory, KV cache dropped (GPU memory freed)."""
        if not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self) -> None:
        """Weights back on the GPU and a fresh (empty) KV cache."""
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    # ------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy full HF-named tensors into the running engine; returns how many were loaded.

        When asleep, the weights pool is woken first (loading into offloaded memory would write
        to unmapped addresses), then the KV cache: the engine is awake afterwards. The prefix
        cache is reset, since its blocks were computed with the old weights.
        """
        was_sleeping = self.sleeping
        if was_sleeping:
            self.llm.wake_up(tags=["weights"])
        loaded = 0
        try:
            for bucket in weight_buckets(named_tensors, BUCKET_BYTES, to_cpu=not self.in_process):
                counts = self.llm.collective_rpc(load_weights_on_worker, args=(bucket,))
                loaded += int(counts[0])
        finally:  # leave the engine fully awake, even after a failed load
            if was_sleeping:
                self.llm.wake_up(tags=["kv_cache"])
                self.sleeping = False
            self.llm.reset_prefix_cache()
        return loaded
