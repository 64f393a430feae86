"""A parked run's state offloaded to disk and read back (`pool.slots`): the storages of its
models and optimizer are freed, then hold the same bytes again, and training goes on exactly
as if they had never left; a failed write frees nothing."""

from types import SimpleNamespace

import pytest
import torch

from hybrid_engine.pool.slots import offload, resident_bytes, restore

pytestmark = pytest.mark.fast


def roles(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    model[1].weight = torch.nn.Parameter(model[0].weight.t().contiguous())  # shapes differ
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"actor": SimpleNamespace(model=model, optimizer=optim, name="not a tensor")}


def train(r: dict, steps: int) -> None:
    torch.manual_seed(1)
    a = r["actor"]
    for _ in range(steps):
        loss = a.model(torch.randn(4, 8)).square().mean()
        loss.backward()
        a.optimizer.step()
        a.optimizer.zero_grad()


def test_offloaded_state_comes_back_bit_for_bit_and_trains_on_as_before(tmp_path):
    alone, parked = roles(), roles()
    train(alone, 2)
    train(parked, 2)
    size = resident_bytes(parked)
    assert size > 0
    path = tmp_path / "w" / "run.bin"
    held = offload(parked, path)
    assert resident_bytes(parked) == 0 and path.stat().st_size == size
    restore(held, path)
    assert not path.exists() and resident_bytes(parked) == size
    train(alone, 2)
    train(parked, 2)
    for got, want in zip(
        parked["actor"].model.state_dict().values(),
        alone["actor"].model.state_dict().values(),
        strict=True,
    ):
        assert torch.equal(got, want)
    exp_avg = [s["exp_avg"] for s in parked["actor"].optimizer.state.values()]
    assert all(
        torch.equal(g, w["exp_avg"])
        for g, w in zip(exp_avg, alone["actor"].optimizer.state.values(), strict=True)
    )


def test_a_write_that_fails_frees_nothing(tmp_path):
    r = roles()
    train(r, 1)
    size = resident_bytes(r)
    (tmp_path / "run.bin").mkdir()  # a folder where the file should go: the open fails
    with pytest.raises(OSError):
        offload(r, tmp_path / "run.bin")
    assert resident_bytes(r) == size
    train(r, 1)  # still usable
