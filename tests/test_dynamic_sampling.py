"""DAPO dynamic sampling in the engine: only varied groups train, the data order is one
stream consumed once, the limit fails or fills as configured."""

import pytest
import torch

from hybrid_engine.config import load_config
from hybrid_engine.engine import Engine
from hybrid_engine.rollout.dynamic_sampling import (
    DynamicSamplingExhausted,
    concat_rollouts,
    round_prompts,
)
from hybrid_engine.step_metrics import combined_metrics

ON = ["reward.function=reward_fns:half_solved", "algorithm.filter_groups.enabled=true"]


def groups(batch):
    out = {}
    for uid, acc in zip(batch["uid"], batch["acc"].tolist(), strict=True):
        out.setdefault(uid, []).append(acc)
    return out


def test_only_varied_groups_train_and_the_next_step_starts_after_them():
    engine = Engine(load_config("configs/grpo_tiny.yaml", ON))
    b1 = engine.sample(1)
    g1 = b1.meta["gen_batches"]
    assert g1 == list(range(1, len(g1) + 1)) and len(g1) >= 2  # half the groups are solved
    assert len(b1) == 16 and len(groups(b1)) == 4
    assert all(max(v) != min(v) for v in groups(b1).values())  # every kept group varies
    assert all(uid.split("-")[0] in {str(g) for g in g1} for uid in b1["uid"])
    m = b1.meta["metrics"]
    assert m["dynamic_sampling/gen_batches"] == len(g1)
    sizes = b1.meta["gen_batch_prompts"]  # whole generation batches, the last one cut
    assert sizes[:-1] == [4] * (len(sizes) - 1) and len(sizes) == len(g1)
    assert m["dynamic_sampling/prompts_consumed"] == sum(sizes)
    assert m["dynamic_sampling/kept_groups"] >= 4 and m["dynamic_sampling/trained_groups"] == 4
    # samples of a group stay consecutive (shared prefill and packing rely on it)
    uids = b1["uid"]
    assert all(uids[i] == uids[i - i % 4] for i in range(16))
    # the reward stage keeps the scores it was given; the step trains
    assert torch.equal(engine.reward(b1)["token_level_scores"], b1["token_level_scores"])
    engine.update(engine.advantage(b1))
    b2 = engine.sample(2)
    assert b2.meta["gen_batches"][0] == g1[-1] + 1  # no prompt consumed twice, none skipped


@pytest.mark.parametrize("fn", ["half_solved", "rarely_varied"])
def test_every_prompt_of_the_data_order_is_generated_once(fn):
    cfg = load_config("configs/grpo_tiny.yaml", [*ON, f"reward.function=reward_fns:{fn}"])
    engine, rounds = Engine(cfg), []
    for step in (1, 2, 3):  # as the non-adaptive rounds: whole generation batches
        engine.sample(step, save=lambda j, part: rounds.append(list(dict.fromkeys(part["uid"]))))
    generated = [uid for r in rounds for uid in r]
    last = int(generated[-1].split("-")[0])
    assert generated == [f"{g}-{i}" for g in range(1, last + 1) for i in range(4)]
    assert engine.next_gen_batch == last + 1


def test_a_round_takes_the_prompts_the_kept_rate_asks_for():
    # round_prompts(groups, kept, consumed, cap, adaptive, allowed batches): whole batches
    assert round_prompts(8, 0, 0, 32, True, None) == 8  # the first round: one batch
    assert round_prompts(8, 2, 8, 32, False, None) == 8  # verl's recipe: one batch
    assert round_prompts(8, 2, 8, 32, True, None) == 24  # 6 missing at 1/4
    assert round_prompts(8, 1, 8, 32, True, None) == 32  # 7 missing at 1/8: the cap
    assert round_prompts(8, 0, 8, 32, True, None) == 32  # none kept yet: the cap
    assert round_prompts(8, 6, 8, 32, True, None) == 8  # 2 missing at 3/4: 3 prompts, 1 batch
    assert round_prompts(8, 7, 16, 32, True, 12) == 8  # 1 missing at 7/16: ceil(2.29)
    assert round_prompts(8, 2, 8, 32, True, 2) == 16  # 24 asked, 2 batches left of the limit
    assert round_prompts(8, 0, 8, 36, True, None) == 32  # the whole batches the cap holds
    # the first round at the rate of the step before, (groups kept, prompts used)
    assert round_prompts(8, 0, 0, 32, True, None, (2, 8)) == 32  # 8 groups at 1/4
    assert round_prompts(8, 0, 0, 32, True, None, (6, 8)) == 16  # at 3/4: 11 prompts
    assert round_prompts(8, 0, 0, 32, True, None, (9, 8)) == 8  # at least a batch
    assert round_prompts(8, 0, 0, 32, True, None, (0, 64)) == 32  # none kept: the cap
    assert round_prompts(8, 0, 0, 32, False, None, (2, 8)) == 8


