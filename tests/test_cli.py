import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PRISTINE_ENV
from drivers import Driver
from safetensors.torch import load_file

# "fails in seconds": a refusal that needs no model, pool or flow (measured 0.3-3 s); a
# command that hangs or waits out a network timeout instead fails the test at this bound
FAST = 30


@pytest.fixture(autouse=True)
def shared_prefect_api(request, monkeypatch):
    """The drivers use the suite's Prefect server instead of each starting a temporary one
    (~6 s each); a test that needs an API of its own sets PREFECT_API_URL="" for its run.
    The fast tests refuse before any flow runs: they get no API (and start none)."""
    if not request.node.get_closest_marker("fast"):
        monkeypatch.setenv("PREFECT_API_URL", request.getfixturevalue("prefect_api"))


def run(*args, cwd, env=None, timeout=300):
    """`hybridrl ARGS` (a driver process, tests/drivers.py); a command still running after
    `timeout` seconds fails the test."""
    env = {**PRISTINE_ENV, "PYTHONPATH": str(Path(__file__).parent), **(env or {})}
    if "PREFECT_API_URL" in os.environ and "PREFECT_API_URL" not in env:
        env["PREFECT_API_URL"] = os.environ["PREFECT_API_URL"]
    rc, out, err = Driver(list(args), env, cwd, merged=False).wait(timeout)
    return subprocess.CompletedProcess(["hybridrl", *args], rc, out, err)


