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


def assert_same_grad_norms(hist: list[dict], expected: list[dict], *prefixes: str) -> None:
    """Per-step `<prefix>/grad_norm` equal to 1e-4 relative. Weights alone cannot show a wrong
    gradient scale (a world size counted twice): AdamW and clip-by-norm cancel a constant
    factor; the norm before clipping shows it."""
    for prefix in prefixes or ("actor",):
        key = f"{prefix}/grad_norm"
        got = [h[key] for h in hist if key in h]
        want = [h[key] for h in expected if key in h]
        assert len(got) == len(want) > 0, (key, got, want)
        for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
            assert abs(g - w) <= 1e-4 * abs(w), f"{key} at step {step}: {g} vs {w}"
