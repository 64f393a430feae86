import pytest

from hybrid_engine.config import ConfigError, flatten, load_config, parse_overrides

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("HYBRIDRL_") and k != "HYBRIDRL_CACHE":
            monkeypatch.delenv(k)


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_precedence_defaults_yaml_env_override(tmp_path, monkeypatch):
    p = write(tmp_path, "actor:\n  optim: {lr: 2.0e-5, weight_decay: 0.1}\nrollout: {n: 8}\n")
    assert load_config().actor.optim.lr == 1e-5  # default
    cfg = load_config(p)
    assert (cfg.actor.optim.lr, cfg.actor.optim.weight_decay, cfg.rollout.n) == (2e-5, 0.1, 8)
    monkeypatch.setenv("HYBRIDRL_ACTOR__OPTIM__LR", "3e-5")
    cfg = load_config(p)
    assert cfg.actor.optim.lr == 3e-5  # env beats YAML
    assert cfg.actor.optim.weight_decay == 0.1  # ...without wiping the YAML's siblings
    cfg = load_config(p, ["actor.optim.lr=1e-6"])
    assert cfg.actor.optim.lr == 1e-6  # override beats env
    assert cfg.rollout.n == 8


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["actor.optim.lrr=1"], "unknown key 'actor.optim.lrr'"),
        (["nosection.x=1"], "unknown key 'nosection'"),
        (["rollout.n=many"], "rollout.n='many'"),
        (["actor.optim.lr=-1"], "actor.optim.lr=-1"),
        (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator='ppo2'"),
        (["actor.ppo_mini_batch_size=12"], "actor.ppo_mini_batch_size=12 must divide"),
        (["actor.ppo_micro_batch_size=5"], "actor.ppo_micro_batch_size=5 must divide"),
        (["rollout.n=1"], "rollout.n=1"),
        (["rollout.n"], "not of the form"),
        (
            ["rollout.name=vllm", "rollout.top_p=0.9"],
            "rollout.top_p=0.9 / top_k=0 with rollout.name=vllm: its log-probs would be",
        ),
        (["rollout.name=vllm", "rollout.top_k=5"], "top_k=5 with rollout.name=vllm"),
        (
            ["rollout.name=vllm", "actor.layout.rollout.separate_copy=true"],
            "actor.layout.rollout.separate_copy applies to the hf rollout only",
        ),
        (["actor.layout.dp=2"], "actor.layout.dp=2: the local backend runs one rank"),
        (["ray.critic=separate"], "need trainer.backend=ray"),
        (["trainer.backend=ray", "actor.layout.dp=3"], "must split evenly over 3"),
        (
            ["trainer.backend=ray", "actor.layout.dp=2", "actor.ppo_micro_batch_size=32"],
            "actor.ppo_micro_batch_size=32 must divide the per-rank mini-batch",
        ),
        (["actor.layout.rollout.tp=2"], "actor.layout.rollout.tp=2: the hf rollout"),
        (
            ["trainer.backend=ray", "actor.layout.dp=2", "actor.layout.rollout.dp=1"],
            "actor.layout.rollout.dp=1",
        ),
        (
            ["rollout.name=vllm", "actor.layout.rollout.tp=2"],
            "actor.layout.rollout.tp=2: the vllm rollout keeps full weights per replica",
        ),
        (["ray.pool_name=../x"], "ray.pool_name='../x'"),
    ],
)
def test_errors_name_key_and_value(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)


def test_vllm_loads_on_cpu_with_an_agent_and_asynchronous_training():
    cfg = load_config("configs/grpo_tiny.yaml", ["rollout.name=vllm"])  # no GPU needed
    assert cfg.rollout.name == "vllm" and cfg.device == "cpu"
    agent = ["rollout.name=vllm", "rollout.agent.function=agent_fns:answer_sync"]
    assert load_config("configs/grpo_tiny.yaml", agent).rollout.agent.function
    stale = load_config("configs/grpo_tiny.yaml", ["rollout.name=vllm", "trainer.max_staleness=1"])
    assert stale.separate_rollout and stale.algorithm.rollout_correction.level == "token"


def test_critic_sizes_checked_only_with_gae():
    load_config(None, ["critic.ppo_mini_batch_size=7"])  # grpo: no critic, no check
    with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size=7"):
        load_config(None, ["critic.ppo_mini_batch_size=7", "algorithm.adv_estimator=gae"])


