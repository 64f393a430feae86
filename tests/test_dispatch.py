"""Splitting a batch over data-parallel ranks and gathering it back (no Ray needed)."""

import pytest
import torch

from hybrid_engine.batch import Batch
from hybrid_engine.pool.dispatch import gather_rows, mean_metrics, split_for_update, split_rows

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast

PAD = 7


def rows(n: int) -> Batch:
    return Batch(
        {"x": torch.arange(n), "ids": torch.arange(n * 2).reshape(n, 2)},
        {"uid": [f"u{i}" for i in range(n)]},
        {"step": 3},
    )


def test_uneven_batch_is_padded_then_unpadded():
    batch = rows(5)
    parts, pad = split_rows(batch, 2)
    assert pad == 1 and [len(p) for p in parts] == [3, 3]
    assert parts[1]["x"].tolist() == [3, 4, 4]  # the last row repeated
    assert [p.meta["row_offset"] for p in parts] == [0, 3]
    back = gather_rows(parts, pad, PAD)
    assert back["x"].tolist() == [0, 1, 2, 3, 4]
    assert back["uid"] == batch["uid"] and back.meta == {"step": 3}


def test_gather_pads_each_ranks_responses_to_the_longest():
    a = Batch({"response_ids": torch.tensor([[1, 2, 3]]), "response_mask": torch.ones(1, 3)})
    b = Batch({"response_ids": torch.tensor([[4]]), "response_mask": torch.ones(1, 1)})
    out = gather_rows([a, b], 0, PAD)
    assert out["response_ids"].tolist() == [[1, 2, 3], [4, PAD, PAD]]
    assert out["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_update_split_gives_each_rank_a_slice_of_every_mini_batch():
    batch = rows(8)
    parts = split_for_update(batch, 2, 4)  # mini-batches [0..3], [4..7]
    assert [p["x"].tolist() for p in parts] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # each rank's k-th mini-batch (size 2) + the others' k-th = the k-th global mini-batch
    for k in range(2):
        got = sorted(v for p in parts for v in p["x"][k * 2 : (k + 1) * 2].tolist())
        assert got == list(range(k * 4, k * 4 + 4))
    with pytest.raises(ValueError, match="cannot be divided"):
        split_for_update(rows(6), 4, 6)


def test_one_rank_is_the_identity():
    batch = rows(3)
    parts, pad = split_rows(batch, 1)
    assert pad == 0 and torch.equal(gather_rows(parts, pad, PAD)["ids"], batch["ids"])


def test_mean_metrics():
    assert mean_metrics([{"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.0}]) == {"a": 2.0, "b": 2.0}


def test_update_split_fills_a_short_last_mini_batch_with_untrained_rows():
    batch = rows(6)
    batch["response_mask"] = torch.ones(6, 3, dtype=torch.long)
    parts = split_for_update(batch, 2, 4)  # 6 rows -> mini-batches [0..3], [4, 5, 5', 5']
    assert [p["x"].tolist() for p in parts] == [[0, 1, 4, 5], [2, 3, 5, 5]]
    assert parts[0]["response_mask"].sum(-1).tolist() == [3, 3, 3, 3]
    assert parts[1]["response_mask"].sum(-1).tolist() == [3, 3, 0, 0]
