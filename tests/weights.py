"""Comparing two models' weights where float rounding may differ (tests/test_*.py)."""

import torch


def assert_same_weights(a: dict, b: dict, outliers_atol: float | None = None) -> None:
    """Equal to 1e-6; with `outliers_atol`, at most 1 weight in 10,000 (over the whole model)
    may differ by more, and by no more than `outliers_atol`."""
    assert a.keys() == b.keys()
    outliers = 0
    for k in a:
        if outliers_atol is None:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
            continue
        diff = (a[k] - b[k]).abs()
        assert float(diff.max()) <= outliers_atol, (k, float(diff.max()))
        outliers += int((diff > 1e-6).sum())
    assert outliers <= 1e-4 * sum(v.numel() for v in a.values()), outliers
