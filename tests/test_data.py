import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybrid_engine.config import DataConfig
from hybrid_engine.data import PromptData, file_rows, prompt_batch

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast

TASK = {
    "min_terms": 2,
    "max_terms": 2,
    "min_digits": 1,
    "max_digits": 1,
    "operators": ["+"],
    "allow_parentheses": False,
    "allow_negation": False,
}


def test_step_rows_deterministic_and_cover_an_epoch():
    cfg = DataConfig(task_config=TASK, train_size=12, val_size=40, train_batch_size=4)
    a, b = PromptData(cfg), PromptData(cfg)
    assert [a.step_rows(s) for s in (1, 2, 5)] == [b.step_rows(s) for s in (1, 2, 5)]
    epoch = [json.dumps(r["prompt"]) for s in (1, 2, 3) for r in a.step_rows(s)]
    assert sorted(epoch) == sorted(json.dumps(r["prompt"]) for r in a.train)
    assert a.step_rows(4) != a.step_rows(1)  # next epoch is reshuffled


def test_validation_never_shares_a_question_with_training():
    cfg = DataConfig(task_config=TASK, train_size=50, val_size=50, val_seed=1000)
    d = PromptData(cfg)
    train_q = {json.dumps(r["prompt"]) for r in d.train}
    assert d.val_dropped > 0  # this tiny task repeats questions by chance
    assert all(json.dumps(r["prompt"]) not in train_q for r in d.val)
    assert len(d.val) + d.val_dropped == 50


def test_bad_task_config_is_named():
    with pytest.raises(ValueError, match="data.task_config"):
        PromptData(DataConfig(task_config={"min_terms": 3, "max_terms": 2}))


def test_file_rows_parquet_jsonl_and_errors(tmp_path):
    row = {
        "prompt": [{"role": "user", "content": "1+1?"}],
        "data_source": "toy",
        "reward_model": {"ground_truth": "2"},
        "extra_info": {"i": 0},
    }
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "a.parquet")
    assert file_rows(str(tmp_path / "a.parquet"))[0]["reward_model"]["ground_truth"] == "2"
    (tmp_path / "b.jsonl").write_text(json.dumps(row) + "\n" + json.dumps({"prompt": []}) + "\n")
    with pytest.raises(ValueError, match="row 1 has no 'prompt'"):
        file_rows(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        file_rows(str(tmp_path / "c.jsonl"))
    with pytest.raises(FileNotFoundError):
        file_rows(str(tmp_path / "none.parquet"))


def test_prompt_batch_left_pads_and_checks_length(tokenizer):
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+1?"}],
            "data_source": "t",
            "reward_model": {"ground_truth": "2"},
            "extra_info": {},
        },
        {
            "prompt": [{"role": "user", "content": "a much longer question about 1+2?"}],
            "data_source": "t",
            "reward_model": {"ground_truth": "3"},
            "extra_info": {},
        },
    ]
    b = prompt_batch(rows, tokenizer, 256)
    ids, mask = b["prompt_ids"], b["prompt_mask"]
    assert mask[0, 0] == 0 and mask[1].all() and mask[:, -1].all()  # left padding
    assert (ids[0][mask[0] == 0] == tokenizer.pad_token_id).all()
    text = tokenizer.decode(ids[0][mask[0].bool()])
    assert text.endswith("<|im_start|>assistant\n") and "1+1?" in text
    assert b["ground_truth"] == ["2", "3"]
    with pytest.raises(ValueError, match="row 1 .*data.max_prompt_length=36"):
        prompt_batch(rows, tokenizer, 36)
