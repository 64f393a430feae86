"""A broken policy loss for the non-finite tests (its own module: importing it registers
nothing else)."""

import torch

from hybrid_engine.algorithms import register_policy_loss
from hybrid_engine.algorithms.losses import agg_loss


@register_policy_loss("plugin_nan")
def nan_pg(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, **_):
    """The plain policy gradient times NaN (a non-finite update)."""
    pg = agg_loss(-log_prob * advantages * float("nan"), response_mask, loss_agg_mode)
    zero = torch.zeros((), device=pg.device)
    return pg, zero, zero, zero
