import json

import pytest
import torch

from hybrid_engine.batch import JSON_FILE, TENSORS_FILE, Batch

pytestmark = pytest.mark.fast  # the inner loop: bash scripts/test.sh -m fast


def make(n: int = 4) -> Batch:
    return Batch(
        {"ids": torch.arange(n * 3).reshape(n, 3), "mask": torch.ones(n, 3)},
        {"uid": [f"u{i}" for i in range(n)], "info": [{"k": i, "xs": [i, None]} for i in range(n)]},
        {"step": 7},
    )


def test_len_and_mismatched_sizes_rejected():
    assert len(make(4)) == 4
    with pytest.raises(ValueError, match="disagree"):
        Batch({"a": torch.zeros(3, 2)}, {"b": [1, 2]})


def test_select_take_split_chunk():
    b = make(5)
    s = b.select(["ids", "uid"])
    assert s.keys() == ["ids", "uid"] and s.meta == {"step": 7}
    assert s["ids"].data_ptr() == b["ids"].data_ptr()  # shares storage
    with pytest.raises(KeyError, match="nope"):
        b.select(["nope"])
    t = b.take([4, 0])
    assert t["uid"] == ["u4", "u0"] and t["ids"].tolist() == [[12, 13, 14], [0, 1, 2]]
    parts = b.split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert parts[2]["uid"] == ["u4"]
    with pytest.raises(ValueError, match="equal parts"):
        b.chunk(2)
    assert [p["uid"] for p in make(4).chunk(2)] == [["u0", "u1"], ["u2", "u3"]]


def test_concat_is_inverse_of_split():
    b = make(5)
    c = Batch.concat(b.split(2))
    assert torch.equal(c["ids"], b["ids"]) and c["uid"] == b["uid"] and c["info"] == b["info"]
    with pytest.raises(ValueError, match="fields differ"):
        Batch.concat([b, b.select(["ids"])])


def test_repeat_interleave():
    b = make(2).repeat_interleave(3)
    assert b["uid"] == ["u0"] * 3 + ["u1"] * 3
    assert b["ids"][:, 0].tolist() == [0, 0, 0, 3, 3, 3]


def test_union():
    b = make(3)
    extra = Batch({"adv": torch.zeros(3, 3)}, {"uid": b["uid"]}, {"x": 1})
    u = b.union(extra)
    assert set(u.keys()) == {"ids", "mask", "uid", "info", "adv"} and u.meta == {"step": 7, "x": 1}
    with pytest.raises(ValueError, match="differs"):
        b.union(Batch({"ids": torch.zeros(3, 3, dtype=torch.long)}))
    with pytest.raises(ValueError, match="samples"):
        b.union(make(2))


def test_setitem_and_getitem():
    b = make(2)
    b["score"] = torch.tensor([1.0, 2.0])
    b["tag"] = ("a", "b")
    assert b["tag"] == ["a", "b"] and "score" in b
    with pytest.raises(ValueError):
        b["bad"] = torch.zeros(3)
    with pytest.raises(KeyError, match="has no field"):
        b["missing"]


def test_save_load_round_trip_without_pickle(tmp_path):
    b = make(3)
    b["f16"] = torch.randn(3, 2).half()
    b.save(tmp_path)
    # The JSON part is plain JSON and the tensor part is safetensors: no pickle.
    doc = json.loads((tmp_path / JSON_FILE).read_text())
    assert doc["non_tensors"]["uid"] == ["u0", "u1", "u2"] and doc["meta"] == {"step": 7}
    assert (tmp_path / TENSORS_FILE).read_bytes()[8:9] == b"{"  # safetensors header
    c = Batch.load(tmp_path)
    assert c.keys() == b.keys() or set(c.keys()) == set(b.keys())
    for k in b.tensors:
        assert torch.equal(c[k], b[k]) and c[k].dtype == b[k].dtype
    assert c["info"] == b["info"] and c.meta == b.meta


def test_empty_batch_round_trip():
    b = Batch(meta={"metrics": {"a": 1.0}})
    assert len(b) == 0
    c = Batch.from_bytes(*b.to_bytes())
    assert c.meta == {"metrics": {"a": 1.0}} and len(c) == 0
