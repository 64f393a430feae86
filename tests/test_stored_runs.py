"""A run stored by earlier code still resumes, forks and replays. `tests/data/stored-v1` is
a run written at commit 6b451b0 (before the Engine's concerns moved out), killed as step 3's
rollout started; made from that checkout with

    PYTHONPATH=tests HYBRIDRL_FAULT="step-3/rollout:start=kill" hybridrl train \
        configs/grpo_tiny.yaml <tests/run_driver.py ARGS, with trainer.save_freq=0> \
        tracking.enabled=false storage.root=ROOT --run-id stored-v1

It holds no checkpoint (save_freq 0), so its weights come back by replaying its stored
updates from the seeded start. Finished by today's code it must equal the uninterrupted
reference run of the pipeline tests, bit for bit."""

from __future__ import annotations

import shutil
from pathlib import Path

from run_driver import assert_same_run, driver, final_state, fs_for

STORED = Path(__file__).parent / "data" / "stored-v1"


def test_a_run_stored_by_earlier_code_resumes_forks_and_replays(tmp_path, prefect_api, reference):
    root = str(tmp_path / "runs")
    shutil.copytree(STORED, f"{root}/stored-v1")
    fs = fs_for(root, None)
    rc, out = driver(["replay", "stored-v1", "--all", "--storage-root", root], prefect_api)
    assert rc == 0 and "all equal" in out, out
    rc, out = driver(
        ["fork", "stored-v1", "--at", "2/advantage", "--run-id", "f1", "--storage-root", root],
        prefect_api,
    )
    assert rc == 0, out
    assert_same_run(final_state(fs, f"{root}/f1"), reference)
    rc, out = driver(["resume", "stored-v1", "--storage-root", root], prefect_api)
    assert rc == 0, out
    assert "(from storage" in out  # its committed stages were not computed again
    assert_same_run(final_state(fs, f"{root}/stored-v1"), reference)
