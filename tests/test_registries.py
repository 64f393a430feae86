"""The registries: what their modules' source declares is what importing them registers; a
name registered twice is refused naming both places; config errors come from them."""

import pytest

from hybrid_engine.config import ConfigError, load_config
from hybrid_engine.registry import REGISTRIES, Registry

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.var)
def test_the_source_scan_equals_what_importing_registers(registry):
    static = {name: registry.info(name) for name in registry}
    registry.load()
    imported = {name: registry.info(name) for name in registry._entries}
    assert static, f"{registry.var} has no entry"
    assert set(static) == set(imported)
    for name, info in imported.items():
        assert registry._static[name] == info, name


def test_a_name_registered_twice_is_refused_naming_both_places():
    reg = Registry("_TEST", "test thing")

    @reg.register("one")
    def first():
        """The first."""

    def second():
        """The second."""

    with pytest.raises(
        ValueError, match=r"test thing 'one' is registered twice: by .*first.*second"
    ):
        reg.register("one")(second)
    assert reg["one"] is first
    with pytest.raises(KeyError, match="unknown test thing 'two'; known: one"):
        reg["two"]


def test_the_source_scan_refuses_computed_names(tmp_path, monkeypatch):
    import hybrid_engine.registry as registry_module

    (tmp_path / "computed.py").write_text(
        'NAME = "x"\n\n\n@_TEST.register(NAME)\ndef f():\n    """F."""\n'
    )
    monkeypatch.setattr(registry_module, "_ROOT", tmp_path)
    reg = Registry("_TEST", "test thing", "computed")
    with pytest.raises(ValueError, match=r"computed.py:4: _TEST.register takes literal arguments"):
        list(reg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.adv_estimator=nope",
            "algorithm.adv_estimator='nope' is not a registered "
            "advantage estimator; registered: gae, gpg, grpo",
        ),
        (
            "actor.loss_agg_mode=mean",
            "actor.loss_agg_mode='mean' is not a registered loss "
            "aggregation mode; registered: seq-mean-token-mean",
        ),
        ("algorithm.kl_penalty=k4", "algorithm.kl_penalty='k4' is not a registered KL estimator"),
        ("algorithm.rollout_correction.level=geo", "level='geo' is not a registered IS level"),
        (
            "rollout.name=sglang",
            "rollout.name='sglang' is not a registered rollout backend; registered: hf, vllm",
        ),
        (
            "rollout.multi_turn.environment=chess",
            "environment='chess' is not a registered "
            "environment; registered: calculator, feedback, tools",
        ),
    ],
)
def test_an_unregistered_name_is_named_with_its_key_and_the_choices(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/grpo_tiny.yaml", [override])
    assert message in str(err.value)
