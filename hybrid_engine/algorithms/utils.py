"""Masked statistics over (batch, response_len) tensors.

A mask is any tensor broadcastable to ``x`` (float, int or bool); a position counts when its mask
entry is non-zero. Masked-out entries of ``x`` are never read (``torch.where``, not ``x * mask``),
so padding that holds inf/NaN cannot leak into a result or its gradient.
"""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "masked_var", "masked_whiten"]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_{i: mask_i != 0} x_i  (over ``dim``, or over everything when ``dim`` is None)."""
    kept = torch.where(mask.bool(), x, 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over ``dim`` (all when None); 0 where the mask is empty."""
    m = mask.bool().expand_as(x)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked positions: mean((x - mean(x))^2), times n/(n-1) if ``unbiased``.

    With fewer than two masked positions the Bessel factor is skipped (the result is 0).
    """
    m = mask.bool().expand_as(x)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum().to(x.dtype)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var over masked positions.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised).
    Values at masked-out positions are computed too but carry no meaning.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