def test_the_first_prompts_of_a_generation_batch_sample_as_in_the_whole_batch():
    engine = Engine(load_config("configs/grpo_tiny.yaml", ON))
    whole, part = engine.rollout(1, 2), engine.rollout(1, 2, n_prompts=2)
    assert part["uid"] == whole["uid"][:8]
    width = part["response_ids"].shape[1]
    assert torch.equal(part["response_ids"], whole["response_ids"][:8, :width])
    # a round past the batch goes on into the next ones, in the data order
    wide = engine.rollout(1, 2, n_prompts=6)
    assert wide["uid"][::4] == ["2-0", "2-1", "2-2", "2-3", "3-0", "3-1"]
    rows = engine.data.step_rows(2) + engine.data.step_rows(3)[:2]
    assert wide["ground_truth"][::4] == [r["reward_model"]["ground_truth"] for r in rows]


def test_rounds_follow_the_kept_rate_or_take_one_batch_each():
    rare = ["reward.function=reward_fns:rarely_varied", "algorithm.filter_groups.enabled=true"]
    batch = Engine(load_config("configs/grpo_tiny.yaml", rare)).sample(1)
    m, sizes = batch.meta["metrics"], batch.meta["gen_batch_prompts"]
    assert sizes[:-1] == [4] * (len(sizes) - 1) and 1 <= sizes[-1] <= 4  # the last one cut
    assert m["dynamic_sampling/prompts_consumed"] == sum(sizes)
    assert m["dynamic_sampling/rounds"] < len(sizes)  # a round spanned generation batches
    # the next step's first round is sized by this step's kept rate
    engine = Engine(load_config("configs/grpo_tiny.yaml", rare))
    first = engine.sample(1).meta["kept_of_prompts"]
    rounds = []
    engine.sample(2, save=lambda j, part: rounds.append(len(set(part["uid"]))))
    assert rounds[0] == round_prompts(4, 0, 0, 16, True, None, tuple(first)) > 4
    off = [*rare, "algorithm.filter_groups.adaptive_rounds=false"]
    batch = Engine(load_config("configs/grpo_tiny.yaml", off)).sample(1)
    sizes = batch.meta["gen_batch_prompts"]
    assert len(sizes) >= 2 and sizes == [4] * len(sizes)
    assert batch.meta["metrics"]["dynamic_sampling/rounds"] == len(sizes)


def test_generation_batches_of_different_widths_concatenate():
    engine = Engine(load_config("configs/grpo_tiny.yaml", ON))
    a, b = (engine.reward(engine.rollout(1, g)) for g in (1, 2))
    b = b.take(list(range(len(b))))
    b["response_ids"], b["response_mask"] = b["response_ids"][:, :3], b["response_mask"][:, :3]
    for k in ("token_level_scores",):
        b[k] = b[k][:, :3]
    both = concat_rollouts([a, b], engine.tokenizer.pad_token_id)
    width = a["response_ids"].shape[1]
    assert both["response_ids"].shape == (32, width)
    assert (both["response_ids"][16:, 3:] == engine.tokenizer.pad_token_id).all()
    assert (both["response_mask"][16:, 3:] == 0).all()
    # prompts left-padded to the wider of the two: a's rows end exactly as before
    wide = a["input_ids"].shape[1]
    assert torch.equal(both["input_ids"][:16, -wide:], a["input_ids"])
    assert (both["attention_mask"][:16, :-wide] == 0).all()


def test_the_limit_fails_by_default_or_fills_the_batch():
    solved = [
        "reward.function=reward_fns:always_one",
        "algorithm.filter_groups.enabled=true",
        "algorithm.filter_groups.max_num_gen_batches=2",
    ]
    engine = Engine(load_config("configs/grpo_tiny.yaml", solved))
    with pytest.raises(DynamicSamplingExhausted, match="2 generation batches.*0 of the 4"):
        engine.sample(1)
    engine = Engine(
        load_config(
            "configs/grpo_tiny.yaml", [*solved, "algorithm.filter_groups.on_exhausted=train"]
        )
    )
    batch = engine.sample(1)
    assert len(batch) == 16 and batch.meta["gen_batches"] == [1, 2]
    assert batch.meta["metrics"]["dynamic_sampling/kept_groups"] == 0
    assert {u.split("-")[0] for u in batch["uid"]} == {"1"}  # filled in generation order


def test_filtering_needs_groups():
    from hybrid_engine.config import ConfigError

    with pytest.raises(ConfigError, match="filter_groups.*rollout.n >= 2"):
        load_config(
            "configs/grpo_tiny.yaml",
            [
                *ON,
                "rollout.n=1",
                "actor.ppo_mini_batch_size=4",
                "algorithm.adv_estimator=reinforce_plus_plus",
            ],
        )


@pytest.mark.fast
def test_round_metrics_add_seconds_keep_the_largest_maximum_and_average_the_rest():
    rounds = [
        {"timing_s/weight_sync": 0.5, "rollout/logprob_gap_max": 1e-6, "x/mean": 1.0},
        {"rollout/logprob_gap_max": 3e-6, "x/mean": 3.0, "timing_s/reward": 2.0},
    ]
    assert combined_metrics(rounds) == {
        "timing_s/weight_sync": 0.5,
        "rollout/logprob_gap_max": 3e-6,
        "x/mean": 2.0,
        "timing_s/reward": 2.0,
    }
