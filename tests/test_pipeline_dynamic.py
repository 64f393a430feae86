"""Dynamic sampling through the pipeline: each generation batch is committed, so a run killed
mid-step resumes without generating a committed one again, consumes the same prompts and
ends with the uninterrupted run's weights (real driver processes, SIGKILL, real Prefect API)."""

from __future__ import annotations

import json
import signal

import torch
from test_pipeline import ARGS, STEPS, comparable, driver, final_state, fs_for

DYNAMIC = [*ARGS, "reward.function=reward_fns:half_solved", "algorithm.filter_groups.enabled=true"]


def step_meta(fs, run_url: str) -> dict[int, dict]:
    return {s: json.loads(fs.cat_file(f"{run_url}/steps/{s}/rollout/meta.json"))
            for s in range(1, STEPS + 1)}  # fmt: skip


def uids(fs, run_url: str, step: int) -> list[str]:
    return json.loads(fs.cat_file(f"{run_url}/steps/{step}/rollout/batch.json"))["non_tensors"][
        "uid"
    ]


def test_killed_after_the_second_generation_batch_resumes_exactly(tmp_path, prefect_api):
    root = str(tmp_path)
    fs = fs_for(root, None)
    rc, out = driver(["train", "configs/grpo_tiny.yaml", *DYNAMIC, f"storage.root={root}",
                      "--run-id", "ref"], prefect_api)  # fmt: skip
    assert rc == 0, out
    ref = step_meta(fs, f"{root}/ref")
    used = [g for s in range(1, STEPS + 1) for g in ref[s]["gen_batches"]]
    assert used == list(range(1, len(used) + 1)), "one stream of generation batches, in order"
    # the first step that needed a third generation batch: kill it before that one commits
    step = next(s for s in range(1, STEPS + 1) if len(ref[s]["gen_batches"]) >= 3)
    run = f"{root}/chain"
    rc, out = driver(["train", "configs/grpo_tiny.yaml", *DYNAMIC, f"storage.root={root}",
                      "--run-id", "chain"], prefect_api,
                     fault=f"step-{step}/rollout-gen3:before_commit=kill")  # fmt: skip
    assert rc == -signal.SIGKILL, out
    parts = {j: fs.cat_file(f"{run}/steps/{step}/rollout-gen{j}/batch.safetensors")
             for j in (1, 2)}  # fmt: skip
    assert not fs.exists(f"{run}/steps/{step}/rollout/COMMITTED")
    rc, out = driver(["resume", "chain", f"storage.root={root}"], prefect_api)
    assert rc == 0, out
    for j, data in parts.items():  # committed generation batches were not generated again
        assert fs.cat_file(f"{run}/steps/{step}/rollout-gen{j}/batch.safetensors") == data
    got = step_meta(fs, run)
    for s in range(1, STEPS + 1):
        assert got[s]["gen_batches"] == ref[s]["gen_batches"], f"step {s} consumed other prompts"
        assert uids(fs, run, s) == uids(fs, f"{root}/ref", s)
    (w, hist), (w_ref, hist_ref) = final_state(fs, run), final_state(fs, f"{root}/ref")
    for k in w_ref:
        assert torch.equal(w[k], w_ref[k]), f"{k} differs from the uninterrupted run"
    assert comparable(hist) == comparable(hist_ref)
    assert hist[-1]["dynamic_sampling/trained_groups"] == 4
