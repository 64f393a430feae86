"""Bad input, as a new user types it: every case gets exit status 1 and one `error:` line that
names the field, file, row or sample, no traceback, and leaves no run behind. The command
line runs in this process (typer's runner): every case fails before Prefect or the engine
starts, which is the point of checking first."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flows.train  # noqa: F401 - Prefect's log handlers bind to pytest's streams, not a
from flows.cli import app  # runner's, which are closed after each case

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast

ROOT = Path(__file__).parents[1]
TINY = "configs/grpo_tiny.yaml"
GOOD_ROW = {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}


def jsonl(tmp: Path, name: str, lines: list[str]) -> str:
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def rows(n: int) -> list[str]:
    return [json.dumps(GOOD_ROW)] * n


def setup(case: str, tmp: Path) -> list[str]:
    """Files a case needs; returns extra arguments."""
    if case == "empty data":
        return [f"data.train_source={jsonl(tmp, 'empty.jsonl', [])}"]
    if case == "malformed line":
        return [f"data.train_source={jsonl(tmp, 'bad.jsonl', [*rows(2), '{not json', *rows(5)])}"]
    if case == "missing field":
        no_gt = json.dumps({"prompt": GOOD_ROW["prompt"], "reward_model": {}})
        return [f"data.train_source={jsonl(tmp, 'nogt.jsonl', [*rows(1), no_gt, *rows(6)])}"]
    if case == "wrong parquet columns":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp / "cols.parquet"
        pq.write_table(pa.table({"question": ["1+1?"] * 8, "answer": ["2"] * 8}), path)
        return [f"data.train_source={path}"]
    if case == "csv data":
        (tmp / "d.csv").write_text("q,a\n")
        return [f"data.train_source={tmp / 'd.csv'}"]
    if case == "corrupt model config":
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text("{broken")
        return [f"model.path={tmp / 'model'}"]
    if case == "storage root under a file":
        (tmp / "file").write_text("x")
        return [f"storage.root={tmp / 'file' / 'runs'}"]
    if case == "preset not yaml":
        (tmp / "p.yaml").write_text("trainer: [unclosed\n")
        return [str(tmp / "p.yaml")]
    if case == "preset a list":
        (tmp / "l.yaml").write_text("- a\n- b\n")
        return [str(tmp / "l.yaml")]
    if case == "preset extends missing":
        (tmp / "e.yaml").write_text("extends: nowhere.yaml\n")
        return [str(tmp / "e.yaml")]
    if case in ("run exists", "resume changes rollout.n"):
        from hybrid_engine.config import load_config, redact

        cfg = load_config(TINY)
        run = tmp / "runs" / "old"
        run.mkdir(parents=True)
        (run / "run.json").write_text(
            json.dumps({"run_id": "old", "config": redact(cfg.model_dump(mode="json"))})
        )
        return []
    return []


# (case, command line, environment, what the error line must hold)
CASES = [
    # config keys and values
    ("unknown key", ["train", TINY, "actor.optim.lrr=1"], {}, "unknown key 'actor.optim.lrr'"),
    ("infinite lr", ["train", TINY, "actor.optim.lr=.inf"], {}, "actor.optim.lr"),
    ("negative lr", ["train", TINY, "actor.optim.lr=-1"], {}, "actor.optim.lr"),
    ("zero samples", ["train", TINY, "rollout.n=0"], {}, "rollout.n"),
    ("n not a number", ["train", TINY, "rollout.n=abc"], {}, "rollout.n"),
    ("negative temperature", ["train", TINY, "rollout.temperature=-1"], {}, "rollout.temperature"),
    ("top_p above 1", ["train", TINY, "rollout.top_p=1.5"], {}, "rollout.top_p"),
    (
        "negative val tokens",
        ["train", TINY, "rollout.val.max_new_tokens=-5"],
        {},
        "rollout.val.max_new_tokens",
    ),
    (
        "unknown estimator",
        ["train", TINY, "algorithm.adv_estimator=nope"],
        {},
        "algorithm.adv_estimator",
    ),
    ("unknown loss", ["train", TINY, "actor.policy_loss.mode=nope"], {}, "actor.policy_loss.mode"),
    (
        "mini-batch not dividing",
        ["train", TINY, "actor.ppo_mini_batch_size=3"],
        {},
        "ppo_mini_batch_size",
    ),
    ("unknown backend", ["train", TINY, "trainer.backend=gpu"], {}, "trainer.backend"),
    ("override without =", ["train", TINY, "rollout.n"], {}, "is not of the form key.path=value"),
    (
        "python tag in a value",
        ["train", TINY, "actor.optim.lr=!!python/object/apply:os.getpid []"],
        {},
        "override actor.optim.lr: the value is not plain YAML",
    ),
    ("moved key", ["train", TINY, "trainer.output_dir=x"], {}, "replaced by storage.root"),
    (
        "secret-looking unknown key",
        ["train", TINY, "tracking.api_token=tok-123"],
        {},
        "unknown key 'tracking.api_token' (value hidden)",
    ),
    (
        "credentials in a URL",
        ["train", TINY, "storage.endpoint_url=http://AK:SK@127.0.0.1:9"],
        {},
        "storage.endpoint_url: credentials never go in the URL",
    ),
    ("bad pool name", ["train", TINY, "ray.pool_name=../x"], {}, "ray.pool_name"),
    # presets
    ("missing preset", ["train", "configs/missing.yaml"], {}, "does not exist"),
    ("preset not yaml", ["train"], {}, "p.yaml"),
    ("preset a list", ["train"], {}, "l.yaml"),
    ("preset extends missing", ["train"], {}, "nowhere.yaml"),
    # environment variables
    (
        "unknown env section",
        ["train", TINY],
        {"HYBRIDRL_ROLOUT__N": "2"},
        "environment variable HYBRIDRL_ROLOUT__N: no config section 'rolout'",
    ),
    ("unknown env key", ["train", TINY], {"HYBRIDRL_ROLLOUT__NN": "2"}, "rollout.nn"),
    ("bad env value", ["train", TINY], {"HYBRIDRL_ROLLOUT__N": "abc"}, "rollout.n"),
    # data
    (
        "missing data file",
        ["train", TINY, "data.train_source=/no/such.jsonl"],
        {},
        "data file '/no/such.jsonl' does not exist",
    ),
    ("empty data", ["train", TINY], {}, "exceeds the 0 training rows"),
    ("malformed line", ["train", TINY], {}, "line 3 is not JSON"),
    ("missing field", ["train", TINY], {}, "row 1 has no reward_model.ground_truth"),
    ("wrong parquet columns", ["train", TINY], {}, "row 0 has no 'prompt' list"),
    ("csv data", ["train", TINY], {}, "expected .parquet or .jsonl"),
    (
        "unknown reasoning-gym task",
        ["train", TINY, "data.train_source=reasoning_gym:nope"],
        {},
        "nope",
    ),
    (
        "task config rejected",
        ["train", TINY, "data.task_config={min_terms: 0}"],
        {},
        "data.task_config",
    ),
    # reward functions
    ("no such module", ["train", TINY, "reward.function=nope:fn"], {}, "reward.function='nope:fn'"),
    (
        "module raises on import",
        ["train", TINY, "reward.function=raises_on_import:f"],
        {},
        "raises_on_import",
    ),
    ("no such function", ["train", TINY, "reward.function=reward_fns:nothere"], {}, "nothere"),
    (
        "reward raises",
        ["train", TINY, "reward.function=reward_fns:always_raises"],
        {},
        "reward function failed on sample 0",
    ),
    (
        "reward NaN",
        ["train", TINY, "reward.function=reward_fns:returns_nan"],
        {},
        "reward for sample 3 is nan, not a finite real number",
    ),
    (
        "reward None",
        ["train", TINY, "reward.function=reward_fns:returns_none"],
        {},
        "reward for sample 0 is None",
    ),
    (
        "reward count",
        ["train", TINY, "reward.function=reward_fns:returns_too_few"],
        {},
        "returned 1 scores for 4 samples",
    ),
    # model directories
    (
        "missing model dir",
        ["train", TINY, "model.path=/no/such/model"],
        {},
        "model.path='/no/such/model' is not a Hugging Face model directory",
    ),
    ("corrupt model config", ["train", TINY], {}, "its config.json cannot be read"),
    # storage roots
    ("storage root under a file", ["train", TINY], {}, "is not writable"),
    (
        "storage root in /proc",
        ["train", TINY, "storage.root=/proc/hybridrl-runs"],
        {},
        "storage.root='/proc/hybridrl-runs' is not writable",
    ),
    (
        "S3 endpoint down",
        [
            "train",
            TINY,
            "storage.root=s3://b/runs",
            "storage.endpoint_url=http://127.0.0.1:1",
            "storage.timeout_s=2",
        ],
        {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"},
        "does not answer",
    ),
    # tracking
    (
        "tracking server down",
        ["train", TINY, "tracking.uri=http://127.0.0.1:1"],
        {},
        "does not answer",
    ),
    (
        "runs list on a missing store",
        ["runs", "list", "--tracking-uri", "sqlite:///no/dir/x.db"],
        {},
        "no MLflow store at",
    ),
    # run ids, pools, resume
    ("bad run id", ["train", TINY, "--run-id", "../x"], {}, "run id '../x'"),
    ("run exists", ["train", TINY, "--run-id", "old"], {}, "run 'old' already exists"),
    (
        "bad pool option",
        ["pool", "status", "--pool", "../x"],
        {},
        "--pool '../x' is not a pool name",
    ),
    ("resume unknown run", ["resume", "nope"], {}, "no run 'nope'"),
    ("resume bad run id", ["resume", "../x"], {}, "run id '../x'"),
    (
        "resume changes rollout.n",
        ["resume", "old", "rollout.n=2"],
        {},
        "resume cannot change rollout.n",
    ),
]


@pytest.fixture()
def clean_environment():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("case, args, env, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line(case, args, env, needle, tmp_path, monkeypatch, clean_environment):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    extra = setup(case, tmp_path)
    runs = tmp_path / "runs"
    where = [] if args[0] in ("runs", "pool") else [f"storage.root={runs}"]
    if any(a.startswith("storage.root=") for a in args + extra):
        where = []
    line = [*args, *extra]  # a case's own preset or data file comes after the command
    env = {"HYBRIDRL_TRACKING__ENABLED": "false", **env}
    if case in ("tracking server down",):
        env.pop("HYBRIDRL_TRACKING__ENABLED")
    start = time.monotonic()
    result = CliRunner().invoke(app, [*line, *where], env=env)
    out = result.output
    assert result.exit_code == 1, out
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and needle in out.replace("\n", " "), out
    assert "Traceback" not in out
    assert time.monotonic() - start < 60  # bounded: no minutes-long wait for a dead server
    if "tok-123" in " ".join(args) or "AK:SK" in " ".join(args):
        assert "tok-123" not in out and "SK@" not in out  # secrets are never echoed
    made = [p for p in runs.rglob("run.json") if p.parent.name != "old"] if runs.exists() else []
    assert not made, f"a run was left behind: {made}"