def test_train_saves_final_policy_and_summary(tmp_path):
    root = Path(__file__).parents[1]
    p = run(
        "train",
        str(root / "configs/grpo_tiny.yaml"),
        f"storage.root={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        "trainer.run_id=t1",
        "reward.function=reward_fns:length_score",
        cwd=root,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "run t1: 2 steps recorded" in p.stdout
    assert re.search(r"held-out accuracy: .*\d+\.\d% at step 2.*; wall time \d:\d\d:\d\d", p.stdout)
    final = tmp_path / "t1" / "final"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "summary.json"):
        assert (final / name).is_file(), name
    summary = json.loads((final / "summary.json").read_text())
    assert summary["config"]["trainer"]["run_id"] == "t1" and summary["steps"] == 2
    last = summary["last_step_metrics"]
    assert last["step"] == 2 and "actor/pg_loss" in last and "val/accuracy" in last
    weights = load_file(final / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.fast
@pytest.mark.parametrize(
    "args, needle",
    [
        (["configs/grpo_tiny.yaml", "actor.optim.lrr=1"], "unknown key 'actor.optim.lrr'"),
        (["configs/missing.yaml"], "does not exist"),
        (["configs/grpo_tiny.yaml", "trainer.run_id=../x"], "run id '../x'"),
        (["configs/grpo_tiny.yaml", "reward.function=nope:fn"], "reward.function='nope:fn'"),
        (["configs/grpo_tiny.yaml", "trainer.output_dir=x"], "replaced by storage.root"),
        (["configs/grpo_tiny.yaml", "trainer.run_id=a[x]"], "run id 'a[x]'"),  # brackets kept
    ],
)
def test_train_fails_with_one_line(args, needle):
    root = Path(__file__).parents[1]
    p = run("train", *args, cwd=root, timeout=FAST)
    assert p.returncode == 1
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in p.stdout.replace("\n", " "), p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.fast
@pytest.mark.parametrize(
    "args, needle",
    [
        (["pool", "status", "--pool", "../x"], "--pool '../x' is not a pool name"),
        (["pool", "down", "--pool", "a/b"], "--pool 'a/b' is not a pool name"),
        (["runs", "list", "--tracking-uri", "http://127.0.0.1:1"], "does not answer"),
        (["runs", "show", "r", "--tracking-uri", "http://127.0.0.1:1"], "does not answer"),
        (["runs", "list", "--tracking-uri", "sqlite:///no/such/dir/x.db"], "no MLflow store at"),
    ],
)
def test_commands_fail_in_seconds_with_one_line(args, needle, tmp_path):
    root = Path(__file__).parents[1]
    p = run(*args, cwd=root, timeout=FAST)
    assert p.returncode == 1, p.stdout + p.stderr
    out = p.stdout.replace("\n", " ")
    assert needle in out and "Traceback" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert not Path("/no/such/dir").exists()


@pytest.mark.fast
def test_what_the_commands_print_keeps_its_brackets():
    import typer
    from rich.table import Table
    from rich.tree import Tree

    from flows.cli.runs import console, fail

    text = "install the [vllm] extra; [bold]x[/] stays [red]as written[/]"
    table, tree = Table("key", "[a]"), Tree("run [r1]")
    table.add_row("trainer.run_id", "[b]")
    tree.add("fork [f]")
    with console.capture() as captured:
        with pytest.raises(typer.Exit):
            fail(ValueError(text))
        console.print(line := f"  {'hybridrl.note':<24} {text}")
        console.print(table)
        console.print(tree)
    out = captured.get()
    flat = " ".join(out.split())  # the console wraps at its width
    assert f"error: {text}" in flat and " ".join(line.split()) in flat
    assert all(s in out for s in ("[a]", "[b]", "run [r1]", "fork [f]")), out


@pytest.mark.fast
def test_train_with_a_tracking_server_that_is_down_fails_fast(tmp_path):
    root = Path(__file__).parents[1]
    p = run(
        "train",
        "configs/grpo_tiny.yaml",
        f"storage.root={tmp_path}",
        "tracking.uri=http://127.0.0.1:1",
        cwd=root,
        timeout=FAST,
    )
    assert p.returncode == 1 and "does not answer" in p.stdout, p.stdout + p.stderr


def test_resume_is_checked_against_the_stored_run_and_a_longer_run_gets_a_new_final(tmp_path):
    root = Path(__file__).parents[1]
    common = [f"storage.root={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    p = run(
        "train",
        "configs/grpo_tiny.yaml",
        *common,
        "trainer.run_id=t2",
        "reward.function=reward_fns:length_score",
        cwd=root,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    # a copy: load_file maps the file, and final/ is rewritten in place
    before = {
        k: v.clone() for k, v in load_file(tmp_path / "t2" / "final" / "model.safetensors").items()
    }
    p = run("resume", "t2", "rollout.n=2", *common, cwd=root)
    assert p.returncode == 1 and "resume cannot change rollout.n" in p.stdout, p.stdout + p.stderr
    p = run("resume", "t2", "trainer.total_training_steps=3", *common, cwd=root)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads((tmp_path / "t2" / "final" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["history"][-1]["step"] == 3
    after = load_file(tmp_path / "t2" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_nan_update_fails_the_run_with_one_line_and_writes_no_checkpoint(tmp_path):
    root = Path(__file__).parents[1]
    p = run(
        "train",
        "configs/grpo_tiny.yaml",
        f"storage.root={tmp_path}",
        "trainer.run_id=n1",
        "tracking.enabled=false",
        "trainer.save_freq=1",
        "algorithm.plugins=[plugin_nan]",
        "actor.policy_loss.mode=plugin_nan",
        cwd=root,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "step 1: actor update refused: gradient norm nan" in lines[0]
    run_dir = tmp_path / "n1"
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final").exists()
    assert not (run_dir / "steps" / "1" / "update").exists()


def test_secrets_in_env_maps_are_not_recorded_and_a_resume_asks_for_them(tmp_path):
    from mlflow.tracking import MlflowClient

    root = Path(__file__).parents[1]
    secret = "s3cr3t-VALUE-42"
    db = f"sqlite:///{tmp_path}/mlflow.db"
    env_map = f"ray.worker_env={{AWS_SECRET_ACCESS_KEY: {secret}, MALLOC_ARENA_MAX: '2'}}"
    home = {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": ""}  # its own API
    p = run(
        "train",
        "configs/grpo_tiny.yaml",
        f"storage.root={tmp_path}",
        "trainer.run_id=s1",
        f"tracking.uri={db}",
        env_map,
        "trainer.total_training_steps=1",
        cwd=root,
        env=home,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    for path in (tmp_path / "s1").rglob("*.json"):
        assert secret not in path.read_text(), path
    # Prefect's database (flow-run parameters, task inputs) never saw it either
    stored = [f for f in (tmp_path / "prefect").rglob("*") if f.is_file()]
    assert any(f.suffix == ".db" for f in stored)
    assert not [f for f in stored if secret.encode() in f.read_bytes()]
    client = MlflowClient(db)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("hybridrl").experiment_id])
    assert (
        secret not in str(mlrun.data.params) and "<redacted>" in mlrun.data.params["ray.worker_env"]
    )
    assert "MALLOC_ARENA_MAX" in mlrun.data.params["ray.worker_env"]
    config_yaml = Path(client.download_artifacts(mlrun.info.run_id, "config.yaml", tmp_path))
    assert secret not in config_yaml.read_text()
    p = run(
        "resume",
        "s1",
        "trainer.total_training_steps=2",
        f"storage.root={tmp_path}",
        f"tracking.uri={db}",
        cwd=root,
    )
    assert (
        p.returncode == 1
        and "ray.worker_env.AWS_SECRET_ACCESS_KEY: secret values are not"
        in p.stdout.replace("\n", " ")
    ), p.stdout + p.stderr
    p = run(
        "resume",
        "s1",
        "trainer.total_training_steps=2",
        f"storage.root={tmp_path}",
        f"tracking.uri={db}",
        env_map,
        cwd=root,
    )
    assert p.returncode == 0, p.stdout + p.stderr


STORAGE_COMMANDS = [
    "train",
    "resume",
    "fork",
    "replay",
    "runs tree",
    "runs delete",
    "register",
    "evaluate",
]
TRACKING_COMMANDS = [
    "train",
    "resume",
    "fork",
    "register",
    "evaluate",
    "runs list",
    "runs show",
    "runs compare",
]


@pytest.mark.fast
def test_one_spelling_for_the_storage_root_and_the_tracking_uri():
    import typer

    from flows.cli import app
    from flows.cli.options import old_spellings, with_options

    root = typer.main.get_command(app)

    def options(path: str) -> set[str]:
        cmd = root
        for part in path.split():
            cmd = cmd.commands[part]
        return {o for p in cmd.params for o in getattr(p, "opts", [])}

    assert [c for c in STORAGE_COMMANDS if "--storage-root" not in options(c)] == []
    assert [c for c in TRACKING_COMMANDS if "--tracking-uri" not in options(c)] == []
    got = with_options(["storage.root=/old", "rollout.n=2"], "/new", "http://127.0.0.1:5000")
    assert got == [
        "storage.root=/old",
        "rollout.n=2",
        "storage.root=/new",
        "tracking.uri=http://127.0.0.1:5000",
    ]
    (line,) = old_spellings(["storage.root=/old", "rollout.n=2"])
    assert "`storage.root=...` as an override is the old spelling" in line
    assert "--storage-root" in line and old_spellings(["rollout.n=2"]) == []
