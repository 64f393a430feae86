"""One-step behaviour of the engine on the tiny model (seconds each)."""

import math
import resource
import subprocess
import sys

import pytest
import torch
from weights import assert_same_weights

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.loop import train

# A reward that varies across random completions, so every group has a learning signal.
SIGNAL = "reward.function=reward_fns:length_score"


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def assert_all_changed(before, after):
    same = [k for k in before if torch.equal(before[k], after[k])]
    assert not same, f"parameters not updated: {same}"


def test_grpo_step_updates_every_parameter():
    engine = Engine(load_config("configs/grpo_tiny.yaml", [SIGNAL]))
    before = params(engine.actor.policy)
    batch = engine.rollout(1)
    assert len(batch) == 16 and len(set(batch["uid"])) == 4
    batch = engine.advantage(engine.reward(batch))
    adv = batch["advantages"]
    assert adv.abs().sum() > 0 and torch.all(adv[batch["response_mask"] == 0] == 0)
    result = engine.update(batch)
    assert_all_changed(before, params(engine.actor.policy))
    m = result.meta["metrics"]
    for key in (
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/pg_clipfrac_low",
        "actor/pg_clipfrac_high",
        "critic/score/mean",
        "response_length/mean",
        "timing_s/gen",
        "timing_s/update_actor",
    ):
        assert math.isfinite(m[key]), key
    assert engine.actor.weights_version == 1 and engine.actor.ref is None


def test_ppo_step_updates_actor_and_critic_and_leaves_reference():
    engine = Engine(load_config("configs/ppo_tiny.yaml", [SIGNAL]))
    actor, critic = params(engine.actor.policy), params(engine.critic.model)
    ref = params(engine.actor.ref)
    assert all(torch.equal(actor[k], ref[k]) for k in actor)  # reference starts as the policy
    metrics = engine.step(1)
    assert_all_changed(actor, params(engine.actor.policy))
    assert_all_changed(critic, params(engine.critic.model))
    assert all(torch.equal(ref[k], v) for k, v in params(engine.actor.ref).items())
    assert not any(p.requires_grad for p in engine.actor.ref.parameters())
    for key in (
        "critic/vf_loss",
        "actor/kl_loss",
        "timing_s/values",
        "timing_s/ref",
        "timing_s/old_log_prob",
        "perf/throughput",
        "perf/peak_rss_gb",
    ):
        assert math.isfinite(metrics[key]), key


def state(engine):
    return {k: v.clone() for k, v in engine.actor.policy.state_dict().items()}


def test_same_seed_gives_bit_identical_weights():
    runs = []
    for seed in (5, 5, 6):
        cfg = load_config("configs/grpo_tiny.yaml", [SIGNAL, f"trainer.seed={seed}"])
        engine, history = train(cfg)
        runs.append((state(engine), history[-1]))
    (a, ma), (b, mb), (c, _) = runs
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert ma["critic/score/mean"] == mb["critic/score/mean"]
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_micro_batching_does_not_change_the_update():
    """Micro-batches of 2 or 8 rows: the same gradients (to float rounding), so the same
    weights. The gradients compared are the second mini-batch's, taken at weights that the
    first Adam step already moved by rounding-sized amounts, so an element may differ by a few
    1e-5 of its tensor's largest entry (seen: 1.5e-7 at a largest 4.8e-3 on an AVX2 EPYC);
    a wrong micro-batch weight would be off by tens of percent. Adam divides each gradient by its own running size, so an element whose gradient
    is near 0 turns rounding into up to a fraction of a step: the gradients are compared to
    float rounding, the weights to 1e-6 but for at most 1 in 10,000, which may differ by up to
    a tenth of one step (lr = 1e-3)."""
    out, grads = [], []
    for micro in (2, 8):
        cfg = load_config(
            "configs/grpo_tiny.yaml",
            [SIGNAL, f"actor.ppo_micro_batch_size={micro}", "trainer.total_training_steps=1"],
        )
        engine, _ = train(cfg)
        out.append(state(engine))
        grads.append({k: p.grad.clone() for k, p in engine.actor.policy.named_parameters()})
    for k in grads[0]:
        scale = float(grads[1][k].abs().max())
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-4 * scale, msg=k)
    assert_same_weights(out[0], out[1], outliers_atol=1e-4)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "remax"])
def test_other_estimators_run_a_step(estimator):
    cfg = load_config("configs/grpo_tiny.yaml", [SIGNAL, f"algorithm.adv_estimator={estimator}"])
    engine = Engine(cfg)
    before = params(engine.actor.policy)
    batch = engine.reward(engine.rollout(1))
    if estimator == "remax":
        assert batch["reward_baselines"].shape == (16,)
    metrics = engine.update(engine.advantage(batch)).meta["metrics"]
    assert math.isfinite(metrics["actor/pg_loss"])
    assert_all_changed(before, params(engine.actor.policy))


def test_kl_in_reward_with_adaptive_controller():
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [
            SIGNAL,
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.1",
            "algorithm.kl_ctrl.target_kl=0.01",
            "algorithm.kl_penalty=low_var_kl",
        ],
    )
    engine = Engine(cfg)
    assert engine.actor.ref is not None and not engine.cfg.on_policy_single_update
    m1 = engine.step(1)
    m2 = engine.step(2)
    assert m1["actor/reward_kl_penalty_coeff"] == 0.1
    assert m2["actor/reward_kl_penalty"] > 0  # the policy moved away from the reference
    assert m2["actor/reward_kl_penalty_coeff"] != 0.1  # the controller adapted


