"""Helpers for tests against hand-computed numbers."""

import torch


def T(x, dtype=torch.float32):
    """A float32 (or `dtype`) tensor from nested lists."""
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol=1e-5):
    """`actual` equals the hand-computed `expected` to `atol`."""
    torch.testing.assert_close(actual, T(expected), atol=atol, rtol=0)
