"""Dynamic sampling through the pipeline: each round is committed, so a run killed
mid-step resumes without generating a committed one again, consumes the same prompts and
ends with the uninterrupted run's weights (real driver processes, SIGKILL, real Prefect API)."""

from __future__ import annotations

import json
import signal

import torch
from run_driver import ARGS, STEPS, comparable, driver, final_state, fs_for

DYNAMIC = [*ARGS, "reward.function=reward_fns:half_solved", "algorithm.filter_groups.enabled=true"]


def step_meta(fs, run_url: str) -> dict[int, dict]:
    return {
        s: json.loads(fs.cat_file(f"{run_url}/steps/{s}/rollout/meta.json"))
        for s in range(1, STEPS + 1)
    }


def uids(fs, run_url: str, step: int) -> list[str]:
    return json.loads(fs.cat_file(f"{run_url}/steps/{step}/rollout/batch.json"))["non_tensors"][
        "uid"
    ]


def test_killed_after_the_second_round_resumes_exactly(tmp_path, prefect_api):
    root = str(tmp_path)
    fs = fs_for(root, None)
    rc, out = driver(
        ["train", "configs/grpo_tiny.yaml", *DYNAMIC, f"storage.root={root}", "--run-id", "ref"],
        prefect_api,
    )
    assert rc == 0, out
    ref = step_meta(fs, f"{root}/ref")
    used = [g for s in range(1, STEPS + 1) for g in ref[s]["gen_batches"]]
    assert used == list(range(1, len(used) + 1)), "one stream of generation batches, in order"
    # the first step that needed a third round: kill it before that one commits
    step = next(s for s in range(1, STEPS + 1) if ref[s]["metrics"]["dynamic_sampling/rounds"] >= 3)
    run = f"{root}/chain"
    rc, out = driver(
        ["train", "configs/grpo_tiny.yaml", *DYNAMIC, f"storage.root={root}", "--run-id", "chain"],
        prefect_api,
        fault=f"step-{step}/rollout-gen3:before_commit=kill",
    )
    assert rc == -signal.SIGKILL, out
    parts = {j: fs.cat_file(f"{run}/steps/{step}/rollout-gen{j}/batch.safetensors") for j in (1, 2)}
    assert not fs.exists(f"{run}/steps/{step}/rollout/COMMITTED")
    rc, out = driver(["resume", "chain", f"storage.root={root}"], prefect_api)
    assert rc == 0, out
    for j, data in parts.items():  # committed rounds were not generated again
        assert fs.cat_file(f"{run}/steps/{step}/rollout-gen{j}/batch.safetensors") == data
    got = step_meta(fs, run)
    for s in range(1, STEPS + 1):
        assert got[s]["gen_batches"] == ref[s]["gen_batches"], f"step {s} consumed other prompts"
        assert got[s]["gen_batch_prompts"] == ref[s]["gen_batch_prompts"]
        assert got[s]["prompts"] == ref[s]["prompts"]
        assert uids(fs, run, s) == uids(fs, f"{root}/ref", s)
    (w, hist), (w_ref, hist_ref) = final_state(fs, run), final_state(fs, f"{root}/ref")
    for k in w_ref:
        assert torch.equal(w[k], w_ref[k]), f"{k} differs from the uninterrupted run"
    assert comparable(hist) == comparable(hist_ref)
    assert hist[-1]["dynamic_sampling/trained_groups"] == 4


def test_lora_killed_after_a_checkpoint_resumes_exactly_from_the_adapters(tmp_path, prefect_api):
    """Killed in step 4's update: the resume loads the adapter-only checkpoint of step 2 onto
    the rebuilt base, replays step 3's update from storage and ends like the uninterrupted
    run; the final policy is the merged model, the adapter is saved beside it."""
    root = str(tmp_path)
    fs = fs_for(root, None)
    lora = [*ARGS, "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=1e-2"]
    for run, fault in (("ref", None), ("chain", "step-4/update:before_commit=kill")):
        rc, out = driver(
            ["train", "configs/grpo_tiny.yaml", *lora, f"storage.root={root}", "--run-id", run],
            prefect_api,
            fault=fault,
        )
        assert rc == (0 if fault is None else -signal.SIGKILL), out
    ckpt = load_file_bytes(fs, f"{root}/chain/checkpoints/step_2/actor/model.safetensors")
    assert ckpt and all(".lora_" in k for k in ckpt)
    rc, out = driver(["resume", "chain", f"storage.root={root}"], prefect_api)
    assert rc == 0, out
    assert "loaded checkpoint step_2" in out and "replaying 1 committed update" in out
    (w, hist), (w_ref, hist_ref) = final_state(fs, f"{root}/chain"), final_state(fs, f"{root}/ref")
    assert not any("lora" in k for k in w)  # the merged plain model
    for k in w_ref:
        assert torch.equal(w[k], w_ref[k]), f"{k} differs from the uninterrupted run"
    assert comparable(hist) == comparable(hist_ref)
    adapter = load_file_bytes(fs, f"{root}/chain/final/adapter/adapter_model.safetensors")
    assert adapter and all(k.startswith("base_model.model.") for k in adapter)
    assert fs.exists(f"{root}/chain/final/adapter/adapter_config.json")


def load_file_bytes(fs, path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(fs.cat_file(path))
