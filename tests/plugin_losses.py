"""A user's own policy loss, registered by a module named in `algorithm.plugins`."""

import torch

from hybrid_engine.algorithms import register_policy_loss
from hybrid_engine.algorithms.losses import agg_loss


@register_policy_loss("plugin_scaled_pg")
def scaled_pg(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, **_):
    """A test loss: half the plain policy gradient -logp A / 2."""
    pg = agg_loss(-0.5 * log_prob * advantages, response_mask, loss_agg_mode)
    zero = torch.zeros((), device=pg.device)
    return pg, zero, zero, zero