def test_unknown_key_in_yaml_and_env(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown key 'trainer.epochs'"):
        load_config(write(tmp_path, "trainer: {epochs: 3}\n"))
    monkeypatch.setenv("HYBRIDRL_TRAINER__BOGUS", "1")
    with pytest.raises(ConfigError, match="unknown key 'trainer.bogus'"):
        load_config()


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_presets_load():
    for name in ("demo_cpu", "grpo_tiny", "ppo_tiny"):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.samples_per_step % cfg.actor.ppo_mini_batch_size == 0
    assert load_config("configs/ppo_tiny.yaml").use_critic
    assert load_config("configs/demo_cpu.yaml").model.path == "smollm2-135m-instruct"


def test_parse_overrides_and_flatten():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}
    flat = flatten(load_config(None, ["actor.optim.lr=1e-6"]))
    assert flat["actor.optim.lr"] == 1e-6 and "trainer.seed" in flat


def test_the_reference_is_generated_from_the_model_with_a_meaning_for_every_key():
    # the docs site renders this text (docs/_hooks/reference.py); tests/test_docs.py builds it
    from hybrid_engine.config import HybridConfig, config_reference, flatten, registries_reference
    from hybrid_engine.registry import REGISTRIES

    rows = [r.split(" | ") for r in config_reference().splitlines() if r.startswith("| `")]
    keys = [r[0].strip("| `") for r in rows]
    assert sorted(keys) == sorted(flatten(HybridConfig())), "every key, once"
    assert all(r[3].strip(" |") for r in rows)
    names = {
        r.split(" | ")[0].strip("| `")
        for r in registries_reference().splitlines()
        if r.startswith("| `")
    }

    registered = set().union(*(set(r) for r in REGISTRIES))
    assert names == registered, "the registries, read not typed"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.optim.lr=.inf", r"actor.optim.lr=inf: Input should be a finite number"),
        ("algorithm.gamma=.nan", r"algorithm.gamma=nan"),
        ("rollout.val.max_new_tokens=-5", r"rollout.val.max_new_tokens=-5"),
        (
            "trainer.seed=!!python/object/apply:os.system [ls]",
            r"override trainer.seed: the value is not plain YAML",
        ),
        ("tracking.api_token=abc123", r"unknown key 'tracking.api_token' \(value hidden\)"),
        (
            "reward.function=raises_on_import:f",
            r"reward.function='raises_on_import:f': importing module 'raises_on_import' raised ZeroDivisionError",
        ),
    ],
)
def test_bad_values_get_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config("configs/grpo_tiny.yaml", [override])
    assert "\n" not in str(e.value) and "abc123" not in str(e.value)


def test_unknown_section_in_an_environment_variable(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_ROLOUT__N", "2")
    with pytest.raises(ConfigError, match="HYBRIDRL_ROLOUT__N: no config section 'rolout'"):
        load_config("configs/grpo_tiny.yaml")


@pytest.mark.parametrize(
    "key", ["storage.endpoint_url", "storage.root", "tracking.uri", "ray.address"]
)
def test_credentials_in_a_url_are_refused_without_repeating_them(key):
    value = "s3://KEY:SECRET@bucket/x" if key == "storage.root" else "http://KEY:SECRET@127.0.0.1:9"
    with pytest.raises(ConfigError, match=f"{key}: credentials never go in the URL") as e:
        load_config("configs/grpo_tiny.yaml", [f"{key}={value}"])
    assert "SECRET" not in str(e.value)


@pytest.mark.fast
def test_redaction_covers_every_secret_looking_name_url_password_and_value_type():
    from hybrid_engine.config import redact, redacted_keys

    secret = {
        "Authorization": "Bearer a1",
        "private_key": "k1",
        "private-key": "k2",
        "privateKey": "k3",
        "GITHUB_PAT": "p1",
        "hf-token": "t1",
        "db.password": "pw1",
        "API_KEY": 12345,
        "client_secret": ["s1", "s2"],
        "credentials": {"user": "u", "pass": "c1"},
    }
    kept = {"MALLOC_ARENA_MAX": "2", "PATH": "/bin", "max_new_tokens": 32, "pad_token_id": 0}
    url = "postgres://u:pw2@db.example:5432/app?sslmode=require"
    doc = {"env": {**secret, **kept, "DATABASE_URL": url, "OTHER": "http://h.example/x"}}
    out = redact(doc)["env"]
    assert {k: out[k] for k in secret} == dict.fromkeys(secret, "<redacted>")
    assert {k: out[k] for k in kept} == kept and out["OTHER"] == "http://h.example/x"
    assert out["DATABASE_URL"] == "postgres://u:<redacted>@db.example:5432/app?sslmode=require"
    assert redact(url) == out["DATABASE_URL"]  # a URL's password, whatever its key
    # a resumed run's config with any of them redacted asks for them again
    cfg = load_config(None, ["ray.worker_env={DATABASE_URL: 'postgres://u:<redacted>@h/db', A: b}"])
    assert redacted_keys(cfg) == ["ray.worker_env.DATABASE_URL"]
    cfg = load_config(None, ["ray.worker_env={X-Api-Key: <redacted>}"])
    assert redacted_keys(cfg) == ["ray.worker_env.X-Api-Key"]
