"""The side of the `vllm` rollout that runs in the vLLM environment (a Ray actor there).

This module is imported by that environment's Python, which holds vLLM's own torch and
transformers but none of this project's dependencies: it imports only the standard library
at module level, and vLLM, torch and numpy inside the methods. Only plain data crosses the
actor boundary: token id lists, log-prob lists, weight names with numpy arrays.

- `VLLMServer`: one engine (`vllm.LLM`) with its engine core in the actor's own process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no grandchild process to outlive the actor, and
  `collective_rpc` reaches the worker directly), prefix caching off and a fixed
  `max_num_seqs`, so that the same request on the same weights gives the same tokens.
- `WeightsExtension`: vLLM's `worker_extension_cls`; `push_weights` hands the arrays to
  `model_runner.reload_weights(..., is_checkpoint_format=True)`, which re-runs the CPU
  backend's weight prepacking (plain `model.load_weights` fails there: the packed Linear
  layers free their originals).
"""

from __future__ import annotations

import os
import time
from typing import Any

EXTENSION = "hybrid_engine.rollout.vllm_server.WeightsExtension"


class WeightsExtension:
    """Methods vLLM mixes into its worker (`worker_extension_cls`); `self` is the worker."""

    def push_weights(self, names: list[str], arrays: list[Any]) -> int:
        """Load HF-named full tensors into the running model; returns how many."""
        import torch

        tensors = [(n, torch.from_numpy(a)) for n, a in zip(names, arrays, strict=True)]
        self.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)


class VLLMServer:
    """One vLLM engine in this process; created by the pool as a Ray actor."""

    def __init__(
        self,
        model_path: str,
        seed: int,
        max_model_len: int,
        max_num_seqs: int,
        kv_cache_gb: int,
        threads_bind: str,
        dtype: str = "float32",
        compile: bool = False,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
        import vllm

        start = time.perf_counter()
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=not compile,
            enable_prefix_caching=False,
            # log-probs of the distribution sampled from: after temperature scaling (the
            # config refuses top_p/top_k with vllm, so nothing truncates it)
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
        )
        self._params = vllm.SamplingParams
        self.load_seconds = time.perf_counter() - start

    def ready(self) -> dict[str, Any]:
        """The process and versions, once the engine is up."""
        import torch
        import vllm

        return {
            "pid": os.getpid(),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_seconds": self.load_seconds,
        }

    def generate(
        self, prompts: list[list[int]], params: list[dict[str, Any]]
    ) -> tuple[list[list[int]], list[list[float]], float]:
        """Sampled token ids and their log-probs per prompt, and the seconds it took."""
        sampling = [self._params(**p) for p in params]
        start = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
        )
        seconds = time.perf_counter() - start
        tokens, logprobs = [], []
        for out in outputs:
            done = out.outputs[0]
            ids = [int(t) for t in done.token_ids]
            tokens.append(ids)
            lps = done.logprobs
            logprobs.append(
                [0.0] * len(ids)
                if lps is None
                else [float(lps[i][t].logprob) for i, t in enumerate(ids)]
            )
        return tokens, logprobs, seconds

    def push(self, names: list[str], arrays: list[Any]) -> tuple[int, float]:
        """New weights into the running engine (no restart, no file): (count, seconds)."""
        start = time.perf_counter()
        counts = self.llm.collective_rpc("push_weights", args=(names, arrays))
        return int(counts[0]), time.perf_counter() - start
