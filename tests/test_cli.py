import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HYBRIDRL = str(Path(sys.executable).parent / "hybridrl")


def run(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run([HYBRIDRL, *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_train_saves_final_policy_and_summary(tmp_path):
    root = Path(__file__).parents[1]
    p = run("train", str(root / "configs/grpo_tiny.yaml"), f"storage.root={tmp_path}",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            "trainer.run_id=t1", "reward.function=reward_fns:length_score", cwd=root)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "run t1: 2 steps recorded" in p.stdout
    final = tmp_path / "t1" / "final"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "summary.json"):
        assert (final / name).is_file(), name
    summary = json.loads((final / "summary.json").read_text())
    assert summary["config"]["trainer"]["run_id"] == "t1" and summary["steps"] == 2
    last = summary["last_step_metrics"]
    assert last["step"] == 2 and "actor/pg_loss" in last and "val/accuracy" in last
    weights = load_file(final / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.parametrize(
    "args, needle",
    [
        (["configs/grpo_tiny.yaml", "actor.optim.lrr=1"], "unknown key 'actor.optim.lrr'"),
        (["configs/missing.yaml"], "does not exist"),
        (["configs/grpo_tiny.yaml", "trainer.run_id=../x"], "run id '../x'"),
        (["configs/grpo_tiny.yaml", "reward.function=nope:fn"], "reward.function='nope:fn'"),
        (["configs/grpo_tiny.yaml", "trainer.output_dir=x"], "replaced by storage.root"),
    ],
)
def test_train_fails_with_one_line(args, needle):
    root = Path(__file__).parents[1]
    p = run("train", *args, cwd=root)
    assert p.returncode == 1
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in p.stdout.replace("\n", " "), p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