def test_on_policy_shortcut_matches_recomputed_old_log_probs():
    """Skipping the old-log-prob pass (one update per batch) must not change the result."""
    out = []
    for epochs in ("1", "1+recompute"):
        cfg = load_config("configs/grpo_tiny.yaml", [SIGNAL, "actor.ppo_mini_batch_size=16"])
        engine = Engine(cfg)
        batch = engine.reward(engine.rollout(1))
        if epochs == "1+recompute":
            batch = batch.union(engine.actor.compute_log_prob(batch))
        batch = engine.advantage(batch)
        assert ("old_log_probs" in batch) == (epochs == "1+recompute")
        engine.update(batch)
        out.append(state(engine))
    for k in out[0]:
        torch.testing.assert_close(out[0][k], out[1][k], rtol=1e-4, atol=1e-6)


def test_overlong_penalty_lowers_the_rewards_of_long_responses():
    base = [SIGNAL, "rollout.max_new_tokens=8"]
    plain = Engine(load_config("configs/grpo_tiny.yaml", base))
    shaped = Engine(load_config("configs/grpo_tiny.yaml", [*base, "reward.overlong_buffer_len=4"]))
    a, b = plain.reward(plain.rollout(1)), shaped.reward(shaped.rollout(1))
    lengths = a["response_mask"].sum(-1).float()
    expected = a["token_level_scores"].sum(-1) - ((lengths - 4).clamp(min=0) / 4).clamp(max=1)
    torch.testing.assert_close(b["token_level_scores"].sum(-1), expected)
    assert b.meta["metrics"]["critic/score/mean"] == a.meta["metrics"]["critic/score/mean"]
    assert b.meta["metrics"]["critic/overlong_penalty/mean"] < 0


def test_rollout_shares_the_training_weights_at_one_rank(tokenizer):
    """Zero copy: the rollout module's parameters are the training parameters' storage."""
    from hybrid_engine.roles.workers import ActorRolloutRef

    engine = Engine(load_config("configs/grpo_tiny.yaml", [SIGNAL]))
    actor = engine.actor
    ptrs = [p.data_ptr() for p in actor.policy.parameters()]
    assert actor.rollout_weights.shares_storage
    assert actor.rollout_weights.data_ptrs() == ptrs
    engine.step(1)  # after an update the rollout still reads the same (updated) storage
    assert (
        actor.rollout_weights.data_ptrs()
        == ptrs
        == [p.data_ptr() for p in actor.policy.parameters()]
    )

    copy_cfg = load_config(
        "configs/grpo_tiny.yaml", [SIGNAL, "actor.layout.rollout.separate_copy=true"]
    )
    separate = ActorRolloutRef(copy_cfg, tokenizer)
    assert not set(separate.rollout_weights.data_ptrs()) & {
        p.data_ptr() for p in separate.policy.parameters()
    }


@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_freed_memory_stops_page_faults_on_reallocation(reuse):
    """An update's pattern: ~500 MB of 3-7 MB tensors and one 160 MB tensor, allocated and
    freed six times. By default glibc maps the 160 MB tensor afresh (it is above the 32 MB
    ceiling of heap blocks) and faults it in every round, and returns some of the small ones
    too, how many depending on the heap's layout; with `reuse_freed_memory` the rounds after
    the first reuse the pages."""
    code = f"""
import resource, torch
from hybrid_engine.roles.workers import reuse_freed_memory
if {reuse}:
    assert reuse_freed_memory()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xs = [torch.ones((k % 5 + 3) * 2**18) for k in range(100)]
    big = torch.ones(40 * 2**20)
    del xs, big
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[3:]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    faults = int(out.stdout.split()[-1])
    pages = 3 * 660 * 2**20 // resource.getpagesize()  # the last three rounds' memory
    big = 3 * 160 * 2**20 // resource.getpagesize()  # their 160 MB tensors'
    assert (faults < pages // 20) if reuse else (faults > big * 9 // 10), faults


def test_a_gspo_run_recorded_before_it_followed_loss_agg_mode_resumes_with_its_loss(tmp_path):
    import json

    from flows.opening import resumed_config
    from hybrid_engine.config import redact

    where = f"storage.root={tmp_path}"
    gspo = ["actor.policy_loss.mode=gspo", SIGNAL, where]
    config = redact(load_config("configs/grpo_tiny.yaml", gspo).model_dump(mode="json"))
    config["actor"]["policy_loss"].pop("aggregation", None)  # no such key before
    (tmp_path / "old").mkdir()
    old = {"run_id": "old", "config": config, "code_version": "0.1.0+e8cf443"}
    old |= {"created_at": 1796200000.0, "driver": {}}  # 2026-12-02, before 87ae0d0
    (tmp_path / "old" / "run.json").write_text(json.dumps(old))
    resumed = Engine(resumed_config("old", [where]))
    as_trained = Engine(
        load_config("configs/grpo_tiny.yaml", [*gspo, "actor.loss_agg_mode=seq-mean-token-mean"])
    )
    batch = as_trained.advantage(as_trained.reward(as_trained.rollout(1)))
    for j in range(0, len(batch), 3):  # responses of different lengths: the modes differ
        batch["response_mask"][j, 8 - j % 7 :] = 0
    got = resumed.update(batch.take(list(range(len(batch))))).meta["metrics"]
    want = as_trained.update(batch).meta["metrics"]
    assert got["actor/pg_loss"] == want["actor/pg_loss"]  # seq-mean-token-mean, as it trained
    mine, theirs = params(resumed.actor.policy), params(as_trained.actor.policy)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)  # bit-equal
    assert resumed.cfg.actor.loss_agg_mode == "token-mean"  # the entropy and KL terms' own
