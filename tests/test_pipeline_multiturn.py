"""Multi-turn rollouts through the pipeline: a run killed in the middle of the multi-turn
rollout stage redoes that rollout (the same trajectories), one killed after it never
regenerates it, and both end with the uninterrupted run's weights (real driver processes,
SIGKILL, real Prefect API). The committed rollout holds whole trajectories."""

from __future__ import annotations

import json
import signal

import torch
from run_driver import ARGS, STEPS, comparable, driver, final_state, fs_for, rollout_markers
from safetensors.torch import load as st_load

MULTI = [*ARGS, "rollout.multi_turn.environment=env_fns:TwoTurns"]


def test_killed_mid_rollout_and_after_it_resumes_exactly(tmp_path, prefect_api):
    root = str(tmp_path)
    fs = fs_for(root, None)
    train = ["train", "configs/multiturn_tiny.yaml", *MULTI, f"storage.root={root}"]
    rc, out = driver([*train, "--run-id", "ref"], prefect_api)
    assert rc == 0, out
    run = f"{root}/chain"
    rc, out = driver([*train, "--run-id", "chain"], prefect_api, fault="step-2/rollout:turn-1=kill")
    assert rc == -signal.SIGKILL, out
    assert not fs.exists(f"{run}/steps/2/rollout/COMMITTED")
    rc, out = driver(
        ["resume", "chain", f"storage.root={root}"],
        prefect_api,
        fault="step-3/reward:before_commit=kill",
    )
    assert rc == -signal.SIGKILL, out
    before = rollout_markers(fs, run)
    assert len(before) == 3  # step 3's rollout is committed, its reward is not
    rc, out = driver(["resume", "chain", f"storage.root={root}"], prefect_api)
    assert rc == 0, out
    after = rollout_markers(fs, run)
    assert all(after[k] == v for k, v in before.items()), "a committed rollout was redone"
    for step in range(1, STEPS + 1):  # the redone rollout of step 2 too: same trajectories
        path = f"steps/{step}/rollout/batch.safetensors"
        assert fs.cat_file(f"{run}/{path}") == fs.cat_file(f"{root}/ref/{path}")
    (w, hist), (w_ref, hist_ref) = final_state(fs, run), final_state(fs, f"{root}/ref")
    for k in w_ref:
        assert torch.equal(w[k], w_ref[k]), f"{k} differs from the uninterrupted run"
    assert comparable(hist) == comparable(hist_ref)
    # whole trajectories: interior zeros in the mask, the conversation beside it
    tensors = st_load(fs.cat_file(f"{run}/steps/1/rollout/batch.safetensors"))
    mask, seen = (
        tensors["response_mask"],
        tensors["attention_mask"][:, -tensors["response_mask"].shape[1] :],
    )
    interior = (mask == 0) & (seen == 1) & (mask.flip(-1).cumsum(-1).flip(-1) > 0)
    assert interior.any(dim=1).all()
    doc = json.loads(fs.cat_file(f"{run}/steps/1/rollout/batch.json"))["non_tensors"]
    assert [m["role"] for m in doc["messages"][0]][-3:] == ["assistant", "user", "assistant"]
    assert doc["turns"] == [2] * len(doc["turns"])
