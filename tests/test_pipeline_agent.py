"""Agent rollouts through the pipeline: each episode is committed as it ends, so a driver
killed in the middle of the rollout stage resumes with those episodes reused byte for byte
and runs only the others (real driver processes, SIGKILL, real Prefect API)."""

from __future__ import annotations

import json
import signal

from runs import ARGS, STEPS, driver, fs_for
from safetensors.torch import load as st_load

AGENT = [*ARGS, "rollout.agent.function=agent_fns:answer_then_revise"]
KILLED_AFTER = 6  # episodes committed when the driver dies


def episode_files(fs, run: str, step: int) -> dict[str, bytes]:
    out = {}
    for d in fs.ls(f"{run}/steps/{step}", detail=False):
        name = d.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("rollout-episode") and fs.exists(f"{d}/COMMITTED"):
            for f in fs.ls(d, detail=False):
                out[f"{name}/{f.rsplit('/', 1)[-1]}"] = fs.cat_file(f)
    return out


def test_killed_mid_rollout_resumes_with_committed_episodes_reused(tmp_path, prefect_api):
    root = str(tmp_path)
    fs, run = fs_for(root, None), f"{root}/agent"
    train = ["train", "configs/grpo_tiny.yaml", *AGENT, f"storage.root={root}", "--run-id", "agent"]
    rc, out = driver(train, prefect_api, fault=f"step-2/rollout:episode-{KILLED_AFTER}=kill")
    assert rc == -signal.SIGKILL, out
    assert not fs.exists(f"{run}/steps/2/rollout/COMMITTED")
    before = episode_files(fs, run, 2)
    kept = {k.split("/")[0] for k in before}
    assert len(kept) == KILLED_AFTER, sorted(kept)
    rc, out = driver(["resume", "agent", f"storage.root={root}"], prefect_api)
    assert rc == 0, out
    after = episode_files(fs, run, 2)
    assert all(after[k] == v for k, v in before.items()), "a committed episode was redone"
    assert len({k.split("/")[0] for k in after}) == 16
    # the step's batch holds the kept episodes' recorded tokens
    batch = st_load(fs.cat_file(f"{run}/steps/2/rollout/batch.safetensors"))
    fields = json.loads(fs.cat_file(f"{run}/steps/2/rollout/batch.json"))["non_tensors"]
    for name in kept:
        i = int(name.removeprefix("rollout-episode"))
        ep = json.loads(before[f"{name}/meta.json"])["episode"]
        (j,) = [j for j, e in enumerate(fields["episode"]) if e == i]
        ids = batch["response_ids"][j][batch["response_mask"][j].bool()].tolist()
        assert ids == [t for c in ep["calls"] for t in c["choices"][0]["ids"]]
    summary = json.loads(fs.cat_file(f"{run}/final/summary.json"))
    rows = {h["step"]: h for h in summary["history"] if "agent/resumed" in h}
    assert rows[2]["agent/resumed"] == KILLED_AFTER and rows[1]["agent/resumed"] == 0
    assert len(rows) == STEPS and all(h["agent/calls/mean"] == 2 for h in rows.values())
